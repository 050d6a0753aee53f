"""One vLLM engine of the load-or-recompute benchmark, in its own process.

``python vllm_kv_slow_child.py SPEC.json RESULT.json`` (run by :mod:`lmcache_async_bench.vllm_kv_slow`
with the engine environment). SPEC keys: ``model``, ``tokens``, ``vocab``, ``seeds`` (the prompts:
prompt ``s`` is :func:`prompt_ids` of seed ``s``), ``kv`` (our connector's extra config, or None),
``llm`` (more ``LLM`` keyword arguments, e.g. vLLM's native offloading), ``mode``:

* ``"store"``: each prompt once (run 1: our connector stores it);
* ``"pairs"``: per round ``i``, prompt ``auto[i]`` (stored by run 1, ``load_policy: auto``) and
  prompt ``uncached[i]`` (never stored), alternating which goes first — round 0 starts with the
  stored one, the first request of this process — then prompt ``always[i]`` (stored,
  ``load_policy: always`` through ``kv_transfer_params``: every hit loaded, as before the
  decision existed);
* ``"first"``: the prompts of ``seeds["all"]`` (one, usually), with no warm-up: the first
  request of a fresh process (``kind`` names it in the result);
* ``"hit"``: each prompt, then at once again: a restored prompt (run 2) beside vLLM's own
  prefix-cache hit of the same prompt in the same process;
* ``"reload"``: each prompt, then vLLM's prefix cache is reset, then the prompt again: a hit of
  the CPU offload tier (ours, or vLLM's native offloading) in the same process.

Each run is a one-token greedy ``generate`` after vLLM's prefix cache was reset (except the
measured second run of ``hit``): its wall time is the TTFT. With our connector each run is
followed, outside the timing, by a flush of the write-through (a recomputed prompt's records
crossing a slow link must not queue ahead of the next run's lookup). RESULT: the runs (``kind``, seed,
TTFT, first token, ``num_cached_tokens``), the scheduler-side connector's stats (decisions, the
lookup hook's call times) and the worker's, and ``error`` (None when it ran through).
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
import traceback
from pathlib import Path
from typing import Any

__all__ = ["WARMUP_SEED", "main", "prompt_ids", "run"]

WARMUP_SEED = 10_000_019


def prompt_ids(seed: int, tokens: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, vocab) for _ in range(tokens)]


def _engine(spec: dict[str, Any]) -> Any:
    from vllm import LLM

    kwargs: dict[str, Any] = dict(
        model=spec["model"],
        dtype="float32",
        max_model_len=max(int(spec["tokens"]) + 64, 1024),
        max_num_batched_tokens=max(int(spec["tokens"]) + 64, 1024),
        max_num_seqs=4,
        enforce_eager=True,
        enable_prefix_caching=True,
        disable_log_stats=False,
        seed=0,
    )
    kwargs.update(spec.get("llm") or {})
    if spec.get("kv") is not None:
        from vllm.config import KVTransferConfig

        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="LMCacheKVConnector",
            kv_connector_module_path="lmcache_async.integration.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=spec["kv"],
        )
    return LLM(**kwargs)


def _one(llm: Any, ids: list[int], params: dict[str, Any] | None = None, reset: bool = True) -> dict[str, Any]:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=1, temperature=0.0)
    if params:
        sp.extra_args = {"kv_transfer_params": dict(params)}
    if reset and not llm.reset_prefix_cache():
        raise RuntimeError("vLLM did not reset its prefix cache")
    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]
    ttft = time.perf_counter() - t0
    return {
        "ttft_s": ttft,
        "token": out.outputs[0].token_ids[0] if out.outputs and out.outputs[0].token_ids else None,
        "cached": int(out.num_cached_tokens or 0),
    }


def _flush() -> None:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    get_kv_transfer_group().flush()


def _stats(llm: Any) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    sched = worker = None
    try:
        sched = llm.llm_engine.engine_core.engine_core.scheduler.connector.stats()
        sched.pop("manager", None)
    except Exception:
        sched = None
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        if has_kv_transfer_group():
            worker = get_kv_transfer_group().stats()
            worker.pop("manager", None)
    except Exception:
        worker = None
    return sched, worker


def run(spec: dict[str, Any]) -> dict[str, Any]:
    t0 = time.monotonic()
    llm = _engine(spec)
    result: dict[str, Any] = {"runs": [], "error": None, "start_s": time.monotonic() - t0}
    tokens, vocab = int(spec["tokens"]), int(spec["vocab"])
    seeds = spec["seeds"]
    mode = spec["mode"]

    def add(kind: str, seed: int, entry: dict[str, Any]) -> None:
        entry.update(kind=kind, seed=seed)
        result["runs"].append(entry)
        if spec.get("kv") is not None:  # the write-through of this prompt must not run beside the next
            t = time.perf_counter()
            _flush()
            entry["flush_s"] = time.perf_counter() - t

    if mode not in ("pairs", "first"):  # warm-up; in these modes the first request is measured
        _one(llm, prompt_ids(WARMUP_SEED, 256, vocab))
    if mode == "store":
        for s in seeds["all"]:
            add("store", s, _one(llm, prompt_ids(s, tokens, vocab)))
    elif mode == "pairs":
        for i, (a, u, b) in enumerate(zip(seeds["auto"], seeds["uncached"], seeds["always"], strict=True)):
            order = [("auto", a), ("uncached", u)] if i % 2 == 0 else [("uncached", u), ("auto", a)]
            for kind, s in order:
                add(kind, s, _one(llm, prompt_ids(s, tokens, vocab)))
            add("always", b, _one(llm, prompt_ids(b, tokens, vocab), {"load_policy": "always"}))
    elif mode == "first":  # the first request of a fresh process, and nothing else
        for s in seeds["all"]:
            add(spec.get("kind", "first"), s, _one(llm, prompt_ids(s, tokens, vocab)))
    elif mode == "hit":
        for s in seeds["all"]:
            ids = prompt_ids(s, tokens, vocab)
            add("restored", s, _one(llm, ids))
            add("prefix_hit", s, _one(llm, ids, reset=False))
    elif mode == "reload":
        for s in seeds["all"]:
            ids = prompt_ids(s, tokens, vocab)
            add("first", s, _one(llm, ids))
            add("reload", s, _one(llm, ids))
    else:
        raise ValueError(f"mode: unknown {mode!r}")
    result["scheduler"], result["worker"] = _stats(llm)
    result["total_s"] = time.monotonic() - t0
    return result


def main(spec_path: str, result_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    try:
        result = run(spec)
    except Exception as exc:
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(), "runs": []}
    Path(result_path).write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python vllm_kv_slow_child.py SPEC.json RESULT.json")
    sys.exit(main(sys.argv[1], sys.argv[2]))
