"""SGLang HiCache backend: ``batch_set_v1``/``batch_get_v1`` of 64 pages beside their floors.

Runs in the SGLang environment (``bash scripts/sglang_env.sh`` prints its python), opt-in::

    lmcache-async bench --suite sglang          # with that environment's lmcache-async
    $(bash scripts/sglang_env.sh | tail -1) -m lmcache_async_bench.sglang [--quick]
    ... -m lmcache_async_bench.sglang --tier cpu --layout layer_first   # a part of it

The host pool is SGLang's own ``MHATokenToKVPoolHost`` built on CPU
(:func:`lmcache_async.integration.sglang.cpu_pool.build_cpu_host_pool`), filled with random bits,
for the layouts ``page_first`` and ``layer_first``. Every timed call moves 64 pages; each figure
is the median of ``reps`` (>= 5; >= ``CPU_REPS`` on the CPU tier) warmed repetitions, figure
and floor alternated (A B B A ...) so drift hits both.

* **CPU tier** — ours: ``batch_set_v1`` of 64 new page hashes (a gather from the host pool into
  our CPU pool, keys, the index), ``batch_get_v1`` of 64 stored pages (a scatter back into the
  host pool). Floor: a bare ``torch.index_select(paged, page_axis, ids, out=...)`` of the same
  pages into pre-touched buffers rotating over >= 128 MiB, and ``index_copy_`` of rotating
  sources back into the same pages. Target: ours >= 0.8 x the floor's throughput.
  Both sides cycle through the same memory: our CPU pool holds exactly as many batches as the
  floor rotates buffers (``_Setup.cycle``), so each set writes into the blocks of the batch it
  evicts, and the gets rotate over that many stored batches. (A server's last-level cache can
  hold several batches — 480 MiB on a 2-core cloud VM — so a side that cycles through less
  memory reads and writes partly in cache and measures faster for that reason alone.)
* **disk tier** — ours without a CPU tier (``local_cpu: false``, ``local_disk``): set is
  ``batch_set_v1`` + ``flush`` (the records are on disk, header + xxh3 checksum); get is
  ``batch_get_v1`` reading every record from its file, checking header, key and checksum on every
  read. Floor: SGLang's built-in ``file`` backend (``HiCacheFile``) on the same pages, driven the
  way SGLang's cache controller drives it (``batch_set`` of ``get_data_page`` tensors: raw
  ``tofile`` + rename; ``batch_get`` into dummy flat pages with ``readinto`` then
  ``set_from_flat_data_page``) — no header, no checksum. Target: ours >= 0.9 x its throughput.
  Both write into the page cache without fsync and read hot pages.

On a host with more runnable threads than cores (a shared 2-core VM), every small parallel region
of torch's intra-op pool waits for a time slice; run with ``OMP_NUM_THREADS=1`` there so the
figure and its floor both measure copies, not scheduling.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import tempfile
import uuid
import warnings
from collections.abc import Callable
from typing import Any

import torch

from .common import BenchOptions, MiB, Result, alternate, format_table

__all__ = ["CPU_REPS", "FACTORY_KEYS", "LAYOUTS", "PAGES", "SUITE", "TIERS", "main", "run"]

SUITE = "sglang"
PAGES = 64
CPU_REPS = 15
"""Repetitions of a CPU-tier figure at least (each call takes tens of milliseconds; more
samples keep its median steady on a loaded host)."""
FACTORY_KEYS = {
    "backend_name": "lmcache_async",
    "module_path": "lmcache_async.integration.sglang",
    "class_name": "LMCacheHiCacheStorage",
    "interface_v1": 1,
}


def _storage_config(extra: dict[str, Any]) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=False, model_name="bench/model", extra_config=extra,
    )  # fmt: skip


def _timed(fn: Callable[[], Any]) -> Callable[[], float]:
    import time

    def run() -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return run


class _Setup:
    """One host pool, its page ids for the 64-page batch and fresh page hashes on demand."""

    def __init__(self, layout: str, layers: int) -> None:
        from lmcache_async.integration.sglang.cpu_pool import build_cpu_host_pool
        from lmcache_async.integration.sglang.pool_layout import HostPoolPages

        self.pool = build_cpu_host_pool(
            layout, layer_num=layers, head_num=8, head_dim=128, page_size=64, page_num=2 * PAGES + 8
        )
        buf = self.pool.kv_buffer
        buf.view(torch.int16).copy_(torch.randint(-(1 << 15), 1 << 15, buf.shape, dtype=torch.int16))
        self.pages = HostPoolPages(self.pool)
        p = self.pool.page_size
        self.src_ids = list(range(1, 2 * PAGES, 2))  # not one contiguous run: every page moves alone
        self.dst_ids = list(range(2, 2 * PAGES + 1, 2))
        self.src_idx = torch.cat([torch.arange(q * p, (q + 1) * p) for q in self.src_ids])
        self.dst_idx = torch.cat([torch.arange(q * p, (q + 1) * p) for q in self.dst_ids])
        self.batch_bytes = self.pages.record_bytes * PAGES
        self.cycle = max(2, -(-128 * MiB // self.batch_bytes))
        """Batches each side of a CPU-tier figure cycles through: the floor's rotating buffers,
        our CPU pool's capacity (in batches) and the stored batches the gets rotate over."""
        self._n = itertools.count()

    def fresh_keys(self) -> list[str]:
        tag = next(self._n)
        return [f"{tag:016x}{uuid.uuid4().hex}{i:016x}" for i in range(PAGES)]


def _floor_cpu(s: _Setup) -> tuple[Callable[[], float], Callable[[], float]]:
    """Bare index_select / index_copy_ of the same pages, rotating over >= 128 MiB."""
    paged, axis = s.pages.paged, s.pages.page_axis
    n_bufs = s.cycle
    shape = list(paged.shape)
    shape[axis] = PAGES
    bufs = [torch.empty(shape, dtype=paged.dtype) for _ in range(n_bufs)]
    for b in bufs:
        b.view(torch.int16).fill_(1)  # pre-touched
    src = torch.tensor(s.src_ids)
    dst = torch.tensor(s.dst_ids)
    turn = itertools.count()

    def gather() -> None:
        torch.index_select(paged, axis, src, out=bufs[next(turn) % n_bufs])

    def scatter() -> None:
        paged.index_copy_(axis, dst, bufs[next(turn) % n_bufs])

    return _timed(gather), _timed(scatter)


def _cpu_tier(opts: BenchOptions, layout: str, layers: int) -> list[Result]:
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    s = _Setup(layout, layers)
    # Room for exactly ``cycle`` batches (the slack is less than one page): in steady state each
    # set evicts the oldest batch and writes into its blocks, all touched by the warm-up rounds
    # (first touch of fresh memory is ~300 us/MiB here and would otherwise be what is measured),
    # cycling through the same bytes as the floor's rotating buffers.
    gib = (s.cycle * s.batch_bytes + s.pages.record_bytes // 2) / (1 << 30)
    extra = {**FACTORY_KEYS, "max_local_cpu_size": gib, "staging_size": 1 / 64}
    backend = StorageBackendFactory.create_backend("dynamic", _storage_config(extra), s.pool)
    backend.register_mem_pool_host(s.pool)
    try:
        stored: list[list[str]] = []
        turn = itertools.count()

        def ours_set() -> None:
            keys = s.fresh_keys()
            if not all(backend.batch_set_v1(keys, s.src_idx)):
                raise RuntimeError("batch_set_v1 refused pages (CPU pool too small?)")
            stored.append(keys)

        def ours_get() -> None:  # the last ``cycle`` batches, all still in the pool
            if not all(backend.batch_get_v1(stored[-1 - next(turn) % s.cycle], s.dst_idx)):
                raise RuntimeError("batch_get_v1 missed pages it just stored")

        floor_set, floor_get = _floor_cpu(s)
        for _ in range(s.cycle + 2):  # touch every block of the CPU pool once
            ours_set()
        reps, warm = max(opts.reps, CPU_REPS), max(1, opts.warmup)
        t_set, t_floor_set = alternate([_timed(ours_set), floor_set], reps=reps, warmup=warm)
        t_get, t_floor_get = alternate([_timed(ours_get), floor_get], reps=reps, warmup=warm)
    finally:
        backend.close()
    params = {"size": s.pages.record_bytes, "entries": PAGES, "layout": layout, "panel": "sglang cpu tier"}
    return [
        Result(SUITE, f"cpu batch_set_v1 64 pages ({layout})", t_set, "s", "index_select of the same pages",
               t_floor_set, target=1 / 0.8, params={**params, "series": f"set {layout}"}),
        Result(SUITE, f"cpu batch_get_v1 64 pages ({layout})", t_get, "s", "index_copy_ of the same pages",
               t_floor_get, target=1 / 0.8, params={**params, "series": f"get {layout}"}),
    ]  # fmt: skip


def _disk_tier(opts: BenchOptions, layout: str, layers: int) -> list[Result]:
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    s = _Setup(layout, layers)
    work = tempfile.mkdtemp(prefix="lmcache-async-sglang-bench-", dir=opts.workdir)
    try:
        ours_dir, file_dir = os.path.join(work, "ours"), os.path.join(work, "file")
        os.makedirs(file_dir)
        disk_gib = max(1.0, 2 * (opts.reps + 4) * s.batch_bytes / (1 << 30))
        extra = {
            **FACTORY_KEYS,
            "local_cpu": False,
            "local_disk": ours_dir,
            "max_local_disk_size": disk_gib,
            "staging_size": max(0.25, 2 * s.batch_bytes / (1 << 30)),
            "blocking_timeout_secs": 60,
        }
        ours = StorageBackendFactory.create_backend("dynamic", _storage_config(extra), s.pool)
        ours.register_mem_pool_host(s.pool)
        theirs = HiCacheFile(_storage_config({"file_storage_path": file_dir}), file_path=file_dir)
        pool, p = s.pool, s.pool.page_size
        ours_keys: list[list[str]] = []
        file_keys: list[list[str]] = []
        try:

            def ours_set() -> None:
                keys = s.fresh_keys()
                if not all(ours.batch_set_v1(keys, s.src_idx)) or not ours.flush():
                    raise RuntimeError("disk tier refused pages")
                ours_keys.append(keys)

            def ours_get() -> None:
                if not all(ours.batch_get_v1(ours_keys[-1], s.dst_idx)):
                    raise RuntimeError("disk tier missed pages it just stored")

            def file_set() -> None:  # SGLang's _generic_page_set
                keys = s.fresh_keys()
                if not theirs.batch_set(keys, [pool.get_data_page(q * p) for q in s.src_ids]):
                    raise RuntimeError("HiCacheFile refused pages")
                file_keys.append(keys)

            def file_get() -> None:  # SGLang's _generic_page_get
                keys = file_keys[-1]
                got = theirs.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
                for q, page in zip(s.dst_ids, got, strict=True):
                    if page is None:
                        raise RuntimeError("HiCacheFile missed pages it just stored")
                    pool.set_from_flat_data_page(q * p, page)

            warm = max(1, opts.warmup)
            t_set, t_file_set = alternate([_timed(ours_set), _timed(file_set)], reps=opts.reps, warmup=warm)
            t_get, t_file_get = alternate([_timed(ours_get), _timed(file_get)], reps=opts.reps, warmup=warm)
            disk_stats = ours.stats()["manager"]["tiers"]["disk"]
        finally:
            ours.close()
            close = getattr(theirs, "close", None)
            if close is not None:
                close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    note = f"disk tier read_hits={disk_stats.get('hits')} corrupt={disk_stats.get('corrupt')}"
    params = {"size": s.pages.record_bytes, "entries": PAGES, "layout": layout, "panel": "sglang disk tier"}
    return [
        Result(SUITE, f"disk batch_set_v1+flush 64 pages ({layout})", t_set, "s", "HiCacheFile batch_set",
               t_file_set, target=1 / 0.9, note=note, params={**params, "series": f"set {layout}"}),
        Result(SUITE, f"disk batch_get_v1 64 pages ({layout})", t_get, "s", "HiCacheFile batch_get + set page",
               t_file_get, target=1 / 0.9, note=note, params={**params, "series": f"get {layout}"}),
    ]  # fmt: skip


LAYOUTS = ("page_first", "layer_first")
TIERS = ("cpu", "disk")


def run(opts: BenchOptions, layouts: tuple[str, ...] = LAYOUTS, tiers: tuple[str, ...] = TIERS) -> list[Result]:
    """The suite (see the module docstring); ``ImportError`` when SGLang is not installed.
    ``layouts``/``tiers``: a part of it (``python -m lmcache_async_bench.sglang --tier cpu``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SGLang warns about GPU-only features on a CPU host
        import sglang.srt.mem_cache.pool_host.mha
        import sglang.srt.mem_cache.storage.backend_factory  # noqa: F401
    layers = 2 if opts.quick else 8  # pages of 512 KiB (quick) or 2 MiB (8 heads x 128, 64 tokens, bf16)
    results: list[Result] = []
    for layout in layouts:
        if "cpu" in tiers:
            opts.say(f"sglang: cpu tier, {layout}")
            results += _cpu_tier(opts, layout, layers)
        if "disk" in tiers:
            opts.say(f"sglang: disk tier, {layout}")
            results += _disk_tier(opts, layout, layers)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller pages")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--layout", choices=LAYOUTS, action="append", help="only this layout (repeatable)")
    parser.add_argument("--tier", choices=TIERS, action="append", help="only this tier (repeatable)")
    args = parser.parse_args()
    opts = BenchOptions(reps=max(5, args.reps), quick=args.quick, workdir=args.workdir, progress=print)
    results = run(opts, tuple(args.layout or LAYOUTS), tuple(args.tier or TIERS))
    print(format_table(results))


if __name__ == "__main__":
    main()
