"""Where a manager's entries lie: the answers the KV connector prices a load-or-recompute with.

:class:`TierMap` holds a manager's front and tier stack and answers, per key, which tier holds it
(:meth:`TierMap.locate_front` on the caller's thread, :meth:`TierMap.locate_lower` on the loop for
the keys only a loop-side tier can answer), whether each tier's reads are memory copies and
whether it is available (:meth:`TierMap.tier_status`), whether one named tier holds a key
(:meth:`TierMap.holds_here`), whether a hit sits in memory
(:meth:`TierMap.in_memory`, which asks tiers declaring :class:`~lmcache_async.tiers.Locator`), and
how long one read of a lower tier takes (:meth:`TierMap.probe`).
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Sequence
from typing import Any

import torch

from lmcache_async._manager.front import Front
from lmcache_async._manager.tier_guard import TierGuard
from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import MemoryFormat
from lmcache_async.tiers import UNKNOWN, CannotTell

__all__ = ["MEMORY_TIER", "TierMap"]

MEMORY_TIER = "cpu"
"""The name :meth:`TierMap.locate_front` gives an entry held in this process's memory (the CPU tier
or the queued write-through)."""


class TierMap:
    """The locations of one manager's entries over its ``front`` and lower tiers ``guards``."""

    def __init__(self, front: Front, guards: Sequence[TierGuard]) -> None:
        self._front = front
        self.guards = guards
        #: Local tiers that also read into caller memory (the node server's pool).
        self.memory_readers = [g for g in guards if g.local is not None and g.direct is not None]

    def detach(self) -> None:
        """Let go of the tiers (after close)."""
        self.guards = ()
        self.memory_readers = []

    def holds_here(self, tier: str, key: CacheEngineKey) -> bool | CannotTell:
        """Whether tier ``tier`` holds ``key``, asked on the caller's thread: the CPU tier's index,
        or a lower tier's ``contains_nowait``; UNKNOWN when the tier cannot tell here, and for a
        tier that is not configured. Never raises for storage trouble (UNKNOWN)."""
        cpu = self._front.cpu_backend
        if cpu is not None and cpu.name == tier:
            return bool(cpu.contains_nowait(key))
        for g in self.guards:
            if g.name == tier:
                try:
                    return g.contains_nowait(key)
                except Exception:  # a tier's trouble is "cannot tell", never the caller's exception
                    return UNKNOWN
        return UNKNOWN

    def tier_status(self) -> dict[str, tuple[bool, bool]]:
        """Per tier name, in search order: ``(reads_memory, available)`` (see
        :meth:`StorageManager.tier_status <lmcache_async.storage_manager.StorageManager.tier_status>`)."""
        out: dict[str, tuple[bool, bool]] = {}
        cpu = self._front.cpu
        if cpu is not None:
            out[cpu.name] = (True, True)
        for g in self.guards:
            out[g.name] = (g in self.memory_readers, g.breaker.state == g.breaker.CLOSED)
        return out

    def locate_front(self, keys: Sequence[CacheEngineKey]) -> tuple[list[str | None], dict[int, int], list[Any]]:
        """(tier per key where this thread can tell, ``{key index: guard index}`` of the keys
        whose answer needs the loop from that tier on, the local tiers' flags per guard)."""
        front = self._front
        names: list[str | None] = [None] * len(keys)
        rest = []
        for i, k in enumerate(keys):
            if front.holds(k):
                names[i] = MEMORY_TIER
            else:
                rest.append(i)
        guards = self.guards
        flags: list[Any] = [None] * len(guards)
        if rest:
            for gi, g in enumerate(guards):  # one batched question per local tier
                if g.local is not None:
                    got = g.local.present_flags([keys[i] for i in rest])
                    flags[gi] = dict(zip(rest, got, strict=True))
        unresolved: dict[int, int] = {}
        for i in rest:
            for gi, g in enumerate(guards):
                r = flags[gi][i] if flags[gi] is not None else g.contains_nowait(keys[i])
                if r is UNKNOWN:
                    unresolved[i] = gi
                    break
                if r:
                    names[i] = g.name
                    break
        return names, unresolved, flags

    async def locate_lower(
        self, keys: list[CacheEngineKey], names: list[str | None], unresolved: dict[int, int], flags: list[Any]
    ) -> list[str | None]:
        """Loop side of :meth:`locate_front`: the loop-side tiers asked in one batch each."""
        for gi, g in enumerate(self.guards):
            ask = [i for i, start in unresolved.items() if start <= gi]
            if not ask:
                continue
            if flags[gi] is not None:
                got: Any = [flags[gi][i] for i in ask]
            else:
                got = await g.call("contains", g.backend.batched_contains, [keys[i] for i in ask], n=len(ask) // 32 + 1)
                if got is UNKNOWN:
                    continue
            for i, present in zip(ask, got, strict=True):
                if present:
                    names[i] = g.name
                    del unresolved[i]
        return names

    def in_memory(self, keys: Sequence[CacheEngineKey], names: Sequence[str | None]) -> list[bool | None]:
        """Per key located in ``names``: whether a read of it is a memory copy (True), a read of
        a slower medium (False), or None where no tier holds it. A tier declaring
        :class:`~lmcache_async.tiers.Locator` is asked (one batch per tier; a tier that cannot
        be asked answers by its ``reads_memory``); the others answer by ``reads_memory``."""
        status = self.tier_status()
        out: list[bool | None] = [None if n is None else (n == MEMORY_TIER or status[n][0]) for n in names]
        for g in self.guards:
            locator = g.backend.as_locator()
            idx = [i for i, n in enumerate(names) if n == g.name]
            if locator is None or not idx:
                continue
            got = locator.locate_many([keys[i] for i in idx])
            if got is UNKNOWN:
                continue
            for i, where in zip(idx, got, strict=True):
                if where is not None:
                    out[i] = where
        return out

    def probe_target(self, tier: str, nbytes: int) -> TierGuard | None:
        """The guard of lower tier ``tier`` a probe of ``nbytes`` reads from; None when ``tier`` is
        not a lower tier or answers on the caller's thread. ``ValueError`` naming ``nbytes``
        unless it is a positive int."""
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"nbytes must be a positive int, got {nbytes!r}")
        guard = next((g for g in self.guards if g.name == tier), None)
        return None if guard is None or guard.answers_locally else guard

    async def probe(self, guard: TierGuard, nbytes: int) -> float | None:
        """Seconds one read of an ``nbytes`` entry from ``guard``'s tier took (see
        :meth:`StorageManager.probe_read <lmcache_async.storage_manager.StorageManager.probe_read>`)."""
        staging = self._front.staging
        key = CacheEngineKey("lmcache-async-probe", 1, 0, int.from_bytes(os.urandom(8), "little"), torch.uint8)
        obj = staging.allocate((nbytes,), torch.uint8, MemoryFormat.UNDEFINED)
        if obj is None:
            return None
        try:
            # memset, not a torch op: a torch fill of a large block on this (the manager's
            # loop) thread would start an OpenMP team of its own there, threads that then
            # compete with the engine's intra-op threads for the CPUs.
            ctypes.memset(obj.data_ptr, 0, obj.nbytes)
            ok = await guard.call("probe", guard.backend.put, key, obj)
        finally:
            obj.ref_count_down()
        if ok is UNKNOWN or not ok:
            return None
        try:
            await guard.call("probe", guard.backend.flush)
            t0 = time.perf_counter()
            got = await guard.call("probe", guard.backend.get, key, staging.allocate)
            took = time.perf_counter() - t0
            if got is UNKNOWN or got is None:
                return None
            got.ref_count_down()
            return took
        finally:
            if guard.backend.supports_delete:
                await guard.call("probe", guard.backend.remove, key)
