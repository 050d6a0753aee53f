"""The side-by-side workloads, written once and run against any system through an adapter.

This file needs only the standard library and torch: the LMCache side of the comparison runs
it in a separate virtual environment where ``lmcache_async`` is not installed (it is loaded
there by path, next to ``lmcache_side.py``). Do not import ``lmcache_async`` here.

A *system* is an adapter object with the methods below (duck-typed); three exist:

* ``ours`` (``ours_side.py``) — this project's engines and StorageManager;
* ``lmcache`` (``lmcache_side.py``) — LMCache 0.5.6 on CPU with plain host memory;
* ``baseline`` (:class:`PhysicalAdapter`, here) — the physical floor of each workload, per
  SPEC §6: ``copy_`` into pre-touched destinations rotating over >= 128 MiB, ``clone()``/fresh
  results kept as many as the measured call keeps, a locked dict lookup, plain file I/O (one
  executor job per whole file, temp name + rename, no fsync like both tiers under test,
  ``readinto`` a pre-touched buffer).

Every workload does its setup untimed, one warm-up repetition, then ``reps`` timed repetitions;
a repetition performs ``n`` operations over distinct entries that together span >= 128 MiB
(so copies are DRAM-bound, not cache-hot) and yields seconds per operation. Results kept by the
caller in real use (EC ``get``, HS ``retrieve``) are kept until the repetition's clock stops.
Background writes are drained between repetitions, outside the clock.

Adapter methods (``h`` is an ``mm_hash`` string, ``key`` whatever ``sm_key`` returns)::

    ec_open(workdir, cpu_bytes, disk_bytes)   ec_put(h, t) -> bool    ec_get(h) -> Tensor|None
    ec_contains(h) -> bool    ec_drain(hs)    ec_remove(hs) (CPU copies at least)  ec_close()
    hs_open(pool_bytes, chunk)  hs_store(tokens, hs) -> int  hs_retrieve(tokens, out) -> Tensor|None
    hs_clear()  hs_close()    supports_hs_out: bool
    sm_open(workdir|None, cpu_bytes, disk_bytes)  sm_key(i)  sm_batched_put(keys, ts)
    sm_batched_get_release(keys) -> hits   sm_get_release(key) -> bool   sm_drain(keys)
    sm_evict_cpu()   sm_disk_files() -> paths   sm_clear(keys) (CPU copies at least)   sm_close()
"""

from __future__ import annotations

import concurrent.futures
import gc
import os
import statistics
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

KiB = 1 << 10
MiB = 1 << 20
SPAN = 128 * MiB  # bytes touched per repetition: DRAM-bound, not cache-hot
EC_HIDDEN = 2048  # encoder outputs: bfloat16 [tokens, 2048]
HS_HIDDEN = 4096  # hidden states: float32 [tokens, 4096]
CHUNK = 256
SM_BATCH = 16  # KV chunks per batched call


@dataclass
class Outcome:
    """One workload run on one system: per-operation seconds of each timed repetition."""

    system: str
    workload: str
    size: int
    ok: bool = True
    error: str = ""
    samples: list[float] = field(default_factory=list)
    ops_per_rep: int = 0
    bytes_per_op: int = 0
    hits: int = 0
    misses: int = 0
    note: str = ""

    @property
    def median(self) -> float | None:
        return statistics.median(self.samples) if self.samples else None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["median"] = self.median
        return d


# ---- data -------------------------------------------------------------------------------------
def _count(size: int, quick: bool, lo: int = 8, hi: int = 512) -> int:
    n = max(lo, min(hi, SPAN // max(size, 1)))
    return max(4, n // 8) if quick else n


def ec_tensor(size: int, seed: int) -> torch.Tensor:
    """An encoder output of ``size`` bytes: bfloat16 ``[size / 4096, 2048]``."""
    rows = max(1, size // (2 * EC_HIDDEN))
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, EC_HIDDEN, generator=g).to(torch.bfloat16)


def _sources(size: int, n: int, make: Callable[[int, int], torch.Tensor]) -> list[torch.Tensor]:
    """Source tensors rotating over >= 64 MiB (or ``n`` of them, whichever is fewer)."""
    count = max(2, min(n, (64 * MiB) // max(size, 1)))
    return [make(size, 1000 + i) for i in range(count)]


def kv_tensor(size: int, seed: int) -> torch.Tensor:
    """A KV chunk of ``size`` bytes: bfloat16 ``[2, 1, 256, size / 1024]`` (LMCache's KV_2LTD
    layout: K/V, layers, tokens, hidden)."""
    hidden = max(1, size // (2 * CHUNK * 2))
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 1, CHUNK, hidden, generator=g).to(torch.bfloat16)


def hs_tokens(n_tokens: int, seq: int) -> list[int]:
    """Token ids of prompt number ``seq`` (distinct prompts share no chunk)."""
    base = (seq * 7919 + 13) % 100_000
    return [(base + i * 31) % 151_936 for i in range(n_tokens)]


# ---- the physical baseline as an adapter -------------------------------------------------------
def _touched(nbytes: int) -> torch.Tensor:
    """A uint8 buffer whose pages are all touched (``torch.zeros`` may hand out untouched
    calloc pages, which would put first-touch faults inside a timed copy)."""
    buf = torch.empty(nbytes, dtype=torch.uint8)
    buf.fill_(1)
    return buf


class _BumpPool:
    """A pre-touched buffer carved sequentially (reset by ``reset``); what a pool costs at least."""

    def __init__(self, nbytes: int) -> None:
        self.buf = _touched(max(nbytes, 4096))
        self.off = 0

    def take(self, like: torch.Tensor) -> torch.Tensor:
        nbytes = like.numel() * like.element_size()
        if self.off + nbytes > self.buf.numel():
            self.off = 0
        view = self.buf[self.off : self.off + nbytes].view(like.dtype).view(like.shape)
        self.off += (nbytes + 255) & ~255
        return view

    def reset(self) -> None:
        self.off = 0


class PhysicalAdapter:
    """The physical floor of every workload (see the module docstring)."""

    system = "baseline"
    supports_hs_out = True

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._index: dict[Any, torch.Tensor] = {}
        self._pool: _BumpPool | None = None
        self._exec: concurrent.futures.ThreadPoolExecutor | None = None
        self._dir: str | None = None
        self._pending: list[concurrent.futures.Future[None]] = []
        self._paths: dict[Any, str] = {}
        self._read_bufs: list[memoryview] = []
        self._ri = 0

    # EC: copy into a pre-touched pool; get = a fresh kept tensor (clone); contains = dict lookup
    def ec_open(self, workdir: str, cpu_bytes: int, disk_bytes: int) -> None:
        self._pool = _BumpPool(cpu_bytes)
        self._index = {}

    def ec_put(self, h: str, t: torch.Tensor) -> bool:
        assert self._pool is not None
        dst = self._pool.take(t)
        dst.copy_(t)
        with self._lock:
            self._index[h] = dst
        return True

    def ec_get(self, h: str) -> torch.Tensor | None:
        with self._lock:
            src = self._index.get(h)
        return None if src is None else src.clone()

    def ec_contains(self, h: str) -> bool:
        with self._lock:
            return h in self._index

    def ec_drain(self, hashes: list[str]) -> None:
        return None

    def ec_remove(self, hashes: list[str]) -> None:
        self._index.clear()
        if self._pool is not None:
            self._pool.reset()

    def ec_close(self) -> None:
        self._index = {}
        self._pool = None

    # HS: chunk copies into the pool; retrieve = fresh tensor + copies (or copies into out)
    def hs_open(self, pool_bytes: int, chunk: int) -> None:
        self._pool = _BumpPool(pool_bytes)
        self._chunk = chunk
        self._hs: dict[tuple[int, ...], list[torch.Tensor]] = {}

    def hs_store(self, tokens: list[int], hs: torch.Tensor) -> int:
        assert self._pool is not None
        parts = []
        for s in range(0, hs.shape[0] - hs.shape[0] % self._chunk, self._chunk):
            src = hs[s : s + self._chunk]
            dst = self._pool.take(src)
            dst.copy_(src)
            parts.append(dst)
        self._hs[tuple(tokens[:8])] = parts
        return len(parts)

    def hs_retrieve(self, tokens: list[int], out: torch.Tensor | None) -> torch.Tensor | None:
        parts = self._hs.get(tuple(tokens[:8]))
        if not parts:
            return None
        total = sum(p.shape[0] for p in parts)
        dest = torch.empty(total, parts[0].shape[1], dtype=torch.float32) if out is None else out[:total]
        r = 0
        for p in parts:
            dest[r : r + p.shape[0]].copy_(p)
            r += p.shape[0]
        return dest

    def hs_clear(self) -> None:
        self._hs = {}
        if self._pool is not None:
            self._pool.reset()

    def hs_close(self) -> None:
        self._hs = {}
        self._pool = None

    # SM: copy into the pool (+ one executor job per whole file when a directory is given)
    def sm_open(self, workdir: str | None, cpu_bytes: int, disk_bytes: int) -> None:
        self._pool = _BumpPool(cpu_bytes)
        self._index = {}
        self._paths = {}
        if workdir is not None:
            self._dir = os.path.join(workdir, f"baseline-{uuid.uuid4().hex[:8]}")
            os.makedirs(self._dir, exist_ok=True)
            self._exec = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="baseline-io")

    def sm_key(self, i: int) -> Any:
        return ("bench", i)

    def _write_file(self, path: str, view: memoryview) -> None:
        tmp = f"{path}.{os.getpid()}.{uuid.uuid4().hex[:6]}.tmp"
        with open(tmp, "wb", buffering=0) as f:
            f.write(view)
        os.replace(tmp, path)

    def sm_batched_put(self, keys: list[Any], tensors: list[torch.Tensor]) -> None:
        assert self._pool is not None
        for k, t in zip(keys, tensors, strict=True):
            dst = self._pool.take(t)
            dst.copy_(t)
            with self._lock:
                self._index[k] = dst
            if self._exec is not None and self._dir is not None:
                path = os.path.join(self._dir, f"{k[1]:08d}.bin")
                self._paths[k] = path
                self._pending.append(self._exec.submit(self._write_file, path, _byte_view(dst)))

    def sm_batched_get_release(self, keys: list[Any]) -> int:
        hits = 0
        idx = self._index
        for k in keys:
            with self._lock:
                if idx.get(k) is not None:
                    hits += 1
        return hits

    def _read_file(self, path: str, buf: memoryview) -> int:
        with open(path, "rb", buffering=0) as f:
            return f.readinto(buf) or 0

    def sm_get_release(self, key: Any) -> bool:
        path = self._paths.get(key)
        if path is None or self._exec is None:
            return False
        src = self._index[key]
        nbytes = src.numel() * src.element_size()
        if not self._read_bufs or len(self._read_bufs[0]) != nbytes:
            count = max(4, SPAN // max(nbytes, 1))
            self._read_bufs = [_byte_view(_touched(nbytes)) for _ in range(count)]
        buf = self._read_bufs[self._ri % len(self._read_bufs)]
        self._ri += 1
        return self._exec.submit(self._read_file, path, buf).result() == nbytes

    def sm_drain(self, keys: list[Any]) -> None:
        pending, self._pending = self._pending, []
        for f in pending:
            f.result()

    def sm_evict_cpu(self) -> None:
        return None

    def sm_disk_files(self) -> list[str]:
        return list(self._paths.values())

    def sm_clear(self, keys: list[Any]) -> None:
        self.sm_drain(keys)
        for p in self._paths.values():
            try:
                os.unlink(p)
            except OSError:
                pass
        self._paths = {}
        self._index = {}
        if self._pool is not None:
            self._pool.reset()

    def sm_close(self) -> None:
        self.sm_clear([])
        if self._exec is not None:
            self._exec.shutdown(wait=True)
            self._exec = None
        if self._dir is not None:
            try:
                os.rmdir(self._dir)
            except OSError:
                pass
        self._pool = None


def _byte_view(t: torch.Tensor) -> memoryview:
    """A byte view of a contiguous CPU tensor (zero copy; bfloat16 through uint8)."""
    return t.view(torch.uint8).numpy().data if t.dtype != torch.uint8 else t.numpy().data


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
    out.hits = out.misses = 0  # count the timed repetitions only
    for _ in range(reps):
        out.samples.append(one())


def _now() -> float:
    return time.perf_counter()


def _kept_round(out: Outcome, items: Sequence[Any], fetch: Callable[[Any], Any]) -> float:
    """One repetition of reads whose results the caller keeps until it ends: seconds per item;
    hits and misses are added to ``out``."""
    kept: list[Any] = []
    gc.collect()
    t0 = _now()
    for item in items:
        kept.append(fetch(item))
    dt = _now() - t0
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
    n = _count(size, quick)
    srcs = _sources(size, n, ec_tensor)
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
    n = _count(size, quick)
    srcs = _sources(size, n, ec_tensor)
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
        outs = [_touched(nbytes).view(torch.float32).view(tokens, HS_HIDDEN) for _ in range(n if use_out else 0)]
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
    n = max(2, _count(size * SM_BATCH, quick, lo=2, hi=64))
    srcs = _sources(size, n * SM_BATCH, kv_tensor)
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
    n = max(2, _count(size * SM_BATCH, quick, lo=2, hi=64))
    srcs = _sources(size, n * SM_BATCH, kv_tensor)
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
    n = _count(size, quick, lo=8, hi=256)
    srcs = _sources(size, n, kv_tensor)
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
    n = _count(size, quick, lo=8, hi=256)
    srcs = _sources(size, n, kv_tensor)
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
    srcs = _sources(size, total, ec_tensor)
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


# ---- the worker protocol (shared by every side) ------------------------------------------------
def worker_main(make_adapter: Callable[[], Any], argv: list[str] | None, system: str) -> int:
    """Command line of a side: one workload (``--workload/--size/--reps``) or ``--serve``
    (one JSON request per stdin line: ``{"workload", "size", "reps", "warmup", "workdir",
    "quick"}``; ``{"cmd": "quit"}`` ends). Each outcome is one JSON line on stdout; anything
    else the system prints goes to stderr."""
    import argparse
    import json
    import sys
    import tempfile

    p = argparse.ArgumentParser(description=f"compare worker ({system})")
    p.add_argument("--workload", help=f"one of: {', '.join(WORKLOADS)}")
    p.add_argument("--size", type=int, default=0, help="entry size in bytes (default: the workload's first)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--workdir", default=None, help="directory for disk tiers (a temporary one by default)")
    p.add_argument("--quick", action="store_true", help="fewer entries per repetition (smoke runs)")
    p.add_argument("--serve", action="store_true", help="answer JSON requests from stdin")
    args = p.parse_args(argv)
    if not args.serve and not args.workload:
        p.error("--workload is required unless --serve is given")

    # stdout carries only the JSON lines: point fd 1 (C extensions, logging) at stderr.
    sys.stdout.flush()
    real = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    tmp = tempfile.mkdtemp(prefix=f"lmcache-compare-{system}-")
    adapter: Any = None

    def answer(req: dict[str, Any]) -> dict[str, Any]:
        nonlocal adapter
        name = str(req.get("workload", ""))
        size = int(req.get("size") or 0) or (WORKLOADS[name][1][0] if name in WORKLOADS else 0)
        if adapter is None:
            try:
                adapter = make_adapter()
            except Exception as exc:
                o = Outcome(system=system, workload=name, size=size, ok=False)
                o.error = f"{system} is not available: {type(exc).__name__}: {exc}"
                return o.to_dict()
        o = run_workload(
            adapter, name, size, int(req.get("reps", 5)), int(req.get("warmup", 1)),
            str(req.get("workdir") or tmp), bool(req.get("quick", False)),
        )
        o.system = system
        return o.to_dict()

    try:
        if not args.serve:
            real.write(json.dumps(answer(vars(args))) + "\n")
            return 0
        for line in sys.stdin:
            line = line.strip()
            if not line:
                continue
            req = json.loads(line)
            if req.get("cmd") == "quit":
                break
            real.write(json.dumps(answer(req)) + "\n")
            real.flush()
        return 0
    finally:
        real.flush()
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
