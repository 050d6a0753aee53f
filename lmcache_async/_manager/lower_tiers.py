"""The tiers below the CPU tier, asked in order, each through its :class:`TierGuard`.

:class:`LowerTiers` holds the manager's loop-path searches: one coroutine per operation that
walks the tiers in search order (disk, remote, NIXL, third-party backends), skipping a tier that
gives :data:`~lmcache_async._manager.tier_guard.UNKNOWN` and never raising for storage trouble.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from lmcache_async._manager.tier_guard import TierGuard
from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import MemoryObj
from lmcache_async.records import header_length
from lmcache_async.tiers import UNKNOWN, Allocate, Presence

if TYPE_CHECKING:
    from lmcache_async._manager.front import Front

__all__ = ["LowerTiers", "Promote", "release_objs"]

logger = logging.getLogger(__name__)

Promote = Callable[[CacheEngineKey, MemoryObj, int], MemoryObj]
"""``promote(key, obj, tier_index)``: hand a hit found in tier ``tier_index`` (the caller's
reference) to the manager, which may index it locally and write it back to the tiers above;
returns the reference the caller of the search gets."""


def release_objs(objs: Sequence[MemoryObj | None]) -> None:
    """Give back one reference of every buffer in ``objs`` (None entries are skipped)."""
    for o in objs:
        if o is not None:
            o.ref_count_down()


class LowerTiers:
    """The lower tiers of one manager in search order.

    Threads: the coroutines run on the manager's loop thread; :meth:`could_hold` is answered on
    any thread. The read searches skip guards whose tier answers on the caller's thread
    (:attr:`TierGuard.answers_locally`): the manager asked those before the hop.

    Reads land in buffers from the front's :meth:`~lmcache_async._manager.front.Front.read_alloc` and
    every hit goes through its :meth:`~lmcache_async._manager.front.Front.promote`; a buffer returned to
    the caller carries one reference the caller owns.

    :attr:`guards` are the tiers of the manager's stack, in search order; :meth:`detach` lets go
    of them once the manager is closed. Warnings go to ``log`` (by default this module's logger).
    """

    def __init__(self, guards: Sequence[TierGuard], front: Front, *, log: logging.Logger = logger) -> None:
        self.guards: Sequence[TierGuard] = guards
        self._read_alloc: Allocate = front.read_alloc
        self._promote: Promote = front.promote
        self._logger = log

    def detach(self) -> None:
        """Drop every tier (after close), so their memory goes as soon as nobody holds it."""
        self.guards = ()

    # ---- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        """Run each backend's :meth:`~lmcache_async.tiers.StorageBackend.start` through its
        guard (a failure is counted and logged; the tier stays in the order)."""
        for tier in self.guards:
            await tier.call("start", tier.backend.start)

    async def flush(self) -> None:
        """Run each backend's :meth:`~lmcache_async.tiers.StorageBackend.flush` through its
        guard (after the write-through queue drained)."""
        for tier in self.guards:
            await tier.call("flush", tier.backend.flush)

    async def close(self) -> None:
        """Close every backend, each bounded by its timeout (at least 5 s); failures are logged."""
        for tier in self.guards:
            try:
                async with asyncio.timeout(max(tier.timeout, 5.0)):
                    await tier.backend.close()
            except Exception:
                self._logger.warning("tier %s did not close cleanly", tier.name, exc_info=True)

    # ---- reads ----------------------------------------------------------------------------------
    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        """The first tier's hit (promoted; the caller owns one reference) or None."""
        for i, tier in enumerate(self.guards):
            if tier.answers_locally:  # asked on the caller's thread already; that answer is final
                continue
            res = await tier.call("get", tier.backend.get, key, self._read_alloc)
            if res is UNKNOWN:
                continue
            if res is None:
                tier.misses += 1
                continue
            tier.hits += 1
            return self._promote(key, res, i)
        return None

    async def batched_get(self, keys: list[CacheEngineKey], skip_direct: bool = False) -> list[MemoryObj | None]:
        """One result per key, each key falling through the tiers independently (one batched
        call per tier for the keys still missing). ``skip_direct``: leave out the tiers that
        read on the caller's thread (:attr:`TierGuard.direct`; the caller asked them already).
        Cancelled mid-way, it gives back what earlier tiers already found."""
        results: list[MemoryObj | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        try:
            for ti, tier in enumerate(self.guards):
                if not todo:
                    break
                if tier.answers_locally or (skip_direct and tier.direct is not None):
                    continue
                res = await tier.call(
                    "get", tier.backend.batched_get, [keys[i] for i in todo], self._read_alloc, n=len(todo)
                )
                if res is UNKNOWN:
                    continue
                still = []
                for i, obj in zip(todo, res, strict=True):
                    if obj is None:
                        tier.misses += 1
                        still.append(i)
                    else:
                        tier.hits += 1
                        results[i] = self._promote(keys[i], obj, ti)
                todo = still
        except BaseException:
            release_objs(results)
            raise
        return results

    # ---- presence -------------------------------------------------------------------------------
    async def presence(self, key: CacheEngineKey) -> Presence:
        """PRESENT when some tier holds ``key``; UNKNOWN when none does but one gave no answer."""
        unknown = False
        for tier in self.guards:
            r = await tier.call("contains", tier.backend.contains, key)
            if r is UNKNOWN:
                unknown = True
            elif r:
                return Presence.PRESENT
        return Presence.UNKNOWN if unknown else Presence.ABSENT

    async def prefix_len(self, keys: list[CacheEngineKey], present: list[bool]) -> int:
        """Length of the prefix of ``keys`` present somewhere; ``present`` flags the keys known
        to be present already (it is updated in place). A tier without an answer counts as
        holding none of the keys it was asked about."""
        for tier in self.guards:
            todo = [i for i, p in enumerate(present) if not p]
            if not todo:
                break
            res = await tier.call(
                "contains", tier.backend.batched_contains, [keys[i] for i in todo], n=len(todo) // 32 + 1
            )
            if res is UNKNOWN:
                continue
            for i, flag in zip(todo, res, strict=True):
                if flag:
                    present[i] = True
        n = 0
        while n < len(present) and present[n]:
            n += 1
        return n

    def could_hold(self, key: CacheEngineKey, rank: int, nbytes: int) -> bool:
        """True when some tier could ever hold the record of ``key`` (header included), by the
        tiers' :attr:`~lmcache_async.tiers.StorageBackend.max_entry_bytes`; a tier without a
        known limit (None, or a property that fails) could. Any thread, no I/O."""
        hlen: int | None = None
        for tier in self.guards:
            try:
                limit = tier.backend.max_entry_bytes
            except Exception:  # a broken property must not fail the put: no limit known
                return True
            if limit is None:
                return True
            if hlen is None:
                hlen = header_length(len(key.to_string().encode("utf-8")), rank)
            if hlen + nbytes <= limit:
                return True
        return False

    # ---- deletes --------------------------------------------------------------------------------
    async def remove(self, key: CacheEngineKey) -> bool:
        """Remove ``key`` from every tier that deletes; True when one of them held it (a tier
        without an answer counts as not having held it)."""
        removed = False
        for tier in self.guards:
            if not tier.backend.supports_delete:
                continue
            r = await tier.call("remove", tier.backend.remove, key)
            if r is not UNKNOWN and r:
                removed = True
        return removed

    async def clear(self) -> None:
        """Clear every tier that deletes."""
        for tier in self.guards:
            if tier.backend.supports_delete:
                await tier.call("clear", tier.backend.clear)
