"""LMCache 0.5.6's side of the comparison: the workloads of ``_harness.py`` on LMCache.

Standalone on purpose: it is executed *by path* with the python of the LMCache virtual
environment (``scripts/lmcache_env.sh``), where ``lmcache_async`` is not installed. It needs
torch, lmcache and ``_harness.py`` from its own directory, nothing else.

    <venv-lmcache>/bin/python lmcache_side.py --workload ec_put --size 262144 --reps 5
    <venv-lmcache>/bin/python lmcache_side.py --serve      # JSON requests on stdin, one per line

Each run prints one JSON line (the outcome) on stdout; LMCache's own logging goes to stderr.

How LMCache is driven (its public classes, CPU-only, plain host memory):

* EC: ``lmcache.v1.ec_engine.ECCacheEngine(config, metadata, encoder_dtype)`` — ``put``, ``get``,
  ``contains``. It refuses a config without a storage backend besides the CPU allocator, so the
  EC workloads run with ``local_disk`` on both sides.
* HS: ``lmcache.v1.hidden_state_store.HiddenStateStore(config, token_database)`` (no KV
  manager bound on either side: HS-only prefixes). It has no ``out=``.
* KV-like entries: ``lmcache.v1.storage_backend.storage_manager.StorageManager`` —
  ``batched_allocate`` + ``copy_`` + ``batched_put``, ``batched_get`` (CPU hits), and ``get``
  per key for disk reads (its ``batched_get`` stops at the CPU tier's ``[None]``, which is why
  the EC engine misses after CPU eviction; the cold-read workload uses the per-key path that
  works).
* LMCache has no write-through barrier: the drain polls the disk backend's index until every
  key is there (0.5 ms steps).
* Between repetitions only CPU copies are removed: LMCache's disk ``remove`` does not give the
  bytes back to its disk budget (only its own eviction does), so removed files would make later
  writes silently dropped once the budget looks full. The harness gives every run a disk budget
  that holds all its repetitions instead.

LMCache's log level is WARNING for the run (``LMCACHE_LOG_LEVEL``; at its default INFO the EC
engine logs one line per put, which would be measured too).
"""

from __future__ import annotations

import os
import sys

__all__ = ["LMCacheAdapter", "main"]

os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
os.environ.setdefault("PYTHONHASHSEED", "0")

import shutil
import time
import uuid
from typing import Any

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

_GIB = float(1 << 30)
_DRAIN_TIMEOUT_S = 120.0


def _gib(nbytes: int) -> float:
    return max(nbytes, 1 << 20) / _GIB


def _files_under(root: str | None) -> list[str]:
    out: list[str] = []
    if root is None:
        return out
    for dirpath, _dirs, files in os.walk(root):
        out.extend(os.path.join(dirpath, f) for f in files)
    return out


class LMCacheAdapter:
    """Adapter of ``_harness`` over LMCache 0.5.6 (see the module docstring)."""

    system = "lmcache"
    supports_hs_out = False

    def __init__(self) -> None:
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata

        self._Key = CacheEngineKey
        self._Config = LMCacheEngineConfig
        self._meta = LMCacheMetadata(
            model_name="bench-model",
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=torch.bfloat16,
            kv_shape=(1, 2, 256, 8, 128),
        )
        self._ec: Any = None
        self._hs: Any = None
        self._sm: Any = None
        self._dir: str | None = None

    def _config(self, cpu_bytes: int, disk_dir: str | None, disk_bytes: int, **extra: Any) -> Any:
        kw: dict[str, Any] = {
            "chunk_size": 256,
            "local_cpu": True,
            "max_local_cpu_size": _gib(cpu_bytes),
        }
        if disk_dir:
            kw["local_disk"] = disk_dir
            kw["max_local_disk_size"] = _gib(disk_bytes)
        kw.update(extra)
        return self._Config.from_defaults(**kw)

    def _new_dir(self, workdir: str, what: str) -> str:
        d = os.path.join(workdir, f"lmcache-{what}-{uuid.uuid4().hex[:8]}")
        os.makedirs(d)
        self._dir = d
        return d

    def _drop_dir(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def _wait_on_disk(self, sm: Any, keys: list[Any]) -> None:
        disk = sm.storage_backends.get("LocalDiskBackend")
        if disk is None:
            return
        deadline = time.monotonic() + _DRAIN_TIMEOUT_S
        pending = list(keys)
        while pending:
            pending = [k for k in pending if not disk.contains(k)]
            if not pending:
                return
            # A key is in the put-task set from submission until it is indexed: one in neither
            # was dropped (e.g. "insufficient evictable disk cache space").
            dropped = [k for k in pending if not disk.exists_in_put_tasks(k) and not disk.contains(k)]
            if dropped:
                raise RuntimeError(f"LMCache dropped {len(dropped)} disk writes")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(pending)} LMCache disk writes did not finish")
            time.sleep(0.0005)

    # ---- EC --------------------------------------------------------------------------------------
    def ec_open(self, workdir: str, cpu_bytes: int, disk_bytes: int) -> None:
        from lmcache.v1.ec_engine import ECCacheEngine

        cfg = self._config(cpu_bytes, self._new_dir(workdir, "ec"), disk_bytes)
        self._ec = ECCacheEngine(cfg, self._meta, torch.bfloat16)

    def ec_put(self, h: str, t: torch.Tensor) -> bool:
        return bool(self._ec.put(h, t))

    def ec_get(self, h: str) -> torch.Tensor | None:
        out: torch.Tensor | None = self._ec.get(h, "cpu")
        return out

    def ec_contains(self, h: str) -> bool:
        return bool(self._ec.contains(h))

    def ec_drain(self, hashes: list[str]) -> None:
        ec = self._ec
        self._wait_on_disk(ec._storage_manager, [ec._make_cache_key(h) for h in hashes])

    def ec_remove(self, hashes: list[str]) -> None:
        # CPU copies only: LMCache 0.5.6's disk ``remove`` never returns the bytes to its disk
        # budget, so later writes would be dropped; the harness sizes the budget instead.
        ec = self._ec
        for h in hashes:
            ec._storage_manager.remove(ec._make_cache_key(h), locations=["LocalCPUBackend"])

    def ec_close(self) -> None:
        if self._ec is not None:
            self._ec.close()
            self._ec = None
        self._drop_dir()

    # ---- HS --------------------------------------------------------------------------------------
    def hs_open(self, pool_bytes: int, chunk: int) -> None:
        from lmcache.v1.hidden_state_store import HiddenStateStore
        from lmcache.v1.token_database import ChunkedTokenDatabase

        cfg = self._config(
            64 << 20,
            None,
            0,
            chunk_size=chunk,
            enable_hidden_state_cache=True,
            max_hidden_state_cpu_size=_gib(pool_bytes),
        )
        self._hs = HiddenStateStore(cfg, ChunkedTokenDatabase(cfg, self._meta))

    def hs_store(self, tokens: list[int], hs: torch.Tensor) -> int:
        return int(self._hs.store_hidden_states(tokens, hs, layer_idx=0))

    def hs_retrieve(self, tokens: list[int], out: torch.Tensor | None) -> torch.Tensor | None:
        # LMCache 0.5.6 has no ``out=``: its plain retrieve is what a caller gets.
        got: torch.Tensor | None = self._hs.retrieve_hidden_states(tokens, layer_idx=0)
        return got

    def hs_clear(self) -> None:
        hs = self._hs
        for key in list(hs._chunks):
            hs.drop_key(key)

    def hs_close(self) -> None:
        if self._hs is not None:
            self._hs.close()
            self._hs = None

    # ---- StorageManager --------------------------------------------------------------------------
    def sm_open(self, workdir: str | None, cpu_bytes: int, disk_bytes: int) -> None:
        from lmcache.v1.event_manager import EventManager
        from lmcache.v1.storage_backend.storage_manager import StorageManager

        d = self._new_dir(workdir, "sm") if workdir else None
        self._sm = StorageManager(self._config(cpu_bytes, d, disk_bytes), self._meta, EventManager())

    def sm_key(self, i: int) -> Any:
        return self._Key("bench-model", 1, 0, i + 1, torch.bfloat16, {})

    def sm_batched_put(self, keys: list[Any], tensors: list[torch.Tensor]) -> None:
        from lmcache.v1.memory_management import MemoryFormat

        sm = self._sm
        t0 = tensors[0]
        if all(t.shape == t0.shape and t.dtype == t0.dtype for t in tensors):
            objs = sm.batched_allocate(
                t0.shape, t0.dtype, len(tensors), MemoryFormat.KV_2LTD, eviction=True, busy_loop=False
            )
        else:  # pragma: no cover - the harness batches one shape
            objs = [sm.allocate(t.shape, t.dtype, MemoryFormat.KV_2LTD, busy_loop=False) for t in tensors]
        if objs is None or any(o is None for o in objs):
            raise RuntimeError("LMCache allocation failed")
        for o, t in zip(objs, tensors, strict=True):
            o.tensor.copy_(t)
        sm.batched_put(keys, objs)

    def sm_batched_get_release(self, keys: list[Any]) -> int:
        hits = 0
        for obj in self._sm.batched_get(keys):
            if obj is not None:
                hits += 1
                obj.ref_count_down()
        return hits

    def sm_get_release(self, key: Any) -> bool:
        obj = self._sm.get(key)
        if obj is None:
            return False
        obj.ref_count_down()
        return True

    def sm_drain(self, keys: list[Any]) -> None:
        self._wait_on_disk(self._sm, keys)

    def sm_evict_cpu(self) -> None:
        self._sm.storage_backends["LocalCPUBackend"].clear()

    def sm_disk_files(self) -> list[str]:
        return _files_under(self._dir)

    def sm_clear(self, keys: list[Any]) -> None:
        self._wait_on_disk(self._sm, keys)
        for k in keys:  # CPU copies only (see ec_remove)
            self._sm.remove(k, locations=["LocalCPUBackend"])

    def sm_close(self) -> None:
        if self._sm is not None:
            self._sm.close()
            self._sm = None
        self._drop_dir()


def main(argv: list[str] | None = None) -> int:
    import _harness  # next to this file

    from_worker = _harness.worker_main
    return int(from_worker(LMCacheAdapter, argv, system="lmcache"))


if __name__ == "__main__":
    sys.exit(main())
