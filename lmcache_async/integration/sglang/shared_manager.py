"""One StorageManager per process and configuration, shared by the SGLang backends using it.

SGLang may build several storage backends in one process (a draft model's pool, a re-attach
after ``detach``); those with the same configuration and identity share one
:class:`StorageManager` (one CPU pool, one loop thread). :func:`acquire_manager` hands out a
lease; :func:`release_manager` gives it back and the last lease closes the manager. A manager
inherited through ``fork`` is never handed out in the child (it builds its own).

Across processes (one per TP rank, a restarted server) entries are shared through the shared
tiers only: the disk directory, the remote store, the node cache server.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import dataclass, field

from lmcache_async.config import LMCacheEngineConfig
from lmcache_async.metadata import LMCacheEngineMetadata
from lmcache_async.storage_manager import StorageManager

logger = logging.getLogger(__name__)

__all__ = ["ManagerLease", "acquire_manager", "release_manager"]

MANAGER_NAME = "sglang"
"""The manager's name (its loop thread is ``lmcache-async-sglang``)."""


@dataclass(eq=False)
class _Entry:
    manager: StorageManager
    refs: int = 0
    pid: int = field(default_factory=os.getpid)


@dataclass(frozen=True, eq=False)
class ManagerLease:
    """One backend's share of a manager; give it back once with :func:`release_manager`."""

    token: tuple[object, ...]
    entry: _Entry
    released: list[bool] = field(default_factory=lambda: [False])

    @property
    def manager(self) -> StorageManager:
        return self.entry.manager


_entries: dict[tuple[object, ...], _Entry] = {}
_lock = threading.Lock()


def _token(config: LMCacheEngineConfig, metadata: LMCacheEngineMetadata) -> tuple[object, ...]:
    fingerprint = json.dumps(config.to_dict(), sort_keys=True, default=str)
    return (os.getpid(), fingerprint, metadata.model_name, metadata.world_size, metadata.worker_id)


def acquire_manager(config: LMCacheEngineConfig, metadata: LMCacheEngineMetadata) -> ManagerLease:
    """The process-wide manager for ``(config, metadata)``, built on first use.

    Building it may raise what :class:`StorageManager` raises (an invalid tier setting, a pool
    larger than the memory available): SGLang then fails the attach with that message.
    """
    token = _token(config, metadata)
    with _lock:
        entry = _entries.get(token)
        if entry is not None and (entry.pid != os.getpid() or entry.manager.closed):
            del _entries[token]  # inherited through fork, or closed behind our back
            entry = None
        if entry is None:
            entry = _entries[token] = _Entry(StorageManager(config, metadata, name=MANAGER_NAME))
        entry.refs += 1
        return ManagerLease(token, entry)


def release_manager(lease: ManagerLease) -> None:
    """Give back ``lease`` (a second release is a no-op); the last one closes the manager,
    flushing its pending lower-tier writes first (bounded by ``blocking_timeout_secs``)."""
    with _lock:
        if lease.released[0]:
            return
        lease.released[0] = True
        entry = lease.entry
        entry.refs -= 1
        if entry.refs > 0:
            return
        if _entries.get(lease.token) is entry:
            del _entries[lease.token]
    manager = entry.manager
    if manager.closed or entry.pid != os.getpid():
        return
    try:
        manager.close_sync()
    except Exception:  # closing must never fail SGLang's detach or shutdown
        logger.warning("SGLang backend: closing the storage manager failed", exc_info=True)
