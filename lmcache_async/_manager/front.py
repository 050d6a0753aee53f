"""The front of a manager: its CPU pool tier, its pending writes, its staging area and promotion.

A :class:`Front` is built right after the tiers (:func:`~lmcache_async._manager.tier_stack.build_tiers`)
and handed to every part that needs it — the put path, the lower tiers' searches, read-into and
the manager itself — so none of them calls back into the manager:

* **lookups** — :meth:`Front.entry` answers from the CPU tier, then the queued write-through,
  then the local lower tiers it is given, on the caller's thread (one CPU lookup per key);
  :meth:`Front.entries` answers a batch (one ``lookup_many`` per local tier), :meth:`Front.lookup`,
  :meth:`Front.held_prefix` and :meth:`Front.touch` the manager's other caller-thread questions;
* **allocation for reads** — :meth:`Front.read_alloc`: a lower-tier read lands in a CPU-pool block
  when one is free (no second copy to promote it), else in the staging area;
* **promotion** — :meth:`Front.promote` indexes a lower-tier hit in the CPU tier and queues its
  write-back to the lower tiers above the one that had it.

Threads: every method runs on any thread but the manager's loop, except :meth:`promote` and
:meth:`read_alloc`, which the lower tiers' searches call on the loop; the counters may miss an
increment under a race, never gain one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lmcache_async._manager.lower_tiers import release_objs
from lmcache_async._manager.staging import StagingArea
from lmcache_async._manager.tier_stack import TierStack
from lmcache_async._manager.write_through import WriteThrough
from lmcache_async.errors import ManagerClosedError
from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import MemoryFormat, MemoryObj, PoolAllocator
from lmcache_async.tiers import LocalTier, PoolTier, StorageBackend

__all__ = ["Front"]


class Front:
    """The CPU pool tier (``stack.pool_tier``, None without one), the write-through queue ``wt``
    (its :attr:`pending` map: entries whose lower-tier writes are queued) and ``staging``.

    :attr:`front_only` are the local lower tiers that are no direct readers (``read_into``'s
    front asks them key by key; the direct readers it asks in a batch). After :meth:`detach`
    (the manager closed) every lookup misses and :meth:`read_entry` raises
    :class:`ManagerClosedError`.
    """

    def __init__(self, stack: TierStack, pool: PoolAllocator | None, staging: StagingArea, wt: WriteThrough) -> None:
        self.cpu: PoolTier | None = stack.pool_tier
        self.cpu_backend: StorageBackend | None = stack.pool_backend
        self.pool = pool
        self.staging = staging
        self.wt = wt
        #: The write-through queue's own map: read without a lock (one dict lookup).
        self.pending = wt.pending
        self.front_only: tuple[LocalTier, ...] = tuple(
            g.local for g in stack.guards if g.local is not None and g.direct is None
        )
        self.hits = 0
        self.misses = 0
        self.closed = False

    def detach(self) -> None:
        """Let go of the CPU tier and the local tiers (after close)."""
        self.closed = True
        self.cpu = self.cpu_backend = self.pool = None
        self.front_only = ()

    # ---- lookups (caller threads) ----------------------------------------------------------------
    def entry(self, key: CacheEngineKey, local: Sequence[LocalTier]) -> MemoryObj | None:
        """The entry from the CPU tier, the queued write-through or one of the ``local`` tiers,
        with the caller's reference; None when none of them holds it. Counts a CPU hit or miss."""
        cpu = self.cpu
        if cpu is not None:
            obj = cpu.lookup(key)
            if obj is not None:
                self.hits += 1
                return obj
        return self.below_cpu(key, local)

    def below_cpu(self, key: CacheEngineKey, local: Sequence[LocalTier]) -> MemoryObj | None:
        """:meth:`entry` after a CPU-tier miss the caller saw itself (the pending writes, then
        the ``local`` tiers); counts the miss."""
        pend = self.pending.get(key)
        if pend is not None and pend.try_ref_count_up():
            return pend
        self.misses += 1
        for tier in local:
            obj = tier.lookup(key)
            if obj is not None:
                return obj
        return None

    def read_entry(self, key: CacheEngineKey) -> MemoryObj | None:
        """``read_into``'s front: :meth:`entry` over :attr:`front_only`. Raises
        :class:`ManagerClosedError` once detached."""
        if self.closed:
            raise ManagerClosedError("the manager is closed")
        return self.entry(key, self.front_only)

    def entries(
        self, keys: Sequence[CacheEngineKey], local: Sequence[LocalTier]
    ) -> tuple[list[MemoryObj | None], list[int]]:
        """:meth:`entry` for each of ``keys``: one result per key (the caller's references) and
        the indices of the keys still missing. Each of the ``local`` tiers is asked once for the
        keys still missing (``lookup_many``, one round trip); one that raises has every reference
        taken so far released, and the error goes on."""
        out: list[MemoryObj | None] = [None] * len(keys)
        missing: list[int] = []
        for i, k in enumerate(keys):
            obj = self.entry(k, ())
            if obj is None:
                missing.append(i)
            else:
                out[i] = obj
        try:
            for tier in local:
                if not missing:
                    break
                here = tier.lookup_many([keys[i] for i in missing])
                still = []
                for i, obj in zip(missing, here, strict=True):
                    if obj is None:
                        still.append(i)
                    else:
                        out[i] = obj
                missing = still
        except BaseException:
            release_objs(out)
            raise
        return out, missing

    def lookup(self, key: CacheEngineKey, local: Sequence[LocalTier]) -> MemoryObj | None:
        """The entry from the CPU tier, then each of the ``local`` tiers in order, with the
        caller's reference; None when none holds it. The pending writes are not asked and
        nothing is counted."""
        cpu = self.cpu
        obj = cpu.lookup(key) if cpu is not None else None
        for tier in local if obj is None else ():
            obj = tier.lookup(key)
            if obj is not None:
                break
        return obj

    def holds(self, key: CacheEngineKey) -> bool:
        """True when the CPU tier holds ``key`` or its write-through is queued (lock-free)."""
        cpu = self.cpu
        return (cpu is not None and key in cpu) or key in self.pending

    def held_prefix(self, keys: Sequence[CacheEngineKey]) -> int:
        """Length of the prefix of ``keys`` that :meth:`holds` answers True for."""
        cpu = self.cpu
        n = cpu.prefix_len(keys) if cpu is not None else 0
        pending = self.pending
        while n < len(keys) and (keys[n] in pending or (cpu is not None and keys[n] in cpu)):
            n += 1
        return n

    def touch(self, keys: Sequence[CacheEngineKey], local: Sequence[LocalTier]) -> None:
        """Mark ``keys`` recently used in the CPU tier and each of the ``local`` tiers (LRU)."""
        if self.cpu is not None:
            self.cpu.touch(keys)
        for tier in local:
            tier.touch(keys)

    # ---- reads from below (the loop) ------------------------------------------------------------
    def read_alloc(self, shape: Sequence[int], dtype: torch.dtype, fmt: MemoryFormat) -> MemoryObj | None:
        """Where a lower-tier read lands: the CPU pool when it has room (no second copy for
        promotion), else the staging area, else a one-off buffer (None: no memory)."""
        cpu = self.cpu
        if cpu is not None:
            obj = cpu.allocate(shape, dtype, fmt)
            if obj is not None:
                return obj
        return self.staging.allocate(shape, dtype, fmt)

    def promote(self, key: CacheEngineKey, obj: MemoryObj, tier_idx: int) -> MemoryObj:
        """Index a lower-tier hit in the CPU tier when it landed in the pool; write it back to
        the lower tiers above the one that had it (index ``tier_idx``). Returns the caller's
        reference."""
        cpu = self.cpu
        if cpu is not None and obj.allocator is self.pool:
            try:
                existing = cpu.insert(key, obj, extra_refs=1)
            except ManagerClosedError:  # closing: the caller still gets its bytes
                existing = None
            if existing is not None and existing.try_ref_count_up():
                obj.ref_count_down()
                obj = existing
        if tier_idx > 0:
            obj.ref_count_up()
            if not self.wt.enqueue(key, obj, tuple(range(tier_idx))):
                obj.ref_count_down()
        return obj
