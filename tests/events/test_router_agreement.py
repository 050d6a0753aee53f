"""A real router's index agrees with the cache: a randomized workload on the node server.

10,000 operations on a server publishing events (stores of prompt prefixes, reads that move
the LRU order, evictions under pressure of a 1 MiB pool, deletes, entries a reader found
damaged and removed, clears, and a server restart), with a subscriber that loses 3% of the live
messages and recovers them through replay (and through a snapshot after the restart). At each
quiet point (the server's queue drained, the subscriber caught up) the test records, for every
prompt, how many blocks the cache's own lookup serves. Then:

* our own reading of the stream (stored minus removed) gives the same answer for every prompt;
* NVIDIA Dynamo's ``RadixTree`` fed the stream (translated to its JSON, tokens hashed by its own
  ``compute_block_hash_for_seq``) gives the same overlap: 0 phantom hits, 0 missed hits;
* vLLM's own ``KVEventBatch`` decoder reads every message.
"""

from __future__ import annotations

import json
import random
import struct
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from events.conftest import EventServer, free_port_pair, interpreter
from events.kv_workload import BLOCK_SIZE, CacheSide, Prompt, make_prompts

from lmcache_async.events.subscriber import EventSubscriber
from lmcache_async.events.wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from lmcache_async.testing.cache_server import private_dir

OPS = 10_000
QUIET_EVERY = 250
RESTART_AT = OPS // 2
HERE = Path(__file__).resolve().parent


@dataclass
class Run:
    recording: Path
    payloads: Path
    checks: int
    ops: int
    own_mismatches: int
    lost: int
    replays: int
    snapshots: int
    evictions: int


def _hex(v: object) -> object:
    return v.hex() if isinstance(v, bytes) else v


class Recorder:
    """The stream as the subscriber hands it out, our own reading of it, and the checks."""

    def __init__(self, path: Path, prompts: list[Prompt], worker: str) -> None:
        self.f = open(path, "w")  # noqa: SIM115
        self.f.write(json.dumps({"block_size": BLOCK_SIZE, "prompts": [
            {"tokens": list(p.tokens), "lora": p.lora_name} for p in prompts]}) + "\n")  # fmt: skip
        self.worker = worker
        self.blocks: set[object] = set()

    def batches(self, batches: list[KVEventBatch]) -> None:
        for b in batches:
            evs = []
            for e in b.events:
                if isinstance(e, BlockStored):
                    self.blocks.update(e.block_hashes)
                    evs.append({"type": "BlockStored", "block_hashes": [_hex(h) for h in e.block_hashes],
                                "parent_block_hash": _hex(e.parent_block_hash), "token_ids": e.token_ids,
                                "block_size": e.block_size, "lora_name": e.lora_name})  # fmt: skip
                elif isinstance(e, BlockRemoved):
                    self.blocks.difference_update(e.block_hashes)
                    evs.append({"type": "BlockRemoved", "block_hashes": [_hex(h) for h in e.block_hashes]})
                elif isinstance(e, AllBlocksCleared):
                    self.blocks.clear()
                    evs.append({"type": "AllBlocksCleared"})
            if evs:
                self.f.write(json.dumps({"worker": self.worker, "events": evs}) + "\n")

    def overlap(self, p: Prompt) -> int:
        n = 0
        for c in p.chunks:
            for h in c.block_hashes:
                if h not in self.blocks:
                    return n
                n += 1
        return n

    def check(self, want: list[int]) -> None:
        self.f.write(json.dumps({"check": want}) + "\n")


def _settle(srv: EventServer, sub: EventSubscriber, rec: Recorder, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = srv.status()["events"]
        if st["queued"] == 0:
            rec.batches(sub.catch_up(st["next_seq"]))
            if sub.next_seq == st["next_seq"]:
                return
        time.sleep(0.01)
    raise AssertionError(f"the event stream did not settle: {srv.status()['events']}")


def _operate(rng: random.Random, cache: CacheSide, prompts: list[Prompt]) -> None:
    p = rng.choice(prompts)
    r = rng.random()
    if r < 0.50:
        cache.store(p, rng.randint(1, len(p.chunks)))
    elif r < 0.72:
        cache.client.contains(list(p.keys), touch=True)  # a reader: the LRU order moves
    elif r < 0.87:
        cache.remove([rng.choice(p.keys)])  # a delete
    elif r < 0.995:
        cache.remove([rng.choice(p.keys)])  # a reader found the entry damaged and removed it
    else:
        cache.clear()


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    work = tmp_path_factory.mktemp("agreement")
    rng = random.Random(40)
    prompts = make_prompts(rng, 120)
    port = free_port_pair()
    srv = EventServer(private_dir(work / "srv"), port, max_local_cpu_size=1 / 1024).start()
    servers = [srv]
    drop = random.Random(41)
    sub = EventSubscriber(srv.endpoint, srv.replay_endpoint, lose=lambda _s: drop.random() < 0.03, keep_payloads=True)
    rec = Recorder(work / "recording.jsonl", prompts, f"{srv.endpoint} CPU")
    cache = CacheSide(srv.socket)
    checks = own_bad = evictions = 0
    try:
        rec.batches(sub.snapshot())
        for op in range(1, OPS + 1):
            if op == RESTART_AT:
                evictions += srv.status()["namespaces"]["events"]["evictions"]
                srv.stop()
                srv = EventServer(private_dir(work / "srv2"), port, max_local_cpu_size=1 / 1024)
                srv.socket, srv.sockdir = servers[0].socket, servers[0].sockdir
                servers.append(srv.start())
                cache.client.contains([prompts[0].keys[0]])  # the data client reconnects
                cache.reconnect()
            _operate(rng, cache, prompts)
            if op % QUIET_EVERY == 0:
                _settle(srv, sub, rec)
                want = [cache.lookup_blocks(p) for p in prompts]
                own_bad += sum(rec.overlap(p) != w for p, w in zip(prompts, want, strict=True))
                rec.check(want)
                checks += 1
        evictions += srv.status()["namespaces"]["events"]["evictions"]
        rec.f.close()
        payloads = work / "payloads.bin"
        payloads.write_bytes(b"".join(struct.pack(">I", len(p)) + p for p in sub.payloads or []))
        yield Run(work / "recording.jsonl", payloads, checks, OPS, own_bad,
                  sub.lost, sub.replays, sub.snapshots, evictions)  # fmt: skip
    finally:
        cache.close()
        sub.close()
        for s in servers:
            s.kill()


@pytest.mark.timeout(900)
def test_our_reading_of_the_stream_matches_the_cache_at_every_quiet_point(run: Run) -> None:
    assert run.ops >= 10_000 and run.checks == OPS // QUIET_EVERY
    assert run.evictions > 0, "the workload never put the pool under pressure"
    assert run.lost > 0 and run.replays > 0 and run.snapshots >= 2  # losses recovered; the restart resynced
    assert run.own_mismatches == 0


@pytest.mark.timeout(900)
def test_dynamos_radix_tree_agrees_with_the_cache_no_phantom_no_missed_hits(run: Run) -> None:
    python = interpreter("LMCACHE_ASYNC_DYNAMO_PYTHON", "NVIDIA Dynamo's index (scripts/dynamo_env.sh)")
    res = subprocess.run([python, str(HERE / "dynamo_replay.py"), str(run.recording)], capture_output=True,
                         text=True, timeout=600, check=False)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    print(
        f"dynamo agreement: {run.ops} operations ({run.evictions} evictions; the subscriber lost {run.lost} "
        f"messages, {run.replays} replays, {run.snapshots} snapshots): {out}"
    )
    assert out["checks"] == run.checks and out["comparisons"] == run.checks * 120
    assert out["errors"] == 0
    assert out["phantom"] == 0 and out["missed"] == 0, out["first_mismatch"]


@pytest.mark.timeout(600)
def test_vllms_own_decoder_reads_every_message(run: Run) -> None:
    python = interpreter("LMCACHE_ASYNC_VLLM_PYTHON", "vLLM (scripts/e2e_env.sh)")
    env = {"VLLM_TARGET_DEVICE": "cpu", "PATH": "/usr/bin:/bin"}
    res = subprocess.run([python, str(HERE / "vllm_decode.py"), str(run.payloads)], capture_output=True, text=True,
                         timeout=300, check=False, env=env)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    print(f"vLLM decoder: {out}")
    assert out["batches"] > 0 and out["events"].get("BlockStored", 0) > 0 and out["events"].get("BlockRemoved", 0) > 0
