"""The comparison workloads, each written once against a duck-typed adapter, and their table.

Part of the comparison harness (see ``_harness.py``): standard library and torch only, imported
both as a module of ``lmcache_async_bench.compare`` and, in the LMCache virtual environment, by
plain name from this directory. Do not import ``lmcache_async`` here.
"""

from __future__ import annotations

import gc
import os
import resource
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch

if __package__:
    from ._harness_baseline import PhysicalAdapter
    from ._harness_data import (
        CHUNK,
        HS_HIDDEN,
        SM_BATCH,
        SPAN,
        KiB,
        MiB,
        Outcome,
        ec_tensor,
        entry_count,
        hs_tokens,
        kv_tensor,
        source_tensors,
        touched,
    )
else:  # loaded by path beside lmcache_side.py
    from _harness_baseline import PhysicalAdapter  # type: ignore[no-redef]
    from _harness_data import (  # type: ignore[no-redef]
        CHUNK,
        HS_HIDDEN,
        SM_BATCH,
        SPAN,
        KiB,
        MiB,
        Outcome,
        ec_tensor,
        entry_count,
        hs_tokens,
        kv_tensor,
        source_tensors,
        touched,
    )


# ---- helpers -----------------------------------------------------------------------------------
def evict_from_page_cache(paths: list[str]) -> int:
    """``fdatasync`` + ``POSIX_FADV_DONTNEED`` per file: the next read is a cold read."""
    n = 0
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            n += 1
        finally:
            os.close(fd)
    return n


def _reps(out: Outcome, reps: int, warmup: int, one: Callable[[], float]) -> None:
    for _ in range(warmup):
        one()
    out.hits = out.misses = out.faults = 0  # count the timed repetitions only
    for _ in range(reps):
        out.samples.append(one())


def _minor_faults() -> int:
    """Minor page faults of this process so far (fresh result memory shows up here)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _now() -> float:
    return time.perf_counter()


def _kept_round(out: Outcome, items: Sequence[Any], fetch: Callable[[Any], Any]) -> float:
    """One repetition of reads whose results the caller keeps until it ends: seconds per item;
    hits and misses are added to ``out``."""
    kept: list[Any] = []
    gc.collect()
    f0 = _minor_faults()
    t0 = _now()
    for item in items:
        kept.append(fetch(item))
    dt = _now() - t0
    out.faults += _minor_faults() - f0
    hits = sum(1 for x in kept if x is not None)
    out.hits += hits
    out.misses += len(items) - hits
    del kept
    return dt / len(items)


# ---- workloads ---------------------------------------------------------------------------------
def _disk_budget(n: int, size: int, reps: int, warmup: int) -> int:
    """Disk bytes for every repetition's entries: no run depends on disk eviction or removal
    (LMCache 0.5.6's ``remove`` does not give the bytes back to its disk budget)."""
    return (reps + warmup + 1) * n * (size + 64 * KiB) + 64 * MiB


def w_ec_put(a: Any, out: Outcome, size: int, reps: int, warmup: int, workdir: str, quick: bool) -> None:
    n = entry_count(size, quick)
    srcs = source_tensors(size, n, ec_tensor)
    out.ops_per_rep, out.bytes_per_op = n, size
    a.ec_open(workdir, int(n * size * 1.25) + 16 * MiB, _disk_budget(n, size, reps, warmup))
    gen = iter(range(1 << 40))
    try:

        def one() -> float:
            hashes = [f"img-{next(gen)}" for _ in range(n)]
            gc.collect()
            t0 = _now()
            for i, h in enumerate(hashes):
                if a.ec_put(h, srcs[i % len(srcs)]):
                    out.hits += 1
                else:
                    out.misses += 1
            dt = _now() - t0
            a.ec_drain(hashes)
            a.ec_remove(hashes)
            return dt / n

        _reps(out, reps, warmup, one)
    finally:
        a.ec_close()


def w_ec_get(a: Any, out: Outcome, size: int, reps: int, warmup: int, workdir: str, quick: bool) -> None:
    n = entry_count(size, quick)
    srcs = source_tensors(size, n, ec_tensor)
    out.ops_per_rep, out.bytes_per_op = n, size
    a.ec_open(workdir, int(n * size * 1.25) + 16 * MiB, _disk_budget(n, size, 0, 0))
    try:
        hashes = [f"img-{i}" for i in range(n)]
        for i, h in enumerate(hashes):
            if not a.ec_put(h, srcs[i % len(srcs)]):
                raise RuntimeError(f"setup put of {h} failed")
        a.ec_drain(hashes)
        check = a.ec_get(hashes[1])
        if check is None or not torch.equal(check, srcs[1 % len(srcs)]):
            raise RuntimeError("ec_get returned wrong bytes")
        del check

        _reps(out, reps, warmup, lambda: _kept_round(out, hashes, a.ec_get))
    finally:
        a.ec_close()


def _ec_contains(miss: bool) -> Callable[..., None]:
    def w(a: Any, out: Outcome, size: int, reps: int, warmup: int, workdir: str, quick: bool) -> None:
        n = 1024
        inner = 20 if not quick else 2
        src = ec_tensor(size, 7)
        out.ops_per_rep, out.bytes_per_op = n * inner, 0
        a.ec_open(workdir, n * (size + 4 * KiB) + 32 * MiB, _disk_budget(n, size, 0, 0))
        try:
            hashes = [f"img-{i}" for i in range(n)]
            for h in hashes:
                if not a.ec_put(h, src):
                    raise RuntimeError(f"setup put of {h} failed")
            a.ec_drain(hashes)
            probe = [f"absent-{i}" for i in range(n)] if miss else hashes

            def one() -> float:
                hits = 0
                t0 = _now()
                for _ in range(inner):
                    for h in probe:
                        if a.ec_contains(h):
                            hits += 1
                dt = _now() - t0
                out.hits += hits
                out.misses += n * inner - hits
                return dt / (n * inner)

            _reps(out, reps, warmup, one)
        finally:
            a.ec_close()

    return w


def _hs_setup(size: int, quick: bool) -> tuple[int, int, list[list[int]], list[torch.Tensor]]:
    tokens = max(CHUNK, (size // (4 * HS_HIDDEN)) // CHUNK * CHUNK)
    n = max(4, min(64, SPAN // (tokens * HS_HIDDEN * 4)))
    if quick:
        n = max(2, n // 4)
    seqs = [hs_tokens(tokens, s) for s in range(n)]
    g = torch.Generator().manual_seed(5)
    nsrc = max(2, min(n, (64 * MiB) // (tokens * HS_HIDDEN * 4)))
    srcs = [torch.randn(tokens, HS_HIDDEN, generator=g) for _ in range(nsrc)]
    return tokens, n, seqs, srcs


def w_hs_store(a: Any, out: Outcome, size: int, reps: int, warmup: int, workdir: str, quick: bool) -> None:
    tokens, n, _, srcs = _hs_setup(size, quick)
    nbytes = tokens * HS_HIDDEN * 4
    out.ops_per_rep, out.bytes_per_op = n, nbytes
    a.hs_open(int(n * nbytes * 1.25) + 16 * MiB, CHUNK)
    gen = iter(range(1 << 30))
    try:

        def one() -> float:
            seqs = [hs_tokens(tokens, 1000 + next(gen)) for _ in range(n)]
            gc.collect()
            t0 = _now()
            for i, seq in enumerate(seqs):
                stored = a.hs_store(seq, srcs[i % len(srcs)])
                if stored == tokens // CHUNK:
                    out.hits += 1
                else:
                    out.misses += 1
            dt = _now() - t0
            a.hs_clear()
            return dt / n

        _reps(out, reps, warmup, one)
    finally:
        a.hs_close()


def _hs_retrieve(with_out: bool) -> Callable[..., None]:
    def w(a: Any, out: Outcome, size: int, reps: int, warmup: int, workdir: str, quick: bool) -> None:
        tokens, n, seqs, srcs = _hs_setup(size, quick)
        nbytes = tokens * HS_HIDDEN * 4
        out.ops_per_rep, out.bytes_per_op = n, nbytes
        use_out = with_out and a.supports_hs_out
        if with_out and not use_out:
            out.note = "no out= in this system: its plain retrieve (fresh result) is timed"
        outs = [touched(nbytes).view(torch.float32).view(tokens, HS_HIDDEN) for _ in range(n if use_out else 0)]
        a.hs_open(int(n * nbytes * 1.25) + 16 * MiB, CHUNK)
        try:
            for i, seq in enumerate(seqs):
                if a.hs_store(seq, srcs[i % len(srcs)]) != tokens // CHUNK:
                    raise RuntimeError("hs setup store failed")
            check = a.hs_retrieve(seqs[1], outs[1] if use_out else None)
            if check is None or not torch.equal(check, srcs[1 % len(srcs)]):
                raise RuntimeError("hs_retrieve returned wrong values")
            del check

            args = [(seq, outs[i] if use_out else None) for i, seq in enumerate(seqs)]
            _reps(out, reps, warmup, lambda: _kept_round(out, args, lambda arg: a.hs_retrieve(*arg)))
        finally:
            a.hs_close()

    return w


def w_cpu_batched_put(a: Any, out: Outcome, size: int, reps: int, warmup: int, workdir: str, quick: bool) -> None:
    n = max(2, entry_count(size * SM_BATCH, quick, lo=2, hi=64))
    srcs = source_tensors(size, n * SM_BATCH, kv_tensor)
    out.ops_per_rep, out.bytes_per_op = n, size * SM_BATCH
    a.sm_open(None, int(n * SM_BATCH * size * 1.25) + 16 * MiB, 0)
    gen = iter(range(1 << 40))
    try:

        def one() -> float:
            batches = [[a.sm_key(next(gen)) for _ in range(SM_BATCH)] for _ in range(n)]
            ts = [srcs[i % len(srcs)] for i in range(SM_BATCH)]
            gc.collect()
            t0 = _now()
            for keys in batches:
                a.sm_batched_put(keys, ts)
            dt = _now() - t0
            flat = [k for b in batches for k in b]
            out.hits += a.sm_batched_get_release(flat)
            a.sm_clear(flat)
            return dt / n

        _reps(out, reps, warmup, one)
    finally:
        a.sm_close()


def w_cpu_batched_get(a: Any, out: Outcome, size: int, reps: int, warmup: int, workdir: str, quick: bool) -> None:
    n = max(2, entry_count(size * SM_BATCH, quick, lo=2, hi=64))
    srcs = source_tensors(size, n * SM_BATCH, kv_tensor)
    out.ops_per_rep, out.bytes_per_op = n, size * SM_BATCH
    a.sm_open(None, int(n * SM_BATCH * size * 1.25) + 16 * MiB, 0)
    try:
        batches = [[a.sm_key(b * SM_BATCH + j) for j in range(SM_BATCH)] for b in range(n)]
        for keys in batches:
            a.sm_batched_put(keys, [srcs[i % len(srcs)] for i in range(SM_BATCH)])
        inner = 10 if not quick else 2

        def one() -> float:
            hits = 0
            t0 = _now()
            for _ in range(inner):
                for keys in batches:
                    hits += a.sm_batched_get_release(keys)
            dt = _now() - t0
            out.hits += hits
            out.misses += n * inner * SM_BATCH - hits
            return dt / (n * inner)

        _reps(out, reps, warmup, one)
    finally:
        a.sm_close()


def w_disk_write_through(a: Any, out: Outcome, size: int, reps: int, warmup: int, workdir: str, quick: bool) -> None:
    n = entry_count(size, quick, lo=8, hi=256)
    srcs = source_tensors(size, n, kv_tensor)
    out.ops_per_rep, out.bytes_per_op = n, size
    a.sm_open(workdir, int(n * size * 1.25) + 16 * MiB, _disk_budget(n, size, reps, warmup))
    gen = iter(range(1 << 40))
    try:

        def one() -> float:
            keys = [a.sm_key(next(gen)) for _ in range(n)]
            gc.collect()
            t0 = _now()
            for i, k in enumerate(keys):
                a.sm_batched_put([k], [srcs[i % len(srcs)]])
            a.sm_drain(keys)
            dt = _now() - t0
            on_disk = len(a.sm_disk_files())  # >= n: earlier repetitions may still be there
            out.hits += min(n, on_disk)
            out.misses += max(0, n - on_disk)
            a.sm_clear(keys)
            return dt / n

        _reps(out, reps, warmup, one)
        out.note = "put of each entry + the barrier until every file is written; no fsync"
    finally:
        a.sm_close()


def w_disk_cold_read(a: Any, out: Outcome, size: int, reps: int, warmup: int, workdir: str, quick: bool) -> None:
    n = entry_count(size, quick, lo=8, hi=256)
    srcs = source_tensors(size, n, kv_tensor)
    out.ops_per_rep, out.bytes_per_op = n, size
    a.sm_open(workdir, int(n * size * 1.25) + 16 * MiB, _disk_budget(n, size, 0, 0))
    try:
        keys = [a.sm_key(i) for i in range(n)]
        for i, k in enumerate(keys):
            a.sm_batched_put([k], [srcs[i % len(srcs)]])
        a.sm_drain(keys)

        def one() -> float:
            a.sm_evict_cpu()
            files = a.sm_disk_files()
            dropped = evict_from_page_cache(files)
            if dropped < n:
                raise RuntimeError(f"only {dropped} of {n} entries are on disk")
            gc.collect()
            hits = 0
            t0 = _now()
            for k in keys:
                if a.sm_get_release(k):
                    hits += 1
            dt = _now() - t0
            out.hits += hits
            out.misses += n - hits
            return dt / n

        _reps(out, reps, warmup, one)
        out.note = "per-key blocking get after the CPU copies were dropped and the files left the page cache"
    finally:
        a.sm_close()


def w_ec_get_after_eviction(a: Any, out: Outcome, size: int, reps: int, warmup: int, workdir: str, quick: bool) -> None:
    cpu_entries = 16
    total = 48 if not quick else 32
    probe = 8
    srcs = source_tensors(size, total, ec_tensor)
    out.ops_per_rep, out.bytes_per_op = probe, size
    if isinstance(a, PhysicalAdapter):
        out.ok = False
        out.error = "no physical baseline for a tier-fallback hit/miss figure"
        return
    a.ec_open(workdir, cpu_entries * (size + 64 * KiB), _disk_budget(total, size, reps, warmup))
    gen = iter(range(1 << 40))
    correct = 0
    said_present = 0
    try:

        def one() -> float:
            nonlocal correct
            hashes = [f"img-{next(gen)}" for _ in range(total)]
            for g in range(0, total, 8):  # puts in groups, each group written through before the next
                group = hashes[g : g + 8]
                for i, h in enumerate(group, start=g):
                    a.ec_put(h, srcs[i % len(srcs)])
                a.ec_drain(group)
            nonlocal said_present
            said_present += sum(1 for h in hashes[:probe] if a.ec_contains(h))
            gc.collect()
            got: list[Any] = []
            t0 = _now()
            for h in hashes[:probe]:
                got.append(a.ec_get(h))
            dt = _now() - t0
            for i, x in enumerate(got):
                if x is None:
                    out.misses += 1
                else:
                    out.hits += 1
                    correct += int(torch.equal(x, srcs[i % len(srcs)]))
            del got
            a.ec_remove(hashes)
            return dt / probe

        _reps(out, reps, warmup, one)
        probes = probe * (reps + warmup)
        out.note = (
            f"{out.hits} hits, {out.misses} misses (timed reps); contains was True for "
            f"{said_present}/{probes} probes, {correct} hits verified equal (all reps)"
        )
    finally:
        a.ec_close()


NO_BASELINE = frozenset({"ec_get_after_eviction"})
"""Workloads reported as hits/misses: no physical baseline, no speed ratio."""

WORKLOADS: dict[str, tuple[Callable[..., None], tuple[int, ...], str]] = {
    "ec_put": (w_ec_put, (256 * KiB, MiB, 4 * MiB), "EC put of a new entry (one copy in; CPU + disk)"),
    "ec_get": (w_ec_get, (256 * KiB, MiB, 4 * MiB), "EC get of a CPU hit, result kept"),
    "ec_contains": (_ec_contains(False), (16 * KiB,), "EC contains, hit (1024 entries)"),
    "ec_contains_miss": (_ec_contains(True), (16 * KiB,), "EC contains, miss (CPU + disk asked)"),
    "hs_store": (w_hs_store, (16 * MiB,), "HS store of a prompt's hidden states (float32 x 4096)"),
    "hs_retrieve": (_hs_retrieve(False), (16 * MiB,), "HS retrieve, fresh result kept"),
    "hs_retrieve_out": (_hs_retrieve(True), (16 * MiB,), "HS retrieve into out= (LMCache: plain retrieve)"),
    "cpu_batched_put": (w_cpu_batched_put, (256 * KiB, MiB), f"batched_put of {SM_BATCH} chunks"),
    "cpu_batched_get": (w_cpu_batched_get, (256 * KiB, MiB), f"batched_get of {SM_BATCH} chunks + release"),
    "disk_write_through": (w_disk_write_through, (MiB, 4 * MiB), "put + write-through to disk, until on disk"),
    "disk_cold_read": (w_disk_cold_read, (MiB, 4 * MiB), "get of a disk-only entry, page cache dropped"),
    "ec_get_after_eviction": (w_ec_get_after_eviction, (MiB,), "EC get after the entry left the CPU tier"),
}


def run_workload(
    adapter: Any, name: str, size: int, reps: int = 5, warmup: int = 1, workdir: str = "/tmp", quick: bool = False
) -> Outcome:
    """Run workload ``name`` at ``size`` bytes on ``adapter``; never raises (errors land in the
    outcome)."""
    out = Outcome(system=getattr(adapter, "system", "?"), workload=name, size=size)
    spec = WORKLOADS.get(name)
    if spec is None:
        out.ok, out.error = False, f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}"
        return out
    os.makedirs(workdir, exist_ok=True)
    try:
        spec[0](adapter, out, size, reps, warmup, workdir, quick)
    except Exception as exc:
        out.ok = False
        out.error = f"{type(exc).__name__}: {exc}"
        out.note = (out.note + " " + traceback.format_exc(limit=-4)[-900:]).strip()
    gc.collect()
    return out
