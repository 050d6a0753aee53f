"""Figures of the KV connector on a sliding-window model (vLLM's hybrid KV-cache manager on).

Run from the repository root with the e2e environment's Python (``bash scripts/e2e_env.sh``
prints it)::

    python -m tests.e2e.sliding_window_figures WORKDIR [MAX_NUM_BATCHED_TOKENS] [nohma]

A store process writes five 3,000-token prompts to a disk directory; a new process then runs, per
prompt, one never-stored prompt (uncached), the stored prompt (our connector's hit from disk) and
the same prompt again with vLLM's prefix cache kept (vLLM's own hit). It prints each TTFT series
with its median, the per-pair ratios, the cached tokens and vLLM's KV-cache groups and capacity
(``nohma``: the hybrid manager off, every layer treated as full attention).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from .conftest import KV_MODEL_SIZES
from .kv_engines import make_prompts, run_kv_engine
from .model_variants import sliding_variant

PROMPTS = 5
WINDOW = 512
BASE_MODEL = Path.home() / ".cache/lmcache-async/model-tiny-llama-1-layers4-hidden512-heads8-kv_heads4"


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    work = Path(argv[0])
    work.mkdir(parents=True, exist_ok=True)
    model = sliding_variant(BASE_MODEL, WINDOW, KV_MODEL_SIZES["layers"])
    prompts = make_prompts(2 * PROMPTS, vocab=4096, seed=97)
    kv = {
        "max_local_cpu_size": 0.25,
        "staging_size": 0.05,
        "chunk_size": 256,
        "load_policy": "always",
        "local_disk": str(work / "disk"),
        "max_local_disk_size": 2.0,
    }
    llm: dict[str, object] = {"max_num_batched_tokens": int(argv[1]) if len(argv) > 1 else 1024}
    if len(argv) > 2 and argv[2] == "nohma":
        llm["disable_hybrid_kv_cache_manager"] = True
    base = {"model": str(model), "prompts": prompts, "max_tokens": 4, "kv": kv, "llm": llm}
    run_kv_engine(work, "store", {**base, "phases": [{"prompts": list(range(PROMPTS))}]})
    phases: list[dict[str, object]] = []
    for i in range(PROMPTS):
        phases += [{"prompts": [PROMPTS + i]}, {"prompts": [i]}, {"prompts": [i], "keep_prefix": True}]
    res = run_kv_engine(work, "load", {**base, "phases": phases})
    runs = res["runs"]
    uncached, ours, own = runs[0::3], runs[1::3], runs[2::3]
    print("kv_config", json.dumps(res.get("kv_config")))
    print("cached: ours", [r["num_cached_tokens"] for r in ours], "vLLM's own", [r["num_cached_tokens"] for r in own])
    for name, rs in (("uncached", uncached), ("ours (disk, new process)", ours), ("vLLM's own prefix hit", own)):
        xs = [r["ttft_s"] for r in rs]
        print(f"{name}: median {statistics.median(xs):.3f} s {[round(x, 3) for x in xs]}")
    ratios = [round(a["ttft_s"] / b["ttft_s"], 2) for a, b in zip(ours, own, strict=True)]
    print("per-pair ratios ours / vLLM's own", ratios)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
