"""Benchmark suite of the KV engine and the hidden-state store (SPEC §6 baselines, same run).

Figures and their baselines:

* **hs store** of one prompt (32,768 tokens x 4,096 hidden, float32, one layer: 512 MiB) vs the
  copy baseline for the same bytes (``copy_`` of one chunk from rotating sources into pre-touched
  destinations rotating over >= 128 MiB, times the number of chunks). Target <= 1.3.
* **hs retrieve** (fresh result, kept) vs ``torch.cat`` of the same pool chunk tensors (results
  kept as many as the retrieve keeps). Target <= 1.3.
* **hs retrieve out=** (a pre-touched staging buffer) vs the copy baseline. Target <= 1.3.
* **kv lookup** of 131,072 tokens, every chunk present, vs hashing those tokens alone (int64
  bytes + the chained SHA-256). Target <= 1.5. The token database's own ``chunk_hashes`` is
  shown beside it for information.
* **kv store / retrieve** (bfloat16, 8 layers) vs the copy / ``torch.cat`` baselines, for
  information.
* **coroutines** (:mod:`.kv_hs_async`): ``await kv.astore`` / ``await hs.aretrieve_hidden_states``
  answered from the CPU tier vs the sync calls, below and above the off-loop copy threshold,
  and the threshold's measurement. Target <= 1.2.

Run ``python -m lmcache_async_bench.kv_hs [--quick] [--reps N] [--json]``. Measured and baseline
calls alternate; on a shared, loaded host raise ``--reps`` for stable medians.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lmcache_async.config import LMCacheEngineConfig
from lmcache_async.engines._chunks import key_cache
from lmcache_async.engines.hidden_states import hs_entry_key
from lmcache_async.engines.kv import LMCacheEngine
from lmcache_async.memory import GiB
from lmcache_async.metadata import LMCacheEngineMetadata
from lmcache_async.token_database import chain_hashes, tokens_to_int64_bytes

from .common import (
    BenchOptions,
    CopyBaseline,
    MiB,
    Result,
    alternate,
    format_table,
)

__all__ = ["CHUNK", "SUITE", "main", "run"]

SUITE = "kv_hs"
CHUNK = 256


@dataclass(frozen=True)
class _Sizes:
    hs_tokens: int
    hs_hidden: int
    lookup_tokens: int
    kv_tokens: int
    kv_layers: int
    kv_hidden: int


_FULL = _Sizes(32_768, 4_096, lookup_tokens=131_072, kv_tokens=8_192, kv_layers=8, kv_hidden=1_024)
_QUICK = _Sizes(4_096, 1_024, lookup_tokens=16_384, kv_tokens=2_048, kv_layers=4, kv_hidden=512)


def _prompt(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 150_000, (n,), generator=g)


class _Timed:
    """``fn(i)`` for i = 0, 1, ... as an :func:`alternate` callable returning seconds. The previous
    result stays referenced while the next call runs ("results kept": no call reuses the memory
    of the result before it); :meth:`drop` releases it."""

    def __init__(self, fn: Callable[[int], Any]) -> None:
        self.fn = fn
        self.i = 0
        self.last: Any = None

    def __call__(self) -> float:
        i = self.i
        self.i = i + 1
        t0 = time.perf_counter()
        r = self.fn(i)
        dt = time.perf_counter() - t0
        self.last = r
        return dt

    def drop(self) -> None:
        self.last = None


def _paired(
    measured: Callable[[int], Any], baseline: Callable[[int], Any], reps: int, warmup: int
) -> tuple[float, float]:
    """Median seconds of ``measured`` and ``baseline``, interleaved (:func:`alternate`)."""
    a, b = _Timed(measured), _Timed(baseline)
    try:
        ta, tb = alternate([a, b], reps=reps, warmup=warmup)
    finally:
        a.drop()
        b.drop()
        gc.collect()
    return ta, tb


def _engine(kv_gib: float, hs_gib: float) -> LMCacheEngine:
    cfg = LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK,
        max_local_cpu_size=kv_gib,
        staging_size=0,
        enable_hidden_state_cache=hs_gib > 0,
        max_hidden_state_cpu_size=hs_gib if hs_gib > 0 else 2.0,
    )
    eng = LMCacheEngine(cfg, LMCacheEngineMetadata("bench/model"))
    for sm in (eng.storage_manager, eng.hidden_state_store.storage_manager if eng.hidden_state_store else None):
        if sm is not None and sm.pool is not None:
            sm.pool.wait_ready(120)
    return eng


def _ms(name: str, value_s: float, base_name: str, base_s: float, target: float | None = None) -> Result:
    return Result(
        SUITE,
        name,
        value_s * 1e3,
        "ms",
        base_name,
        base_s * 1e3,
        target=target,
        note="" if target is not None else "information",
    )


def _copy_set(chunk_bytes: int, n_chunks: int) -> Callable[[int], None]:
    """The copy baseline for ``n_chunks`` chunks: one ``CopyBaseline`` step per chunk."""
    base = CopyBaseline(chunk_bytes, span=256 * MiB)
    step = base.step

    def run(_i: int) -> None:
        for _ in range(n_chunks):
            step()

    return run


def _hs(opts: BenchOptions, s: _Sizes) -> list[Result]:
    reps, warmup = max(opts.reps, 5), max(opts.warmup, 1)
    T, D = s.hs_tokens, s.hs_hidden
    nbytes = T * D * 4
    n_chunks = T // CHUNK
    label = f"{T}x{D} f32, 1 layer"
    eng = _engine(kv_gib=max(64 * MiB, 64 * T) / GiB, hs_gib=(2.25 * nbytes) / GiB)
    hs = eng.hidden_state_store
    assert hs is not None
    out: list[Result] = []
    try:
        copy_set = _copy_set(nbytes // n_chunks, n_chunks)
        hidden = torch.randn(T, D)
        prompts = [_prompt(T, 1000 + i) for i in range(warmup + reps)]
        tiny_kv = torch.zeros(2, 1, T, 8, dtype=torch.bfloat16)
        for p in prompts:
            eng.store(p, tiny_kv)  # the KV the hidden states belong to

        opts.say("hs: store vs copy baseline")
        counts: list[int] = []

        def store(i: int) -> None:
            counts.append(hs.store_hidden_states(prompts[i], hidden))

        store_s, copy_s = _paired(store, copy_set, reps, warmup)
        assert counts and all(c == n_chunks for c in counts), f"stored {counts} of {n_chunks} chunks"
        out.append(_ms(f"hs store {label}", store_s, "copy_ same bytes", copy_s, target=1.3))

        last = prompts[-1]
        objs = [hs.storage_manager.get_sync(hs_entry_key(k, 0)) for k in eng.token_database.keys(last)]
        try:
            chunks = [o.tensor for o in objs if o is not None]
            assert len(chunks) == n_chunks
            opts.say("hs: retrieve vs torch.cat")
            ret_s, cat_s = _paired(
                lambda i: hs.retrieve_hidden_states(last), lambda i: torch.cat(chunks, dim=0), reps, warmup
            )
        finally:
            for o in objs:
                if o is not None:
                    o.ref_count_down()
        out.append(_ms(f"hs retrieve {label}", ret_s, "torch.cat same chunks", cat_s, target=1.3))

        opts.say("hs: retrieve out= vs copy baseline")
        buf = torch.zeros(T, D)
        out_s, copy2_s = _paired(lambda i: hs.retrieve_hidden_states(last, out=buf), copy_set, reps, warmup)
        assert torch.equal(buf, hidden)
        out.append(_ms(f"hs retrieve out= {label}", out_s, "copy_ same bytes", copy2_s, target=1.3))
    finally:
        eng.close()
        gc.collect()
    return out


def _lookup(opts: BenchOptions, s: _Sizes) -> list[Result]:
    reps, warmup = max(opts.reps, 5), max(opts.warmup, 1)
    T = s.lookup_tokens
    eng = _engine(kv_gib=64 * MiB / GiB, hs_gib=0)
    try:
        toks = _prompt(T, 7)
        eng.store(toks, torch.zeros(2, 1, T, 8, dtype=torch.bfloat16))
        assert eng.lookup(toks) == T
        inner = 5

        def many(fn: Callable[[], Any]) -> Callable[[int], None]:
            def run(_i: int) -> None:
                for _ in range(inner):
                    fn()

            return run

        def cold_lookup() -> int:
            key_cache(eng.token_database).clear()
            return eng.lookup(toks)

        hashing = many(lambda: chain_hashes(tokens_to_int64_bytes(toks), CHUNK, False))
        opts.say("kv lookup vs hashing alone")
        look_s, hash_s = _paired(many(lambda: eng.lookup(toks)), hashing, reps, warmup)
        cold_s, hash2_s = _paired(many(cold_lookup), hashing, reps, warmup)
        db_s, hash3_s = _paired(many(lambda: eng.token_database.chunk_hashes(toks)), hashing, reps, warmup)
        base = "hash tokens alone"
        return [
            _ms(f"kv lookup {T} tokens (all present)", look_s / inner, base, hash_s / inner, target=1.5),
            _ms(f"kv lookup {T} tokens, keys not cached", cold_s / inner, base, hash2_s / inner),
            _ms(f"token_database.chunk_hashes {T} tokens", db_s / inner, base, hash3_s / inner),
        ]
    finally:
        eng.close()


def _kv(opts: BenchOptions, s: _Sizes) -> list[Result]:
    reps, warmup = max(opts.reps, 5), max(opts.warmup, 1)
    T, L, D = s.kv_tokens, s.kv_layers, s.kv_hidden
    nbytes = 2 * L * T * D * 2
    n_chunks = T // CHUNK
    label = f"{T} tokens x [2,{L},*,{D}] bf16"
    eng = _engine(kv_gib=2.25 * nbytes / GiB, hs_gib=0)
    try:
        copy_set = _copy_set(nbytes // n_chunks, n_chunks)
        kv = torch.randn(2, L, T, D).to(torch.bfloat16)
        prompts = [_prompt(T, 5000 + i) for i in range(warmup + reps)]
        opts.say("kv store vs copy baseline")
        store_s, copy_s = _paired(lambda i: eng.store(prompts[i], kv), copy_set, reps, warmup)
        last = prompts[-1]
        objs = eng.storage_manager.batched_get_sync(eng.token_database.keys(last))
        try:
            chunks = [o.tensor for o in objs if o is not None]
            assert len(chunks) == n_chunks
            opts.say("kv retrieve vs torch.cat")
            ret_s, cat_s = _paired(lambda i: eng.retrieve(last), lambda i: torch.cat(chunks, dim=2), reps, warmup)
        finally:
            for o in objs:
                if o is not None:
                    o.ref_count_down()
        n, got = eng.retrieve(last)
        assert n == T and got is not None and torch.equal(got, kv)
        return [
            _ms(f"kv store {label}", store_s, "copy_ same bytes", copy_s),
            _ms(f"kv retrieve {label}", ret_s, "torch.cat same chunks", cat_s),
        ]
    finally:
        eng.close()
        gc.collect()


def run(opts: BenchOptions) -> list[Result]:
    """Every figure of this suite, each beside its baseline measured in the same run."""
    sizes = _QUICK if opts.quick else _FULL
    results: list[Result] = []
    results += _hs(opts, sizes)
    results += _lookup(opts, sizes)
    results += _kv(opts, sizes)
    from . import kv_hs_async

    results += kv_hs_async.run(opts, opts.quick)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lmcache_async_bench.kv_hs", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    ap.add_argument("--reps", type=int, default=9, help="repetitions per figure (median; >= 5)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ap.add_argument("-v", "--verbose", action="store_true", help="print progress")
    args = ap.parse_args(argv)
    opts = BenchOptions(reps=args.reps, quick=args.quick, progress=print if args.verbose else None)
    results = run(opts)
    if args.json:
        print(json.dumps([r.to_dict() for r in results], indent=2))
    else:
        print(format_table(results))
    return 0 if all(r.met is not False for r in results) else 1


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
