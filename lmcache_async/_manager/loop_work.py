"""The loop-side halves of a manager's operations: what each runs after its one hop.

:class:`LoopWork` is given the manager's :class:`~lmcache_async._manager.front.Front`, its write-through
queue and its lower tiers' searches, and orders their work where both are involved: a removal or
a clear waits for the queued writes first (so a queued write cannot bring an entry back), a flush
drains the queue before the tiers' own buffers, and a prefix query counts a key whose write is
still queued as present (read-your-writes). Every coroutine runs on the manager's loop.
"""

from __future__ import annotations

from lmcache_async._manager.front import Front
from lmcache_async._manager.lower_tiers import LowerTiers
from lmcache_async._manager.write_through import WriteThrough
from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import MemoryObj

__all__ = ["LoopWork", "release_obj"]


def release_obj(obj: MemoryObj | None) -> None:
    """Drop the reference of a result nobody will take (a hop's orphan)."""
    if obj is not None:
        obj.ref_count_down()


class LoopWork:
    """Loop-side work over ``front``, the write-through ``wt`` and the lower tiers ``tiers``."""

    def __init__(self, front: Front, wt: WriteThrough, tiers: LowerTiers) -> None:
        self._front = front
        self._wt = wt
        self._tiers = tiers

    async def prefix_len(self, keys: list[CacheEngineKey]) -> int:
        """Length of the prefix of ``keys`` some lower tier holds; a key whose write-through is
        still queued counts as present (checked before asking the tiers: a key released from
        the pending map meanwhile is in its tier)."""
        holds = self._front.holds
        return await self._tiers.prefix_len(keys, [holds(k) for k in keys])

    async def flush(self) -> None:
        """The queued writes, then every tier's own buffered writes."""
        await self._wt.flush()
        await self._tiers.flush()

    async def remove(self, key: CacheEngineKey) -> bool:
        """Remove ``key`` from every lower tier (its queued write first); True when one held it."""
        if key in self._front.pending:
            await self._wt.flush()
        return await self._tiers.remove(key)

    async def clear(self) -> None:
        """The queued writes flushed, then every lower tier cleared."""
        await self._wt.flush()
        await self._tiers.clear()
