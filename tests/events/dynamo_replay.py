"""Replay a recorded KV event stream into NVIDIA Dynamo's KV router index and compare.

Run by the Dynamo venv's python (``scripts/dynamo_env.sh``), never imported beside the project:
``python dynamo_replay.py RECORDING`` prints one JSON object on stdout.

The recording (JSON lines, written by test_router_agreement.py): first
``{"prompts": [{"tokens": [...], "lora": name|null}], "block_size": n}``, then in stream order
``{"worker": "<publisher> <medium>", "events": [vLLM events as maps, hashes as hex]}`` and
``{"check": [blocks the cache's lookup serves, per prompt]}`` at each quiet point.

Each vLLM event is translated to Dynamo's JSON: ``BlockStored`` → ``stored`` with
``parent_hash`` and ``blocks[{block_hash, tokens_hash}]`` (``block_hash``: vLLM's int form of
the hash, its low 64 bits big-endian; ``tokens_hash`` from Dynamo's own
``compute_block_hash_for_seq(token_ids, block_size, lora_name=...)``), ``BlockRemoved`` →
``removed``, ``AllBlocksCleared`` → ``cleared``; one ``worker_id`` per publisher and medium.
At each check, for every prompt: the index's overlap for that worker (matched blocks) against
the cache's answer; more is a phantom hit, fewer a missed hit.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from dynamo._core import RadixTree, compute_block_hash_for_seq

MASK = (1 << 64) - 1


def _h(v: object) -> int:
    if isinstance(v, int):
        return v & MASK
    assert isinstance(v, str)
    return int(v, 16) & MASK


def translate(ev: dict, block_size_default: int) -> dict:
    kind = ev["type"]
    if kind == "BlockStored":
        bs = ev["block_size"] or block_size_default
        toks = compute_block_hash_for_seq(ev["token_ids"], bs, lora_name=ev.get("lora_name"), block_mm_infos=None)
        parent = ev["parent_block_hash"]
        return {"stored": {
            "parent_hash": None if parent is None else _h(parent),
            "blocks": [{"block_hash": _h(h), "tokens_hash": t} for h, t in zip(ev["block_hashes"], toks, strict=True)],
        }}  # fmt: skip
    if kind == "BlockRemoved":
        return {"removed": {"block_hashes": [_h(h) for h in ev["block_hashes"]]}}
    if kind == "AllBlocksCleared":
        return "cleared"  # type: ignore[return-value]
    raise ValueError(f"unknown event {kind}")


def main(path: str) -> dict:
    tree = RadixTree()
    workers: dict[str, int] = {}
    event_id = 0
    out: dict[str, Any] = {
        "checks": 0,
        "comparisons": 0,
        "phantom": 0,
        "missed": 0,
        "applied": 0,
        "errors": 0,
        "first_mismatch": None,
    }
    prompts: list[list[int]] = []
    with open(path) as f:
        head = json.loads(f.readline())
        block_size = head["block_size"]
        for p in head["prompts"]:
            prompts.append(
                compute_block_hash_for_seq(p["tokens"], block_size, lora_name=p["lora"], block_mm_infos=None)
            )
        for line in f:
            rec = json.loads(line)
            if "events" in rec:
                wid = workers.setdefault(rec["worker"], len(workers) + 1)
                for ev in rec["events"]:
                    event_id += 1
                    data = translate(ev, block_size)
                    try:
                        tree.apply_event(wid, json.dumps({"event_id": event_id, "data": data}).encode())
                        out["applied"] += 1
                    except Exception:
                        out["errors"] += 1
                continue
            out["checks"] += 1
            for i, want in enumerate(rec["check"]):
                scores = tree.find_matches(prompts[i]).scores
                got = max((v for (w, _dp), v in scores.items() if w in workers.values()), default=0)
                out["comparisons"] += 1
                if got > want:
                    out["phantom"] += 1
                elif got < want:
                    out["missed"] += 1
                if got != want and out["first_mismatch"] is None:
                    out["first_mismatch"] = {"check": out["checks"], "prompt": i, "index": got, "cache": want}
    out["workers"] = len(workers)
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
