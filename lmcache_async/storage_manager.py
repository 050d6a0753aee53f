"""The async StorageManager: local tiers on the caller's thread, lower tiers on a loop thread.

Composed of parts built once, each from the ones before it (:mod:`lmcache_async._manager.parts`): it
answers on the caller's thread from its :class:`~lmcache_async._manager.front.Front` and makes one
bounded hop to its loop for the lower tiers; its :class:`~lmcache_async._manager.lifecycle.Lifecycle`
starts and closes it. Every operation is written once,
as a coroutine; its ``*_sync`` twin comes from :func:`~lmcache_async.sync_bridge.sync_twin` (same result, errors and
bound). Paths, file by file: ``docs/architecture.md``. Ownership: ``get`` hands the caller one reference to a
:class:`MemoryObj` (release it with ``ref_count_down()`` or a ``with`` block); ``put`` borrows a MemoryObj it is given.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Coroutine, Sequence
from typing import Any

import torch

from lmcache_async._manager.lifecycle import ClosedByLifecycle, Lifecycle, Opening
from lmcache_async._manager.local_answers import contains_here, prefix_here
from lmcache_async._manager.loop_work import release_obj
from lmcache_async._manager.lower_tiers import release_objs
from lmcache_async._manager.parts import ManagerParts, build_parts
from lmcache_async._manager.put_path import check_put_batch
from lmcache_async._manager.stats import manager_stats
from lmcache_async._manager.tier_access import backend_named, describer_of, leases_of, sole_batch_reader
from lmcache_async._manager.where import MEMORY_TIER
from lmcache_async.config import LMCacheEngineConfig
from lmcache_async.deprecation import renamed
from lmcache_async.errors import LoopThreadCallError, ManagerClosedError
from lmcache_async.keys import CacheEngineKey
from lmcache_async.loop import LoopThread
from lmcache_async.memory import MemoryFormat, MemoryObj
from lmcache_async.metadata import LMCacheEngineMetadata
from lmcache_async.read_sinks import ReadSink
from lmcache_async.sync_bridge import sync_twin
from lmcache_async.tiers import (
    UNKNOWN,
    BatchLookup,
    CannotTell,
    Describer,
    DirectPut,
    Presence,
    PromiseLeases,
    StorageBackend,
)

__all__ = ["StorageManager"]

logger = logging.getLogger(__name__)


class StorageManager(ClosedByLifecycle):
    """Tiered async storage for cache entries; see the module docstring.

    Coroutines can be awaited from any event loop; ``*_sync`` twins serve threads without one. Misuse raises a named
    ``RuntimeError`` subclass at once: a ``*_sync`` call on the manager's loop thread (:class:`LoopThreadCallError`),
    any call after :meth:`close` (:class:`ManagerClosedError`), any call in a forked child
    (:class:`ForkedProcessError`). Calls whose lower-tier work outlasts ``blocking_timeout_secs`` raise
    ``TimeoutError`` (the loop-side work is cancelled), awaited or sync alike. Storage trouble never raises: it is a
    miss/False plus a counter.

    Build it with ``StorageManager(config, metadata)`` on a thread that may block while the tiers start, or ``await
    StorageManager.open(config, metadata)`` (also ``async with``) from a coroutine. Close it with :meth:`close_sync`,
    ``await`` :meth:`aclose` or a ``with`` block; a manager garbage-collected unclosed warns (``ResourceWarning``) and
    is closed then.

    ``cpu_size_gib``/``cpu_size_key`` let an engine size the CPU pool from another key (the hidden-state store uses
    ``max_hidden_state_cpu_size``); ``name`` names the loop thread (``lmcache-async-<name>``).
    """

    def __init__(
        self,
        config: LMCacheEngineConfig,
        metadata: LMCacheEngineMetadata | None = None,
        *,
        name: str = "kv",
        cpu_size_gib: float | None = None,
        cpu_size_key: str = "max_local_cpu_size",
        lower_tiers: bool = True,
    ) -> None:
        self._build(build_parts(config, metadata, name, cpu_size_gib, cpu_size_key, lower_tiers, logger))
        self._life.start_sync()

    @classmethod
    def open(
        cls,
        config: LMCacheEngineConfig,
        metadata: LMCacheEngineMetadata | None = None,
        *,
        name: str = "kv",
        cpu_size_gib: float | None = None,
        cpu_size_key: str = "max_local_cpu_size",
        lower_tiers: bool = True,
    ) -> Opening[StorageManager]:
        """Build and start a manager without blocking the caller's event loop: ``sm = await StorageManager.open(...)``,
        or ``async with StorageManager.open(...) as sm:`` (closed on exit). Pools are allocated on a worker thread and
        tiers start on the manager's loop; a failed or cancelled open leaves nothing running. Arguments as for the
        constructor."""

        def build() -> tuple[StorageManager, Lifecycle]:
            sm = cls.__new__(cls)
            sm._build(build_parts(config, metadata, name, cpu_size_gib, cpu_size_key, lower_tiers, logger))
            return sm, sm._life

        return Opening(build)

    def _build(self, p: ManagerParts) -> None:
        """Take the parts (:func:`build_parts`); the tiers are not started yet (its :class:`Lifecycle` does that)."""
        self.config, self.metadata, self.name = p.config, p.metadata, p.name
        self.pool, self.staging_pool, self._staging = p.pool, p.staging_pool, p.staging
        self._lt, self.bridge, self._hop = p.lt, p.bridge, p.bridge.hop
        #: Where the tiers' removal reports go (:meth:`RemovalFanout.add` a listener).
        self.removals = p.removals
        self._wt, self._front, self._tiers, self._put, self._read_into = p.wt, p.front, p.tiers, p.put, p.read_into
        self._where, self._work, self._life = p.where, p.loop_work, p.life
        self._cpu, self._pending, self._local, self._lower = p.front.cpu, p.front.pending, p.stack.local, p.stack.guards
        #: Lower tiers the read paths must ask on the loop (the others answer on this thread).
        self._loop_readers = p.stack.wants_loop()

    def allocate(
        self, shape: Sequence[int], dtype: torch.dtype, fmt: MemoryFormat = MemoryFormat.UNDEFINED
    ) -> MemoryObj | None:
        """A CPU-pool block the caller owns (one reference), evicting entries nobody holds when needed; None at once
        when it cannot fit (or there is no CPU tier).

        Fill it and pass it to :meth:`put` (which borrows it: no second copy); keep the reference while the entry must
        not be evicted, then release it. Any thread.
        """
        self._check_usable()
        return None if self._cpu is None else self._cpu.allocate(shape, dtype, fmt)

    def _check_usable(self) -> None:
        if self._life.closed:
            raise ManagerClosedError(f"StorageManager {self.name!r} is closed")
        self._lt.check_usable()

    def _check_keys(self, keys: Sequence[CacheEngineKey]) -> None:
        self._check_usable()
        for k in keys:
            if type(k) is not CacheEngineKey:
                raise _not_a_key(k)

    @property
    def has_lower_tiers(self) -> bool:
        """True when a tier below the CPU tier is configured."""
        return bool(self._lower)

    @property
    def tier_names(self) -> list[str]:
        """Registry names of the tiers in search order."""
        return ([self._cpu.name] if self._cpu is not None else []) + [t.name for t in self._lower]

    @property
    def loop_thread(self) -> LoopThread:
        """The manager's loop thread (its ``loop`` runs every lower-tier coroutine)."""
        return self._lt

    async def put(
        self, key: CacheEngineKey, value: torch.Tensor | MemoryObj, fmt: MemoryFormat = MemoryFormat.UNDEFINED
    ) -> bool:
        """Store ``value`` under ``key``; False only when no tier could take it right now.

        A tensor is copied into the pool (its own shape and dtype kept); a MemoryObj is borrowed (the caller keeps its
        reference). A key the CPU tier holds, or whose write-through is queued, is a no-op returning True; a key only a
        lower tier claims to hold is stored again (that tier's record is unverified until read: it keeps it when
        intact). True means readable now (CPU tier, queued write-through, or a direct tier: with no CPU tier and the
        node server first, the payload is written into its block on the caller's thread) and, after :meth:`flush`, in
        every lower tier that accepted the write. Other lower tiers are written in the background; the caller's thread
        never waits for them.

        False at once, counted in ``stats()["put_rejected"]``: transient pressure (the CPU tier and staging area hold
        only entries nobody may evict), or an entry larger than every tier could ever hold (also ``put_too_large``; see
        :attr:`StorageBackend.max_entry_bytes`). Caller mistakes raise before anything is stored: ``TypeError`` naming
        ``value`` for a non-tensor, a quantized, sparse, nested or meta tensor or a dtype records cannot carry,
        ``ValueError`` for more than 32 dimensions (:func:`check_storable_tensor`). A put that races :meth:`close`
        either raises :class:`ManagerClosedError` or returns True without reaching the lower tiers; it never leaves a
        pool block behind.
        """
        self._check_usable()
        return self._put.put(key, value, fmt)

    async def batched_put(
        self,
        keys: Sequence[CacheEngineKey],
        values: Sequence[torch.Tensor | MemoryObj],
        fmt: MemoryFormat = MemoryFormat.UNDEFINED,
    ) -> list[bool]:
        """:meth:`put` for each pair; one result per key. Every pair is validated first (errors name
        ``keys[i]``/``values[i]``), so a caller mistake stores nothing."""
        self._check_usable()
        check_put_batch(keys, values)
        with self._wt.deferred_wake():  # one wake-up of the write-through for the whole batch
            return self._put.put_batch(keys, values, fmt)

    def batched_writes(self) -> contextlib.AbstractContextManager[None]:
        """``with manager.batched_writes():`` the puts this thread makes inside the block wake the write-through to the
        lower tiers once, when the block ends (also on an exception), not at the end of each put: waking the loop hands
        its thread the GIL, and a caller with more Python to run (the rest of a vLLM worker's save) would wait for it
        back. Puts are readable at once as always; only the lower tiers' writes start later. Keep the block short and
        free of I/O: other threads' queued writes wait for its wake-up too. Nests."""
        return self._wt.deferred_wake()

    put_sync = sync_twin(put)
    batched_put_sync = sync_twin(batched_put)

    def holds_locally(self, key: CacheEngineKey) -> bool:
        """True when :meth:`put` of ``key`` would be the content-addressed no-op: the CPU tier holds it or its
        write-through is still queued. Lower tiers are not asked (their "present" is unverified until read; see
        :meth:`put`). Caller's thread, no hop; a racing eviction can make the answer stale, which only costs the put a
        copy. Raises like :meth:`put` after :meth:`close` or in a forked child."""
        self._check_usable()
        return self._front.holds(key)

    def local_prefix_len(self, keys: Sequence[CacheEngineKey]) -> int:
        """Length of the prefix of ``keys`` that :meth:`holds_locally` answers True for: the chunks a store may skip
        without losing anything. Caller's thread, no hop; lower tiers are not asked (a damaged lower-tier record must
        not make a store skip its chunk)."""
        self._check_usable()
        return self._front.held_prefix(keys)

    def memory_prefix_len(self, keys: Sequence[CacheEngineKey]) -> int:
        """Length of the prefix of ``keys`` that :meth:`read_into_sync` fills with memory copies on the caller's
        thread: held by the CPU tier, the queued write-through, or a local tier that reads into caller memory (the node
        cache server's shared pool: one round trip, bounded by ``remote_timeout_s``; trouble answers 0 for it). Tiers
        that read a device or the network (disk, remote, NIXL) are not counted: the KV connector loads those hits
        asynchronously. Caller's thread; an answer may be stale by a racing eviction (the read then misses, which the
        caller handles)."""
        self._check_keys(keys)
        return prefix_here(keys, self._cpu, self._pending, self._where.memory_readers)[0]

    def lookup_local(self, key: CacheEngineKey) -> MemoryObj | None:
        """The entry of ``key`` from a tier answering on the caller's thread (the CPU tier first, then each other
        :class:`LocalTier` in order), with one reference the caller owns; None when none of them holds it, and after
        :meth:`close` (a miss). Never hops to the loop, never waits for I/O beyond a local tier's own bound; does not
        count a hit or miss."""
        return None if self._life.closed else self._front.lookup(key, self._local)

    async def flush(self, timeout: float | None = None) -> None:  # noqa: ASYNC109 - the sync twin's bound
        """Wait until every write-through queued so far has reached (or failed on) every tier, and each tier's own
        buffered writes are durable. ``timeout`` bounds the wait (default ``blocking_timeout_secs``; ``TimeoutError``
        then, the writes go on)."""
        self._check_usable()
        if self._lower:
            await self._hop(self._work.flush(), timeout=timeout)

    flush_sync = sync_twin(flush)

    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        """The entry (the caller owns one reference) or None, falling through the tiers.

        A lower-tier hit is promoted into the CPU tier when it has room.
        """
        self._check_keys((key,))
        obj = self._front.entry(key, self._local)  # the CPU tier, queued writes, the local tiers
        if obj is not None or not self._loop_readers:
            return obj
        return await self._get_below(key)

    async def _get_below(self, key: CacheEngineKey) -> MemoryObj | None:
        """The lower tiers' answer for a key the front missed (one hop)."""
        return await self._hop(self._tiers.get(key), release_obj)

    async def batched_get(self, keys: Sequence[CacheEngineKey]) -> list[MemoryObj | None]:
        """One result per key (each falling through the tiers independently; one hop for all misses)."""
        for k in keys:  # check every key before taking any reference
            if type(k) is not CacheEngineKey:
                raise _not_a_key(k)
        self._check_usable()
        out, missing = self._front.entries(keys, self._local)  # one batch per local tier
        if missing and self._loop_readers:
            try:
                got = await self._hop(self._tiers.batched_get([keys[i] for i in missing]), release_objs)
            except BaseException:
                release_objs(out)
                raise
            for i, obj in zip(missing, got, strict=True):
                out[i] = obj
        return out

    def _get_hit(self, key: CacheEngineKey) -> MemoryObj | CannotTell | Coroutine[Any, Any, MemoryObj | None] | None:
        """``get_sync``'s front, asked once: the entry (the caller's reference), None for a miss with no loop-side tier
        to ask, or the rest of the read (a coroutine for the bridge); UNKNOWN for a call :meth:`get` refuses (so its
        errors stay :meth:`get`'s)."""
        if type(key) is CacheEngineKey and not self._life.closed and self._lt.usable_from_here():
            cpu = self._cpu
            if cpu is not None:  # the hot path, inline: a CPU hit builds nothing
                obj = cpu.lookup(key)
                if obj is not None:
                    self._front.hits += 1
                    return obj
            obj = self._front.below_cpu(key, self._local)
            if obj is not None or not self._loop_readers:
                return obj
            return self._get_below(key)
        return UNKNOWN

    get_sync = sync_twin(get, _get_hit)
    batched_get_sync = sync_twin(batched_get)

    def read_into_sync(
        self, keys: Sequence[CacheEngineKey], sinks: Sequence[ReadSink], *, prefix: bool = False
    ) -> list[bool]:
        """Read each entry straight into caller-owned memory: ``sinks[i]`` receives ``keys[i]``'s payload. One flag per
        key, True when that sink now holds the entry; a miss, a stored entry of another shape or dtype, damage or a
        timeout is False (counted in ``stats()["read_into"]``), and that sink's bytes are then not to be used (a failed
        read may have written part of them). ``prefix``: stop at the first key not filled.

        Blocking, on the calling thread (not the manager's loop thread: :class:`LoopThreadCallError`): a CPU-tier hit
        is copied with one ``memmove`` per piece, the node server's tier copies out of its shared pool straight into
        the pieces (one round trip per batch, bounded by ``remote_timeout_s``), the disk tier reads the file straight
        into the pieces, other lower tiers are read through one bounded hop and copied here. Every write into the sinks
        is done when this returns, so there is no coroutine form (see :mod:`lmcache_async._manager.read_into`).
        Lower-tier hits are not promoted by a direct read; hits of the loop-side tiers are, as for :meth:`get`.
        ``ValueError``/``TypeError`` name ``keys``/``sinks`` for caller mistakes."""
        self._check_usable()
        if self._lt.in_loop_thread():
            raise LoopThreadCallError("read_into_sync was called on the manager's loop thread")
        return self._read_into.run(keys, sinks, prefix)

    def _contains_front(self, key: CacheEngineKey) -> bool | None:
        """True/False when answered on this thread, None when a lower tier must be asked."""
        self._check_keys((key,))
        return contains_here(key, self._cpu, self._pending, self._lower)

    async def contains(self, key: CacheEngineKey) -> bool:
        """True when some tier holds ``key`` (a tier that fails to answer counts as absent); a CPU hit answers in about
        a microsecond, on the caller's thread."""
        r = self._contains_front(key)
        if r is not None:
            return r
        return await self._hop(self._tiers.presence(key)) is Presence.PRESENT

    async def presence(self, key: CacheEngineKey) -> Presence:
        """Tri-state presence: UNKNOWN when a tier that might hold it failed or was skipped, or the lower tiers did not
        answer within ``blocking_timeout_secs``."""
        r = self._contains_front(key)
        if r is not None:
            return Presence.PRESENT if r else Presence.ABSENT
        try:
            return await self._hop(self._tiers.presence(key))
        except TimeoutError:
            return Presence.UNKNOWN

    def contains_sync(self, key: CacheEngineKey) -> bool:
        """Blocking twin of :meth:`contains` (same result and errors, run by the bridge); a CPU hit, or an answer every
        tier gives on this thread, builds no coroutine."""
        if type(key) is CacheEngineKey and not self._life.closed and self._lt.usable_from_here():
            cpu = self._cpu
            r = True if cpu is not None and key in cpu else contains_here(key, cpu, self._pending, self._lower)
            if r is not None:
                return r
        return self.bridge.run(self.contains(key))

    presence_sync = sync_twin(presence)

    async def prefix_len(self, keys: Sequence[CacheEngineKey]) -> int:
        """Length of the prefix of ``keys`` present in some tier (CPU-only: no hop, ~0.1 µs per key)."""
        self._check_keys(keys)
        n, need_loop = prefix_here(keys, self._cpu, self._pending, self._lower)
        if not need_loop:
            return n
        return n + await self._hop(self._work.prefix_len(list(keys[n:])))

    prefix_len_sync = sync_twin(prefix_len)

    batched_contains = renamed("StorageManager", prefix_len, "batched_contains")
    batched_contains_sync = renamed("StorageManager", prefix_len_sync, "batched_contains_sync")

    def touch(self, keys: Sequence[CacheEngineKey]) -> None:
        """Mark ``keys`` recently used in every local tier (LRU). Caller's thread, no hop."""
        self._front.touch(keys, self._local)

    MEMORY_TIER = MEMORY_TIER
    """The name :meth:`locate` gives an entry held in this process's memory (the CPU tier or
    the queued write-through)."""

    def tier_status(self) -> dict[str, tuple[bool, bool]]:
        """Per tier name, in search order: ``(reads_memory, available)``. ``reads_memory``: a read is a memory copy on
        the caller's thread (the CPU tier, the node server's shared pool); ``available``: the tier's circuit breaker is
        closed (an open or half-open breaker means it failed or timed out lately). Any thread, no I/O."""
        return self._where.tier_status()

    def tier_holds(self, tier: str, key: CacheEngineKey) -> bool | CannotTell:
        """Whether tier ``tier`` (a name of :attr:`tier_names`) holds ``key``, on the caller's thread with no hop:
        :data:`~lmcache_async.tiers.UNKNOWN` when that tier cannot tell here (it answers on the loop only, failed, or
        is not configured). A lower tier's True is unverified until read."""
        self._check_keys((key,))
        return self._where.holds_here(tier, key)

    def locate_here(self, keys: Sequence[CacheEngineKey]) -> tuple[list[str | None], bool]:
        """:meth:`locate` as far as the caller's thread can answer it, with no hop: (the tier per key, or None; whether
        the loop must be asked, i.e. some key's answer is unknown here). Local tiers are asked (the node server: one
        round trip, bounded by its timeout)."""
        self._check_keys(keys)
        names, unresolved, _ = self._where.locate_front(keys)
        return names, bool(unresolved)

    async def locate(self, keys: Sequence[CacheEngineKey]) -> list[str | None]:
        """Which tier holds each key: the name of the first tier in search order that has it (:attr:`MEMORY_TIER` for
        this process's memory), None where no tier does or none could answer (a tier that fails counts as not holding
        it). One hop for every key the caller's thread cannot answer; none when it can. ``TypeError`` naming ``key``
        for a non-key."""
        self._check_keys(keys)
        names, unresolved, flags = self._where.locate_front(keys)
        if not unresolved:
            return names
        return await self._hop(self._where.locate_lower(list(keys), names, unresolved, flags))

    locate_sync = sync_twin(locate)

    async def locate_memory(self, keys: Sequence[CacheEngineKey]) -> list[tuple[str, bool] | None]:
        """:meth:`locate` with, per held key, whether its read is a memory copy: ``(tier, in_memory)`` or None. For the
        node server's tier, a tier declaring :class:`~lmcache_async.tiers.Locator` says per entry whether it is in its
        pool."""
        names = await self.locate(keys)
        flags = self._where.in_memory(keys, names)
        return [None if n is None else (n, bool(f)) for n, f in zip(names, flags, strict=True)]

    locate_memory_sync = sync_twin(locate_memory)

    async def probe_read(self, tier: str, nbytes: int) -> float | None:
        """Seconds one read of an ``nbytes`` entry from lower tier ``tier`` took: an entry under a key of its own
        (model ``lmcache-async-probe``) is written to that tier only, read back (timed) and removed. None when the tier
        is not a lower tier, or failed, timed out or refused the write. Every call runs under the tier's timeout and
        breaker; the whole probe is bounded like every call (``blocking_timeout_secs``). ``ValueError`` naming
        ``nbytes`` unless it is > 0."""
        guard = self._where.probe_target(tier, nbytes)
        self._check_usable()
        return None if guard is None else await self._hop(self._where.probe(guard, nbytes))

    probe_read_sync = sync_twin(probe_read)

    async def remove(self, key: CacheEngineKey) -> bool:
        """Delete ``key`` from every tier; True when some tier held it. Readers holding a reference keep valid data
        until they release it."""
        self._check_keys((key,))
        removed = self._cpu.remove_nowait(key) if self._cpu is not None else False
        if self._lower:
            removed = await self._hop(self._work.remove(key)) or removed
        return removed

    async def clear(self) -> None:
        """Remove every entry from every tier (pending writes are flushed first); bounded by ``blocking_timeout_secs``
        like every call (``TimeoutError``)."""
        self._check_usable()
        if self._cpu is not None:
            self._cpu.clear_nowait()
        if self._lower:
            await self._hop(self._work.clear())

    remove_sync = sync_twin(remove)
    clear_sync = sync_twin(clear)

    def stats(self) -> dict[str, Any]:
        """Per tier: entries, bytes, hits, misses, evictions, errors (plus timeouts, skipped, writes, circuit state);
        the pool and staging usage; pending writes. Any thread (the metrics exporter's included); figures may trail the
        loop by a few calls."""
        return manager_stats(self.name, self._front, self._lower, self._put, self._read_into)

    def leases(self, ttl_s: float, tier: str | None = None) -> PromiseLeases | None:
        """Leases keeping promised entries readable by other processes for up to ``ttl_s`` seconds, on tier ``tier``
        (None: a persistent tier's when one declares :class:`~lmcache_async.tiers.Leasing`, else the first declaring
        tier's); None when no such tier is configured. ``ValueError`` unless ``ttl_s`` > 0."""
        return leases_of(self._lower, ttl_s, tier)

    def sole_batch_reader(self) -> BatchLookup | None:
        """The :class:`~lmcache_async.tiers.BatchLookup` of the manager's only tier when there is no CPU tier (a read
        then asks just that tier, on the caller's thread), else None."""
        return sole_batch_reader(self._front.cpu_backend, self._lower)

    def describer(self) -> Describer | None:
        """The first lower tier's :class:`~lmcache_async.tiers.Describer` (the node server's, which records the engine
        blocks of each entry for its KV-event publisher), else None."""
        return describer_of(self._lower)

    @property
    def direct_put(self) -> DirectPut | None:
        """The tier puts are written into on the caller's thread (no CPU tier, the first lower tier declaring
        :class:`~lmcache_async.tiers.DirectPut`), else None."""
        return self._put.direct

    def backend(self, name: str) -> StorageBackend | None:
        """The backend of tier ``name`` (None when not configured). For tests and tools; code that serves requests uses
        the manager's own calls (:meth:`lookup_local`, ...)."""
        return backend_named(self._front.cpu_backend, self._lower, name)

    def _let_go(self) -> None:
        """Once closed, drop this object's own references to the tiers and pools (the parts drop theirs on release), so
        their memory goes while this object lives on."""
        if self._life.closed:
            self._cpu, self._local, self._lower, self.pool, self.staging_pool = None, (), (), None, None

    def __repr__(self) -> str:
        return f"StorageManager(name={self.name!r}, tiers={self.tier_names}, closed={self.closed})"


def _not_a_key(key: object) -> TypeError:
    return TypeError(f"key must be a CacheEngineKey, got {type(key).__name__}")
