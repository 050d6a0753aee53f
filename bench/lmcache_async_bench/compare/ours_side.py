"""This project's side of the comparison: the workloads of :mod:`._harness` on our engines.

Configuration mirrors the LMCache side key for key (``local_cpu`` + ``max_local_cpu_size``,
``local_disk`` + ``max_local_disk_size``, ``chunk_size`` 256, no fsync, LRU). Only the public
API of SPEC §3 is timed; two tool-level calls are used outside the clock: the CPU tier's
``clear_nowait`` (``StorageManager.backend("cpu")``) to drop CPU copies before a cold read, and
``flush`` as the write-through barrier.
"""

from __future__ import annotations

import os
import shutil
import uuid
from typing import Any

import torch

from lmcache_async.config import LMCacheEngineConfig
from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import GiB
from lmcache_async.metadata import LMCacheEngineMetadata
from lmcache_async.storage_manager import StorageManager
from lmcache_async.token_database import ChunkedTokenDatabase

__all__ = ["OursAdapter"]

_META = LMCacheEngineMetadata("bench-model")
_STAGING_GIB = 1 / 16


def _gib(nbytes: int) -> float:
    return max(nbytes, 1 << 20) / GiB


def _config(cpu_bytes: int, disk_dir: str | None, disk_bytes: int, **extra: Any) -> LMCacheEngineConfig:
    kw: dict[str, Any] = {
        "chunk_size": 256,
        "local_cpu": cpu_bytes > 0,
        "max_local_cpu_size": _gib(cpu_bytes) if cpu_bytes > 0 else 0.0,
        "staging_size": _STAGING_GIB if disk_dir else 0.0,
        "local_disk_fsync": "none",
    }
    if disk_dir:
        kw["local_disk"] = disk_dir
        kw["max_local_disk_size"] = _gib(disk_bytes)
    kw.update(extra)
    return LMCacheEngineConfig.from_defaults(**kw)


def _files_under(root: str | None) -> list[str]:
    """Entry files of the disk tier under ``root`` (not its ledger or temporary files)."""
    from lmcache_async.disk.layout import parse_entry_name

    out: list[str] = []
    if root is None:
        return out
    for dirpath, _dirs, files in os.walk(root):
        out.extend(os.path.join(dirpath, f) for f in files if parse_entry_name(f) is not None)
    return out


class OursAdapter:
    """Adapter of :mod:`._harness` over ``ECCacheEngine``, ``HiddenStateStore`` and
    ``StorageManager``."""

    system = "ours"
    supports_hs_out = True

    def __init__(self) -> None:
        self._ec: Any = None
        self._hs: Any = None
        self._sm: StorageManager | None = None
        self._dir: str | None = None
        self._db = ChunkedTokenDatabase(256, metadata=_META)

    def _new_dir(self, workdir: str, what: str) -> str:
        d = os.path.join(workdir, f"ours-{what}-{uuid.uuid4().hex[:8]}")
        os.makedirs(d)
        self._dir = d
        return d

    def _drop_dir(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    # ---- EC --------------------------------------------------------------------------------------
    def ec_open(self, workdir: str, cpu_bytes: int, disk_bytes: int) -> None:
        from lmcache_async.engines.encoder_cache import ECCacheEngine

        cfg = _config(cpu_bytes, self._new_dir(workdir, "ec"), disk_bytes)
        self._ec = ECCacheEngine(cfg, _META, torch.bfloat16)
        pool = self._ec.storage_manager.pool
        if pool is not None:
            pool.wait_ready()

    def ec_put(self, h: str, t: torch.Tensor) -> bool:
        return bool(self._ec.put(h, t))

    def ec_get(self, h: str) -> torch.Tensor | None:
        out: torch.Tensor | None = self._ec.get(h)
        return out

    def ec_contains(self, h: str) -> bool:
        return bool(self._ec.contains(h))

    def ec_drain(self, hashes: list[str]) -> None:
        self._ec.flush()

    def ec_remove(self, hashes: list[str]) -> None:
        self._ec.storage_manager.clear_sync()

    def ec_close(self) -> None:
        if self._ec is not None:
            self._ec.close()
            self._ec = None
        self._drop_dir()

    # ---- HS --------------------------------------------------------------------------------------
    def hs_open(self, pool_bytes: int, chunk: int) -> None:
        from lmcache_async.engines.hidden_states import HiddenStateStore

        cfg = _config(
            0,
            None,
            0,
            chunk_size=chunk,
            enable_hidden_state_cache=True,
            max_hidden_state_cpu_size=_gib(pool_bytes),
        )
        self._hs = HiddenStateStore(cfg, _META, token_database=ChunkedTokenDatabase(chunk, metadata=_META))
        pool = self._hs.storage_manager.pool
        if pool is not None:
            pool.wait_ready()

    def hs_store(self, tokens: list[int], hs: torch.Tensor) -> int:
        return int(self._hs.store_hidden_states(tokens, hs))

    def hs_retrieve(self, tokens: list[int], out: torch.Tensor | None) -> torch.Tensor | None:
        got: torch.Tensor | None = self._hs.retrieve_hidden_states(tokens, out=out)
        return got

    def hs_clear(self) -> None:
        self._hs.clear()

    def hs_close(self) -> None:
        if self._hs is not None:
            self._hs.close()
            self._hs = None

    # ---- StorageManager --------------------------------------------------------------------------
    def sm_open(self, workdir: str | None, cpu_bytes: int, disk_bytes: int) -> None:
        d = self._new_dir(workdir, "sm") if workdir else None
        self._sm = StorageManager(_config(cpu_bytes, d, disk_bytes), _META, name="bench-kv")
        if self._sm.pool is not None:
            self._sm.pool.wait_ready()

    def sm_key(self, i: int) -> CacheEngineKey:
        return self._db.make_key(i + 1)

    def sm_batched_put(self, keys: list[CacheEngineKey], tensors: list[torch.Tensor]) -> None:
        assert self._sm is not None
        self._sm.batched_put_sync(keys, tensors)

    def sm_batched_get_release(self, keys: list[CacheEngineKey]) -> int:
        assert self._sm is not None
        hits = 0
        for obj in self._sm.batched_get_sync(keys):
            if obj is not None:
                hits += 1
                obj.ref_count_down()
        return hits

    def sm_get_release(self, key: CacheEngineKey) -> bool:
        assert self._sm is not None
        obj = self._sm.get_sync(key)
        if obj is None:
            return False
        obj.ref_count_down()
        return True

    def sm_drain(self, keys: list[CacheEngineKey]) -> None:
        assert self._sm is not None
        self._sm.flush_sync()

    def sm_evict_cpu(self) -> None:
        assert self._sm is not None
        cpu = self._sm.backend("cpu")
        if cpu is not None:
            cpu.clear_nowait()  # type: ignore[attr-defined]

    def sm_disk_files(self) -> list[str]:
        return _files_under(self._dir)

    def sm_clear(self, keys: list[CacheEngineKey]) -> None:
        assert self._sm is not None
        self._sm.clear_sync()

    def sm_close(self) -> None:
        if self._sm is not None:
            self._sm.close_sync()
            self._sm = None
        self._drop_dir()
