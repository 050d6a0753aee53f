"""Entries straight into caller-owned memory: the work of ``StorageManager.read_into_sync``.

On the calling thread, in three steps:

1. the **front** — the CPU tier, the queued write-through and the other
   :class:`~lmcache_async.tiers.LocalTier` s that are no direct readers — key by key: a hit is
   copied into the sink (:meth:`ReadSink.fill_from <lmcache_async.read_sinks.ReadSink.fill_from>`:
   one ``copy_`` into the sink's strided view when it carries one and the calling thread runs
   torch with one intra-op thread, else one ``memmove`` per piece) and its reference released;
2. the **direct readers** (:class:`~lmcache_async.tiers.DirectReader`: the node cache
   server's client, which copies out of the node's shared pool, then the disk tier, which reads
   the record file straight into the sink and checks it there), each asked once for the batch
   of keys still missing (the server answers a batch in one round trip);
3. the keys still missing, when other lower tiers exist (remote, NIXL, third-party): one hop
   for all of them (those tiers read into pool blocks as for ``batched_get``; hits are promoted
   into the CPU tier), then copied on the calling thread.

With ``prefix`` the steps follow the keys in order: the front stops at its first miss, the
direct readers read on from there as far as each can (then the front is asked again from where
they stopped), and what no tier here could fill goes to step 3, which ends at its first miss.
Nothing after the first key that is not filled is read.

Every write into the caller's memory happens on the calling thread, before the call returns:
the loop-side reads of step 3 land in buffers the manager owns, so a hop that times out (its
keys are misses, counted) can never write into the sink afterwards. That is why there is no
coroutine form: an awaited read into caller memory could be cancelled while a read into it
still runs.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from lmcache_async._manager.lower_tiers import LowerTiers, release_objs
from lmcache_async._manager.tier_guard import TierGuard
from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import MemoryObj
from lmcache_async.ratelog import RateLimitedLog
from lmcache_async.read_sinks import ReadSink

if TYPE_CHECKING:
    from lmcache_async._manager.front import Front
    from lmcache_async.sync_bridge import SyncBridge

__all__ = ["READ_INTO_COUNTERS", "ReadInto", "check_read_into"]

logger = logging.getLogger(__name__)

READ_INTO_COUNTERS = ("hits", "misses", "mismatches", "timeouts")
"""Counters of :class:`ReadInto` (``stats()["read_into"]``)."""


def check_read_into(keys: Sequence[CacheEngineKey], sinks: Sequence[ReadSink]) -> None:
    """``ValueError``/``TypeError`` naming ``sinks``/``keys[i]``/``sinks[i]`` for a caller mistake."""
    if len(keys) != len(sinks):
        raise ValueError(f"sinks has {len(sinks)} entries for {len(keys)} keys")
    for i, (k, sink) in enumerate(zip(keys, sinks, strict=True)):
        if type(k) is not CacheEngineKey:
            raise TypeError(f"keys[{i}] must be a CacheEngineKey, got {type(k).__name__}")
        if not isinstance(sink, ReadSink):
            raise TypeError(f"sinks[{i}] must be a ReadSink, got {type(sink).__name__}")


class ReadInto:
    """``read_into_sync`` over one manager's tiers (see the module docstring).

    ``front`` answers from the CPU tier, the queued write-through and the local tiers that are no
    direct readers (:meth:`~lmcache_async._manager.front.Front.read_entry`); ``lower`` are the lower tiers
    in search order (the direct readers among them are asked on the calling thread, the tiers
    that are neither direct readers nor :class:`~lmcache_async.tiers.LocalTier` s through one
    bounded hop of ``bridge``, which raises ``TimeoutError`` past its bound). Thread-safe.
    """

    def __init__(self, front: Front, lower: LowerTiers, bridge: SyncBridge) -> None:
        self._front = front.read_entry
        self._guards = lower.guards
        self._lower = lower
        self._bridge = bridge
        self._lock = threading.Lock()
        self.counts: dict[str, int] = dict.fromkeys(READ_INTO_COUNTERS, 0)
        self._log = RateLimitedLog(logger)

    def _add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] += n

    def stats(self) -> dict[str, int]:
        """The counters (any thread)."""
        with self._lock:
            return dict(self.counts)

    async def _indirect(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        """The lower tiers that are no direct readers, in one bounded hop."""
        return await self._bridge.hop(self._lower.batched_get(keys, skip_direct=True), release_objs)

    def detach(self) -> None:
        """Let go of the tiers (after close)."""
        self._guards = ()

    def _fill(self, sink: ReadSink, obj: MemoryObj, key: CacheEngineKey) -> bool:
        """Copy ``obj`` into ``sink`` and release it; False (counted, logged) when its shape or
        dtype is not the sink's."""
        try:
            if sink.fill_from(obj):
                return True
            self._add("mismatches")
            self._log.warning(
                "read_into: %s is %s %s, the sink expects %s %s",
                key,
                obj.shape,
                obj.dtype,
                sink.shape,
                sink.dtype,
                key="mismatch",
            )
            return False
        finally:
            obj.ref_count_down()

    def _from_front(self, key: CacheEngineKey, sink: ReadSink) -> bool | None:
        """Step 1 for one key: True when filled, False when the front holds it in another shape
        or dtype (not asked further), None when the front does not hold it."""
        obj = self._front(key)
        return None if obj is None else self._fill(sink, obj, key)

    def _direct(self) -> list[TierGuard]:
        """The direct readers: those that read memory (local tiers: the node server's pool)
        first, then those that read a device (the disk tier), each group in search order; every
        copy is verified, so the order decides only how fast a key held twice is read."""
        direct = [g for g in self._guards if g.direct is not None]
        return [g for g in direct if g.answers_locally] + [g for g in direct if not g.answers_locally]

    def _loop_side(self) -> bool:
        """Whether lower tiers that only the loop reads exist (step 3 has someone to ask)."""
        return any(not g.answers_locally and g.direct is None for g in self._guards)

    def run(self, keys: Sequence[CacheEngineKey], sinks: Sequence[ReadSink], prefix: bool) -> list[bool]:
        """One flag per key: True when its sink holds the entry's payload. ``prefix``: stop at
        the first key that is not filled (every later flag is False, nothing later is read)."""
        check_read_into(keys, sinks)
        n = len(keys)
        out = [False] * n
        if prefix:
            self._run_prefix(keys, sinks, out)
        else:
            self._run_each(keys, sinks, out)
        filled = sum(out)
        self._add("hits", filled)
        self._add("misses", (1 if filled < n else 0) if prefix else n - filled)  # keys asked, not found
        return out

    def _run_prefix(self, keys: Sequence[CacheEngineKey], sinks: Sequence[ReadSink], out: list[bool]) -> None:
        n = len(keys)
        direct = self._direct()
        pos = 0
        while pos < n:
            here = self._from_front(keys[pos], sinks[pos])
            if here is True:
                out[pos] = True
                pos += 1
                continue
            if here is False:  # held in another shape: the prefix ends here
                return
            read = 0
            for guard in direct:  # from ``pos`` on, as far as one direct reader can
                flags = guard.read_into_here(keys[pos:], sinks[pos:], True)
                while read < len(flags) and flags[read]:
                    read += 1
                if read:
                    break
            if not read:
                break
            out[pos : pos + read] = [True] * read
            pos += read
        if pos < n and self._loop_side():
            self._from_loop(keys, sinks, list(range(pos, n)), True, out)

    def _run_each(self, keys: Sequence[CacheEngineKey], sinks: Sequence[ReadSink], out: list[bool]) -> None:
        missing: list[int] = []
        for i in range(len(keys)):
            here = self._from_front(keys[i], sinks[i])
            if here is None:
                missing.append(i)
            else:
                out[i] = here
        for guard in self._direct():
            if not missing:
                return
            flags = guard.read_into_here([keys[i] for i in missing], [sinks[i] for i in missing], False)
            still = []
            for i, ok in zip(missing, flags, strict=True):
                if ok:
                    out[i] = True
                else:
                    still.append(i)
            missing = still
        if missing and self._loop_side():
            self._from_loop(keys, sinks, missing, False, out)

    def _from_loop(
        self, keys: Sequence[CacheEngineKey], sinks: Sequence[ReadSink], idx: list[int], prefix: bool, out: list[bool]
    ) -> None:
        """Step 3: read ``idx`` through the loop-side tiers and copy the hits (in order; with
        ``prefix``, up to the first miss — later entries are released unread)."""
        try:
            objs = self._bridge.run(self._indirect([keys[i] for i in idx]))
        except TimeoutError as exc:
            self._add("timeouts")
            self._log.warning("read_into: lower tiers timed out for %d keys: %s", len(idx), exc, key="timeout")
            return
        for j, (i, obj) in enumerate(zip(idx, objs, strict=True)):
            out[i] = obj is not None and self._fill(sinks[i], obj, keys[i])
            if prefix and not out[i]:
                release_objs(objs[j + 1 :])
                return
