"""Encoder-cache engines shared within one process, and the hand-off table of each.

Every connector of a process built from the same (config, model, dtype) shares one engine
(:func:`acquire_engine` / :func:`release_engine`); the scheduler-role connector hands verified
entries to a worker-role connector of the same process through the engine's :class:`Handoff`.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from lmcache_async.config import LMCacheEngineConfig
from lmcache_async.dtypes import dtype_name
from lmcache_async.engines.encoder_cache import ECCacheEngine
from lmcache_async.memory import MemoryObj
from lmcache_async.metadata import LMCacheEngineMetadata
from lmcache_async.metrics import serve_configured_metrics

__all__ = ["Handoff", "acquire_engine", "handoff_of", "release_engine", "release_entry"]

logger = logging.getLogger(__name__)


class Handoff:
    """Verified entries the scheduler promised, waiting for a worker of the same process.

    The scheduler puts one ``MemoryObj`` reference per promised hash; the worker takes it (and
    releases it once copied out). An entry no worker took within ``ttl_s`` is released by
    :meth:`sweep`. ``workers`` counts the worker-role connectors of this process using the engine.
    """

    __slots__ = ("entries", "lock", "workers")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.entries: dict[str, list[tuple[MemoryObj, float]]] = {}
        self.workers = 0

    def put(self, mm_hash: str, obj: MemoryObj) -> None:
        with self.lock:
            self.entries.setdefault(mm_hash, []).append((obj, time.monotonic()))

    def take(self, mm_hash: str) -> MemoryObj | None:
        with self.lock:
            objs = self.entries.get(mm_hash)
            if not objs:
                return None
            obj, _ = objs.pop(0)
            if not objs:
                del self.entries[mm_hash]
            return obj

    def sweep(self, ttl_s: float, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        stale: list[MemoryObj] = []
        with self.lock:
            for h in list(self.entries):
                keep = [(o, t) for o, t in self.entries[h] if now - t <= ttl_s]
                stale.extend(o for o, t in self.entries[h] if now - t > ttl_s)
                if keep:
                    self.entries[h] = keep
                else:
                    del self.entries[h]
        for o in stale:
            release_entry(o)
        return len(stale)

    def clear(self) -> None:
        with self.lock:
            objs = [o for lst in self.entries.values() for o, _ in lst]
            self.entries.clear()
        for o in objs:
            release_entry(o)


_handoffs: weakref.WeakKeyDictionary[ECCacheEngine, Handoff] = weakref.WeakKeyDictionary()
_handoffs_lock = threading.Lock()


def handoff_of(engine: ECCacheEngine) -> Handoff:
    """The process-wide hand-off table of ``engine`` (created on first use)."""
    with _handoffs_lock:
        h = _handoffs.get(engine)
        if h is None:
            h = _handoffs[engine] = Handoff()
        return h


def release_entry(obj: MemoryObj) -> None:
    try:
        obj.ref_count_down()
    except Exception:  # pragma: no cover - a double release is a bug elsewhere; never raise here
        logger.debug("encoder-cache connector: releasing a held entry failed", exc_info=True)


class _Shared:
    __slots__ = ("engine", "pid", "refs")

    def __init__(self, engine: ECCacheEngine) -> None:
        self.engine = engine
        self.refs = 0
        self.pid = os.getpid()


_shared: dict[tuple[Any, ...], _Shared] = {}
_shared_lock = threading.Lock()


def _config_fingerprint(config: LMCacheEngineConfig) -> str:
    return json.dumps(config.to_dict(), sort_keys=True, default=str)


def acquire_engine(
    config: LMCacheEngineConfig,
    model_name: str,
    encoder_dtype: torch.dtype,
    factory: Callable[[], ECCacheEngine] | None = None,
) -> tuple[tuple[Any, ...], ECCacheEngine]:
    """The process-wide engine for this (config, model, dtype), created on first use.

    Returns ``(lease, engine)``; give ``lease`` back with :func:`release_engine`. The last
    release closes the engine. An engine inherited through ``fork`` is never reused, and a
    closed one is replaced (leases of the replaced engine then release nothing of the new one).
    """
    token = (os.getpid(), _config_fingerprint(config), model_name, dtype_name(encoder_dtype))
    with _shared_lock:
        entry = _shared.get(token)
        if entry is not None and (entry.pid != os.getpid() or entry.engine.closed):
            del _shared[token]
            entry = None
        if entry is None:
            if factory is None:
                meta = LMCacheEngineMetadata(model_name=model_name, kv_dtype=encoder_dtype, role="worker")
                engine = ECCacheEngine(config, meta, encoder_dtype)
            else:
                engine = factory()
            serve_configured_metrics(engine.storage_manager, config)  # when metrics_port is set
            entry = _Shared(engine)
            _shared[token] = entry
        entry.refs += 1
        return (token, entry), entry.engine


def release_engine(lease: tuple[Any, ...]) -> None:
    """Give back one reference taken by :func:`acquire_engine` (closing the engine at zero)."""
    token, entry = lease
    with _shared_lock:
        if entry.refs <= 0:
            return
        entry.refs -= 1
        if entry.refs > 0:
            return
        if _shared.get(token) is entry:
            del _shared[token]
    if entry.pid == os.getpid():
        handoff_of(entry.engine).clear()
        entry.engine.close()
