"""Running KV-connector engine children (``kv_child.py``) with fault injection at barriers."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .engines import CHILD_TIMEOUT_S, HERE, child_env, end_process_group

PROMPT_LEN = 3000
CHUNK = 256
BLOCK = 128  # vLLM's CPU default block size


def make_prompts(n: int, vocab: int, seed: int = 7) -> list[list[int]]:
    """``n`` distinct random prompts of :data:`PROMPT_LEN` token ids (no special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(PROMPT_LEN)] for _ in range(n)]


def expected_hit(prompt_len: int = PROMPT_LEN) -> int:
    """Tokens the connector restores for a fully stored prompt: whole chunks, cut to whole
    blocks below the last token."""
    full_chunks = (prompt_len // CHUNK) * CHUNK
    return min(full_chunks, ((prompt_len - 1) // BLOCK) * BLOCK)


def run_kv_engine(
    workdir: Path,
    name: str,
    spec: dict[str, Any],
    *,
    barriers: dict[str, Callable[[], None]] | None = None,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Run one ``kv_child.py``; returns its result (``error`` None when it ran through).

    ``barriers`` maps a phase's barrier name to what the parent does there (inject a fault)."""
    spec = dict(spec, name=name, workdir=str(workdir))
    spec_path, out_path, log_path = (workdir / f"{name}.{s}" for s in ("spec.json", "out.json", "log"))
    spec_path.write_text(json.dumps(spec))
    pending = dict(barriers or {})
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, str(HERE / "kv_child.py"), str(spec_path), str(out_path)],
            env=env or child_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=str(workdir),
            start_new_session=True,
        )
        try:
            while proc.poll() is None:
                for barrier in list(pending):
                    if (workdir / f"{barrier}.ready").exists():
                        pending.pop(barrier)()
                        (workdir / f"{barrier}.go").write_text("go")
                if time.monotonic() - t0 > CHILD_TIMEOUT_S:
                    raise TimeoutError(f"{name}: the engine did not finish in {CHILD_TIMEOUT_S} s")
                time.sleep(0.05)
        finally:
            end_process_group(proc)
    if not out_path.exists():
        return {"error": f"no result (exit {proc.returncode})", "log_tail": log_path.read_text()[-4000:], "runs": []}
    result: dict[str, Any] = json.loads(out_path.read_text())
    result["wall_s"] = time.monotonic() - t0
    if result.get("error"):
        result["log_tail"] = log_path.read_text()[-4000:]
    print(f"[e2e] {name}: {result['wall_s']:.1f} s (engine start {result.get('start_s', 0):.1f} s)")
    for i, run in enumerate(result.get("runs", [])):  # the figures each run measured
        ttft = run.get("ttft_s")
        print(
            f"[e2e]   {name} prompt {i}: cached {run.get('num_cached_tokens')} tokens, "
            f"TTFT {'-' if ttft is None else f'{ttft:.3f} s'}, generate {run.get('generate_s', 0):.3f} s"
        )
    return result


def ok_runs(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The per-prompt runs of an engine child that ran through (assert otherwise, with its log)."""
    assert result.get("error") is None, (
        f"{result.get('error')}\n{result.get('traceback', '')}\n{result.get('log_tail', '')}"
    )
    assert result["alive"]
    assert all(r["finished"] for r in result["runs"])
    return list(result["runs"])
