"""The physical baseline of each workload (SPEC §6), written as one more system adapter.

Part of the comparison harness (see ``_harness.py``): standard library and torch only, imported
both as a module of ``lmcache_async_bench.compare`` and, in the LMCache virtual environment, by
plain name from this directory. Do not import ``lmcache_async`` here.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import uuid
from typing import Any

import torch

if __package__:
    from ._harness_data import (
        SPAN,
        touched,
    )
else:  # loaded by path beside lmcache_side.py
    from _harness_data import (  # type: ignore[no-redef]
        SPAN,
        touched,
    )


class _BumpPool:
    """A pre-touched buffer carved sequentially (reset by ``reset``); what a pool costs at least."""

    def __init__(self, nbytes: int) -> None:
        self.buf = touched(max(nbytes, 4096))
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
            self._read_bufs = [_byte_view(touched(nbytes)) for _ in range(count)]
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
