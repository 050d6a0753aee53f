"""Presence answered on the caller's thread, from what a manager holds locally.

Pure functions over the pool tier, the pending write-through map and each lower tier's
:meth:`~lmcache_async.tiers.StorageBackend.contains_nowait`: they decide whether a
``contains``/``batched_contains`` needs the loop at all. No lock is held across tiers; an answer
may be stale by a racing eviction or write-through, like any unlocked read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from lmcache_async._manager.tier_guard import TierGuard
from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import MemoryObj
from lmcache_async.tiers import UNKNOWN, LocalTier, PoolTier

__all__ = ["contains_here", "memory_prefix", "prefix_here"]


def contains_here(
    key: CacheEngineKey, cpu: PoolTier | None, pending: Mapping[CacheEngineKey, MemoryObj], lower: Sequence[TierGuard]
) -> bool | None:
    """True/False when this thread can tell whether some tier holds ``key``; None when a lower
    tier that cannot answer here (``contains_nowait`` gave :data:`~lmcache_async.tiers.UNKNOWN`)
    must be asked on the loop."""
    if (cpu is not None and key in cpu) or key in pending:
        return True
    need_loop = False
    for tier in lower:
        r = tier.contains_nowait(key)
        if r is UNKNOWN:
            need_loop = True
        elif r:
            return True
    return None if need_loop else False


def prefix_here(
    keys: Sequence[CacheEngineKey],
    cpu: PoolTier | None,
    pending: Mapping[CacheEngineKey, MemoryObj],
    lower: Sequence[TierGuard],
) -> tuple[int, bool]:
    """(length of the prefix of ``keys`` known present on this thread, whether the loop must
    be asked about the rest: a tier that cannot answer here may hold the next key). A
    :class:`~lmcache_async.tiers.LocalTier` lower tier is asked once for all remaining keys
    (``present_flags``); the others key by key (``contains_nowait``)."""
    n = cpu.prefix_len(keys) if cpu is not None else 0
    while n < len(keys) and keys[n] in pending:
        n += 1
    if n == len(keys) or not lower:
        return n, False
    need_loop = False
    start = n
    # One batched question per tier answering on this thread (a socket round trip, not one per key).
    flags = [None if g.local is None else g.local.present_flags(keys[start:]) for g in lower]
    while n < len(keys):
        k = keys[n]
        # a later key may be local again (queued write-through, CPU) after a lower-tier hit
        found = k in pending or (cpu is not None and k in cpu)
        for tier, local_flags in () if found else zip(lower, flags, strict=True):
            r = tier.contains_nowait(k) if local_flags is None else local_flags[n - start]
            if r is UNKNOWN:
                need_loop = True
            elif r:
                found = True
                break
        if not found:
            break
        n += 1
    return n, need_loop and n < len(keys)


def memory_prefix(
    keys: Sequence[CacheEngineKey],
    cpu: PoolTier | None,
    pending: Mapping[CacheEngineKey, MemoryObj],
    readers: Sequence[LocalTier],
) -> int:
    """Length of the prefix of ``keys`` held where a read is a memory copy on this thread: the
    pool tier, the pending write-through, or one of ``readers`` (local tiers that read into
    caller memory, e.g. the node server's shared pool; each asked once, ``present_flags``)."""
    n = cpu.prefix_len(keys) if cpu is not None else 0
    while n < len(keys) and keys[n] in pending:
        n += 1
    if n == len(keys) or not readers:
        return n
    start = n
    flags = [r.present_flags(keys[start:]) for r in readers]
    while n < len(keys):
        k = keys[n]
        if not (k in pending or (cpu is not None and k in cpu) or any(f[n - start] for f in flags)):
            break
        n += 1
    return n
