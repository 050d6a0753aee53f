"""Encoder-cache figures (CPU-only config), each beside its same-run baseline (SPEC §6).

* ``put`` of a 1 MiB tensor (fresh hashes, the pool rotating over >= 128 MiB) vs the copy
  baseline; target <= 1.25x;
* ``get`` of a 1 MiB entry whose results the caller keeps vs the clone baseline (as many kept
  clones as kept results); target <= 1.2x;
* ``contains`` of a present and of an absent hash, absolute; target <= 3 µs.

Run: ``python -m lmcache_async_bench.ec [--quick] [--reps N]`` or ``lmcache-async bench ec``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lmcache_async.config import LMCacheEngineConfig
from lmcache_async.engines.encoder_cache import ECCacheEngine
from lmcache_async.metadata import LMCacheEngineMetadata

from .common import (
    BenchOptions,
    CloneBaseline,
    CopyBaseline,
    MiB,
    Result,
    format_table,
    median_time,
)

__all__ = ["SUITE", "bench_contains", "bench_get", "bench_put", "main", "run"]

SUITE = "ec"
_NSRC = 64


def _engine(pool_mib: int) -> ECCacheEngine:
    cfg = LMCacheEngineConfig.from_defaults(max_local_cpu_size=pool_mib / 1024, staging_size=0)
    engine = ECCacheEngine(cfg, LMCacheEngineMetadata("bench-vl"), torch.bfloat16)
    pool = engine.storage_manager.pool
    assert pool is not None
    pool.wait_ready()
    return engine


def _sources() -> list[torch.Tensor]:
    # 1 MiB encoder outputs: [256 tokens, 1024 hidden] float32.
    return [torch.randn(256, 1024) for _ in range(_NSRC)]


def bench_put(opts: BenchOptions) -> list[Result]:
    """Each ``put`` is timed next to one baseline copy (op by op, order alternating), so load
    and drift hit both alike; a repetition is ``n`` puts over fresh hashes, its figure the mean
    per operation."""
    n = 128 if opts.quick else 512  # entries per repetition: the pool rotates over >= 128 MiB
    engine = _engine(n + 8)
    srcs = _sources()
    base = CopyBaseline(MiB, span=max(n, 128) * MiB)
    counter = iter(range(1 << 62))
    samples: list[float] = []
    base_samples: list[float] = []
    clock = time.perf_counter

    def one_round(record: bool) -> None:
        engine.storage_manager.clear_sync()
        hashes = [f"bench-put-{next(counter)}" for _ in range(n)]
        put, step = engine.put, base.step
        ours = [0.0] * n
        theirs = [0.0] * n
        for i, h in enumerate(hashes):
            src = srcs[i % _NSRC]
            if i % 2:
                t0 = clock()
                put(h, src)
                t1 = clock()
                step()
                t2 = clock()
                ours[i], theirs[i] = t1 - t0, t2 - t1
            else:
                t0 = clock()
                step()
                t1 = clock()
                put(h, src)
                t2 = clock()
                theirs[i], ours[i] = t1 - t0, t2 - t1
        if record:
            samples.append(sum(ours) / n)
            base_samples.append(sum(theirs) / n)

    try:
        for _ in range(max(opts.warmup, 1)):
            one_round(False)
        for _ in range(max(opts.reps, 1)):
            one_round(True)
        stored = engine.stats()["puts"]
    finally:
        engine.close()
    return [
        Result(
            SUITE,
            "put 1 MiB float32 (new hash)",
            statistics.median(samples) * 1e6,
            "µs",
            "copy_ 1 MiB (rotating)",
            statistics.median(base_samples) * 1e6,
            target=1.25,
            note=f"{stored} puts, timed op by op beside the baseline",
        )
    ]


def bench_get(opts: BenchOptions) -> list[Result]:
    """Each ``get`` is timed next to one kept ``clone()`` of a 1 MiB source (op by op, order
    alternating); both keep their results until the repetition ends, as a caller would."""
    keep = 32 if opts.quick else 64  # results kept by the caller per repetition
    engine = _engine(keep + 8)
    srcs = _sources()
    hashes = [f"bench-get-{i}" for i in range(keep)]
    for i, h in enumerate(hashes):
        if not engine.put(h, srcs[i % _NSRC]):
            raise RuntimeError("the benchmark pool could not take its entries")
    base = CloneBaseline(MiB, keep=keep)
    clone_srcs = base.src
    samples: list[float] = []
    base_samples: list[float] = []
    clock = time.perf_counter

    def one_round(record: bool) -> None:
        get = engine.get
        kept: list[torch.Tensor | None] = []
        clones: list[torch.Tensor] = []
        ours = theirs = 0.0
        for i, h in enumerate(hashes):
            src = clone_srcs[i % len(clone_srcs)]
            if i % 2:
                t0 = clock()
                kept.append(get(h))
                t1 = clock()
                clones.append(src.clone())
                t2 = clock()
                ours += t1 - t0
                theirs += t2 - t1
            else:
                t0 = clock()
                clones.append(src.clone())
                t1 = clock()
                kept.append(get(h))
                t2 = clock()
                theirs += t1 - t0
                ours += t2 - t1
        if any(t is None for t in kept):
            raise RuntimeError("a benchmark entry went missing")
        del kept, clones
        if record:
            samples.append(ours / keep)
            base_samples.append(theirs / keep)

    try:
        for _ in range(max(opts.warmup, 1)):
            one_round(False)
        for _ in range(max(opts.reps, 5)):
            one_round(True)
    finally:
        engine.close()
    return [
        Result(
            SUITE,
            f"get 1 MiB, {keep} results kept",
            statistics.median(samples) * 1e6,
            "µs",
            f"clone() 1 MiB, {keep} kept",
            statistics.median(base_samples) * 1e6,
            target=1.2,
            note="timed op by op beside the baseline",
        )
    ]


def bench_contains(opts: BenchOptions) -> list[Result]:
    engine = _engine(16)
    inner = 2000 if opts.quick else 20000
    try:
        engine.put("present", torch.randn(64))
        hit = median_time(lambda: engine.contains("present"), reps=max(opts.reps, 5), inner=inner)
        miss = median_time(lambda: engine.contains("absent"), reps=max(opts.reps, 5), inner=inner)
    finally:
        engine.close()
    return [
        Result(SUITE, "contains (hit)", hit * 1e6, "µs", target=3.0),
        Result(SUITE, "contains (miss)", miss * 1e6, "µs", target=3.0),
    ]


def run(opts: BenchOptions) -> list[Result]:
    """Every figure of this suite (CPU-only configuration)."""
    results: list[Result] = []
    for step in (bench_put, bench_get, bench_contains):
        opts.say(f"ec: {step.__name__}")
        results.extend(step(opts))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="fewer entries (smoke run)")
    parser.add_argument("--reps", type=int, default=7, help="repetitions per figure (>= 5)")
    args = parser.parse_args(argv)
    opts = BenchOptions(reps=max(args.reps, 5), quick=args.quick, progress=print)
    results = run(opts)
    print(format_table(results))
    return 0 if all(r.met is not False for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
