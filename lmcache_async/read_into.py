"""Entries straight into caller-owned memory: the work of ``StorageManager.read_into_sync``.

For each key, in order, on the calling thread:

1. the tiers that answer on the caller's thread (the CPU tier, the queued write-through, other
   :class:`~lmcache_async.backend.LocalTier` s): a hit is copied into the sink (one ``memmove``
   per piece) and its reference released;
2. the lower tiers that read local files (:class:`~lmcache_async.backend.DirectReader`, the
   disk tier): the payload is read from the file into the sink, checked, no buffer between;
3. the keys still missing, when other lower tiers exist (remote, NIXL, third-party): one hop
   for all of them (those tiers read into pool blocks as for ``batched_get``; hits are promoted
   into the CPU tier), then copied on the calling thread. With ``prefix``, steps 1-2 stop at
   the first key they miss; that key and every later one go to step 3 together (so a later
   key only the disk tier holds is a miss there: the prefix ends at it).

Every write into the caller's memory happens on the calling thread, before the call returns:
the loop-side reads of step 3 land in buffers the manager owns, so a hop that times out (its
keys are misses, counted) can never write into the sink afterwards. That is why there is no
coroutine form: an awaited read into caller memory could be cancelled while a read into it
still runs.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from lmcache_async.keys import CacheEngineKey
from lmcache_async.lower_tiers import release_objs
from lmcache_async.memory import MemoryObj
from lmcache_async.ratelog import RateLimitedLog
from lmcache_async.read_sinks import ReadSink
from lmcache_async.tier_guard import NO_ANSWER, NoAnswer, TierGuard

__all__ = ["READ_INTO_COUNTERS", "ReadInto", "check_read_into"]

logger = logging.getLogger(__name__)

READ_INTO_COUNTERS = ("hits", "misses", "mismatches", "timeouts")
"""Counters of :class:`ReadInto` (``stats()["read_into"]``)."""

Front = Callable[[CacheEngineKey], "MemoryObj | NoAnswer | None"]
LowerGet = Callable[[list[CacheEngineKey]], list[MemoryObj | None]]


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

    ``front(key)`` is the manager's caller-thread answer (an entry with the caller's reference,
    None for a miss with nothing below to ask, :data:`NO_ANSWER` when lower tiers must be
    asked); ``guards`` the lower tiers in search order; ``lower_get(keys)`` a bounded blocking
    read of ``keys`` from the lower tiers that are not direct readers (entries with the
    caller's reference; raises ``TimeoutError`` past its bound). Thread-safe.
    """

    def __init__(self, front: Front, guards: list[TierGuard], lower_get: LowerGet) -> None:
        self._front = front
        self._guards = guards
        self._lower_get = lower_get
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

    def _here(self, key: CacheEngineKey, sink: ReadSink) -> bool | NoAnswer:
        """Steps 1-2 for one key: True when filled; False for a miss with nothing else to ask;
        :data:`NO_ANSWER` when only the loop-side tiers are left to ask."""
        r = self._front(key)
        if isinstance(r, MemoryObj):
            return self._fill(sink, r, key)
        if r is None:
            return False
        if any(g.read_into_here(key, sink) for g in self._guards if g.direct is not None):
            return True
        # Asked of the loop: the lower tiers that neither answer here nor read directly.
        return NO_ANSWER if any(not g.answers_locally and g.direct is None for g in self._guards) else False

    def run(self, keys: Sequence[CacheEngineKey], sinks: Sequence[ReadSink], prefix: bool) -> list[bool]:
        """One flag per key: True when its sink holds the entry's payload. ``prefix``: stop at
        the first key that is not filled (every later flag is False, nothing later is read)."""
        check_read_into(keys, sinks)
        n = len(keys)
        out = [False] * n
        later: list[int] = []
        for i in range(n):
            r = self._here(keys[i], sinks[i])
            if r is True:
                out[i] = True
                continue
            if r is NO_ANSWER:
                later.extend(range(i, n) if prefix else (i,))
            if prefix:
                break
        if later:
            self._from_loop(keys, sinks, later, prefix, out)
        filled = sum(out)
        self._add("hits", filled)
        self._add("misses", (1 if filled < n else 0) if prefix else n - filled)  # keys asked, not found
        return out

    def _from_loop(
        self, keys: Sequence[CacheEngineKey], sinks: Sequence[ReadSink], idx: list[int], prefix: bool, out: list[bool]
    ) -> None:
        """Step 3: read ``idx`` through the loop-side tiers and copy the hits (in order; with
        ``prefix``, up to the first miss — later entries are released unread)."""
        try:
            objs = self._lower_get([keys[i] for i in idx])
        except TimeoutError as exc:
            self._add("timeouts")
            self._log.warning("read_into: lower tiers timed out for %d keys: %s", len(idx), exc, key="timeout")
            return
        for j, (i, obj) in enumerate(zip(idx, objs, strict=True)):
            out[i] = obj is not None and self._fill(sinks[i], obj, keys[i])
            if prefix and not out[i]:
                release_objs(objs[j + 1 :])
                return
