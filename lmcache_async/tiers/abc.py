"""The tier contract: :class:`StorageBackend` and every optional capability a tier may declare.

This module is the whole contract a storage tier implements; the conformance kit
(:mod:`lmcache_async.testing.conformance`) checks an implementation against it, and the registry
(:mod:`lmcache_async.tiers.registry`) builds tiers by name.

A tier's coroutines run on the owning manager's loop thread. Every tier honours:

* ``put(key, obj)`` stores a copy of ``obj``'s payload (or takes its own reference to it); it
  never keeps the caller's reference. A put of a key already present is a no-op returning True
  (entries are content-addressed). False means "not stored" (no space, tier disabled, error).
* ``get(key)`` returns a :class:`MemoryObj` the caller owns (one reference) or None. Lower tiers
  read into memory from the ``alloc`` callable they are given (the manager's staging area
  by default) so a full CPU tier never blocks them.
* ``contains`` is True only for an entry a following ``get`` can return (barring eviction).
* ``remove`` returns True when an entry was removed, False when absent.
* ``clear()`` removes every entry this tier owns (a tier whose ``supports_delete`` is False is
  never asked). Readers holding a reference keep valid bytes until they release it.
* Storage trouble is a miss/False plus a counter; a tier may also raise, in which case the
  manager counts the error, treats the answer as :data:`UNKNOWN` and feeds the tier's circuit
  breaker.
* A tier's identity is its registry name: :attr:`StorageBackend.name` equals the name it was
  registered (and listed in ``tier_order``) under; ``stats()`` and metrics label it so.

Threads: the coroutines, ``start``, ``flush``, ``clear`` and ``close`` run on the manager's loop
thread. ``contains_nowait`` runs on caller threads and ``stats()`` on any thread; both must be
cheap, take only the tier's own short locks and never wait for I/O. :attr:`max_entry_bytes`,
the properties and the ``as_*`` declarations are read on any thread too.

**Capabilities are declared.** Each optional capability is one protocol below with one
signature, and a tier offers it by returning the object that implements it from the matching
``as_*`` method of :class:`StorageBackend` (usually ``self``); the default, None, means "not
offered". Nothing in the project detects a capability by method name. A wrapper around a tier
(the fault injector, an encrypting shim) forwards the declarations it keeps.

=====================  ======================  ===================================================
declaration            protocol                what it offers
=====================  ======================  ===================================================
``as_pool()``          :class:`PoolTier`       indexes blocks of the manager's CPU pool (the front)
``as_local()``         :class:`LocalTier`      reads answered on the caller's thread
``as_batch_lookup()``  :class:`BatchLookup`    a batch read into caller-supplied buffers
``as_direct_reader()`` :class:`DirectReader`   reads straight into caller memory, caller thread
``as_direct_put()``    :class:`DirectPut`      puts stored on the caller's thread, one copy
``as_leasing()``       :class:`Leasing`        keeps promised entries readable by other processes
``as_locator()``       :class:`Locator`        says, per key, whether it sits in memory
=====================  ======================  ===================================================

**Removals.** A tier that evicts, deletes or finds damaged entries on its own reports them
through :attr:`BackendContext.on_removed` (:meth:`StorageBackend.report_removed`), with a
:class:`RemovalReason`; the manager fans the reports out to its removal listeners.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Literal, Protocol, TypeAlias, runtime_checkable

import torch

from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import MemoryFormat, MemoryObj, PoolAllocator

if TYPE_CHECKING:
    from lmcache_async.config import LMCacheEngineConfig
    from lmcache_async.metadata import LMCacheEngineMetadata
    from lmcache_async.read_sinks import ReadSink

__all__ = [
    "CAPABILITIES",
    "UNKNOWN",
    "Allocate",
    "BackendContext",
    "BatchLookup",
    "CannotTell",
    "Describer",
    "DirectPut",
    "DirectReader",
    "Leasing",
    "LocalTier",
    "Locator",
    "PoolTier",
    "Presence",
    "PromiseLeases",
    "RemovalListener",
    "RemovalReason",
    "StorageBackend",
]


class Presence(enum.Enum):
    """Tri-state presence as the manager reports it. ``Presence.UNKNOWN`` is :data:`UNKNOWN`, the
    one "cannot tell" answer everywhere."""

    PRESENT = "present"
    ABSENT = "absent"
    UNKNOWN = "unknown"

    def __bool__(self) -> bool:
        """True for PRESENT only: "cannot tell" is never "held" (nor "absent": see :data:`UNKNOWN`)."""
        return self is Presence.PRESENT


UNKNOWN: Final = Presence.UNKNOWN
"""The one "cannot tell" answer: a tier that failed, timed out or was skipped, a caller-thread
answer the tier cannot give (:meth:`StorageBackend.contains_nowait`), or a caller-thread path that
must hand over to the loop. It is never "absent": callers treat it as a miss for reads and must
not delete or overwrite anything on its account. The same object as ``Presence.UNKNOWN``."""

CannotTell: TypeAlias = Literal[Presence.UNKNOWN]
"""The type of :data:`UNKNOWN` (type checkers narrow on ``x is UNKNOWN``)."""


class RemovalReason(enum.Enum):
    """Why a tier dropped an entry it held (what KV events publish as a removal)."""

    EVICTED = "evicted"  #: pushed out to make room (policy, budget)
    DELETED = "deleted"  #: removed by a caller (``remove``/``clear``) or its owner
    DAMAGED = "damaged"  #: found unreadable (checksum, truncated record) and dropped


RemovalListener = Callable[[str, Sequence[CacheEngineKey], RemovalReason], None]
"""``(tier name, keys, reason)``: called on whichever thread removed the entries (a caller
thread under the tier's lock, or the loop); it must be quick, must not call back into the tier
and must not raise (an exception is swallowed by :meth:`StorageBackend.report_removed`)."""


class Allocate(Protocol):
    """Allocates a buffer for a read: returns a MemoryObj the caller owns, or None."""

    def __call__(self, shape: Sequence[int], dtype: torch.dtype, fmt: MemoryFormat) -> MemoryObj | None: ...


@dataclass
class BackendContext:
    """Everything a tier factory may need. Built by the StorageManager.

    ``staging`` allocates read buffers outside the cache budget; ``pool`` is the manager's CPU
    pool (None without a CPU tier); ``staging_pool`` the preallocated staging area — both can be
    registered with transfer engines once. ``settings`` is the tier's validated settings model
    (its ``tiers.<name>`` section, see :mod:`lmcache_async.tiers.registry`), None for a tier
    without one; ``extra`` the raw ``tiers.<name>`` mapping. ``on_removed`` receives the
    tier's removal reports (see :meth:`StorageBackend.report_removed`).
    """

    config: LMCacheEngineConfig
    metadata: LMCacheEngineMetadata
    cache_name: str
    loop: asyncio.AbstractEventLoop
    executor: concurrent.futures.ThreadPoolExecutor
    staging: Allocate
    staging_pool: PoolAllocator | None
    pool: PoolAllocator | None
    on_evict: Callable[[CacheEngineKey], None] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    settings: Any = None
    on_removed: RemovalListener | None = None


class StorageBackend(ABC):
    """One storage tier. Coroutines run on the manager's loop; see the module docstring."""

    #: Registry name of this backend ("cpu", "disk", "remote", "nixl", ...).
    name: str = "backend"

    # ---- capabilities (properties, not methods) ------------------------------------------
    @property
    def persistent(self) -> bool:
        """Entries survive a restart of the process."""
        return False

    @property
    def shared(self) -> bool:
        """Entries are visible to other processes/machines using the same location."""
        return False

    @property
    def supports_delete(self) -> bool:
        """``remove`` and ``clear`` actually delete."""
        return True

    @property
    def is_remote(self) -> bool:
        """Operations cross a network or a transfer engine (they run under ``remote_timeout_s``)."""
        return False

    @property
    def max_entry_bytes(self) -> int | None:
        """The largest record, header included, this tier could ever hold; None: no limit known.

        "Ever" means with the tier empty: a put of a record this size may still fail right now
        (no room, errors), but a larger one can never succeed, so the manager refuses an entry
        larger than every tier's limit at once instead of carrying it in a one-off buffer.
        Tiers without a record header (the CPU tier) answer the largest payload they can hold.
        Cheap and answered on any thread (no I/O); it may change only when the tier's budget
        does. The default, None, never refuses anything.
        """
        return None

    # ---- lifecycle hooks (optional) ------------------------------------------------------------
    async def start(self) -> None:
        """Connect, open files, spawn background tasks: called once on the loop thread before
        the manager serves any call, bounded by the tier's timeout. A failure is counted and
        logged, and the tier stays in the order (its circuit breaker decides when to retry),
        so a backend that needs ``start`` must also cope with calls after a failed one (answer
        misses, or connect lazily). The default does nothing."""

    async def flush(self) -> None:
        """Wait until writes this tier accepted (``put`` returned True) are durable in its
        medium, for tiers that buffer them. Loop thread; the default does nothing."""

    # ---- core ----------------------------------------------------------------------------
    @abstractmethod
    async def put(self, key: CacheEngineKey, obj: MemoryObj) -> bool:
        """Store ``obj``'s payload under ``key``; True when stored or already present."""

    @abstractmethod
    async def get(self, key: CacheEngineKey, alloc: Allocate | None = None) -> MemoryObj | None:
        """The entry (caller owns one reference) or None. Reads into ``alloc`` buffers."""

    @abstractmethod
    async def contains(self, key: CacheEngineKey) -> bool:
        """True when ``get`` would find the entry."""

    @abstractmethod
    async def remove(self, key: CacheEngineKey) -> bool:
        """Delete the entry; True when something was removed."""

    # ---- batched, with defaults ------------------------------------------------------------
    async def batched_put(self, items: Sequence[tuple[CacheEngineKey, MemoryObj]]) -> list[bool]:
        """``put`` for each item (concurrently by default)."""
        return list(await asyncio.gather(*(self.put(k, o) for k, o in items)))

    async def batched_get(
        self, keys: Sequence[CacheEngineKey], alloc: Allocate | None = None
    ) -> list[MemoryObj | None]:
        """``get`` for each key; one result per key.

        If one ``get`` raises, the buffers the others filled are released and the error is
        raised; if this call is cancelled, results of gets that still finish are released."""
        tasks = [asyncio.ensure_future(self.get(k, alloc)) for k in keys]
        try:
            results = await asyncio.gather(*tasks, return_exceptions=True)
        except BaseException:
            for t in tasks:
                t.add_done_callback(_release_task_result)
            raise
        error = next((r for r in results if isinstance(r, BaseException)), None)
        if error is not None:
            for r in results:
                if isinstance(r, MemoryObj):
                    r.ref_count_down()
            raise error
        return [r if isinstance(r, MemoryObj) else None for r in results]

    async def batched_contains(self, keys: Sequence[CacheEngineKey]) -> list[bool]:
        """Presence of each key (one flag per key, not a prefix length)."""
        return list(await asyncio.gather(*(self.contains(k) for k in keys)))

    async def clear(self) -> None:
        """Remove every entry this backend owns; afterwards ``contains`` is False for each of
        them. Readers holding a reference keep valid bytes. Only called when
        :attr:`supports_delete` is True. The default does nothing (a tier that cannot delete)."""

    async def close(self) -> None:
        """Release resources; the backend is not used afterwards. Called once, on the loop
        thread, bounded; it must not wait for a peer that may be gone. Default: nothing."""

    # ---- declared capabilities (None: not offered) ------------------------------------------
    def as_pool(self) -> PoolTier | None:
        """This tier as the index of the manager's CPU pool (the write front), or None."""
        return None

    def as_local(self) -> LocalTier | None:
        """This tier's caller-thread reading side, or None (it answers on the loop only)."""
        return None

    def as_batch_lookup(self) -> BatchLookup | None:
        """This tier's caller-thread batch read into caller-supplied buffers, or None."""
        return None

    def as_direct_reader(self) -> DirectReader | None:
        """This tier's caller-thread read straight into caller memory, or None."""
        return None

    def as_direct_put(self) -> DirectPut | None:
        """This tier's caller-thread put (one copy into its own storage), or None."""
        return None

    def as_leasing(self) -> Leasing | None:
        """This tier's leases (promised entries kept readable for other processes), or None."""
        return None

    def as_locator(self) -> Locator | None:
        """This tier's "is it in memory" answer per key, or None (the manager then prices its
        hits by :attr:`is_remote` and whether it is a :class:`LocalTier`)."""
        return None

    def as_describer(self) -> Describer | None:
        """This tier's record of which engine blocks each entry holds (what a KV-event publisher
        beside the tier announces), or None."""
        return None

    @property
    def reports_removals(self) -> bool:
        """True when this tier reports what it evicts, deletes or finds damaged through
        :meth:`report_removed` (a listener then sees every removal it makes on its own)."""
        return False

    @property
    def evicted_elsewhere(self) -> bool:
        """True when another process owns this tier's storage and evicts from it on its own
        (the node cache server's pool): those evictions are that process's to publish (``serve
        --events``), and this tier's reports cover only the removals made through it."""
        return False

    def bind_removals(self, listener: RemovalListener | None) -> None:
        """Where :meth:`report_removed` sends reports (the manager binds
        :attr:`BackendContext.on_removed`; a wrapper forwards its own). Any thread."""
        self._removal_listener = listener

    def report_removed(self, keys: Sequence[CacheEngineKey], reason: RemovalReason) -> None:
        """Tell the bound listener that ``keys`` left this tier for ``reason``; no-op without
        one or for no keys. Never raises (a listener's error is dropped)."""
        listener: RemovalListener | None = getattr(self, "_removal_listener", None)
        if listener is None or not keys:
            return
        try:
            listener(self.name, list(keys), reason)
        except Exception:  # pragma: no cover - a listener must not break a tier
            pass

    # ---- optional synchronous fast path ------------------------------------------------------
    def contains_nowait(self, key: CacheEngineKey) -> bool | CannotTell:
        """Answer ``contains`` on a caller thread (any thread but the loop's, concurrently with
        the loop's coroutines) without waiting for I/O, or :data:`UNKNOWN` when it cannot tell
        (the manager then asks :meth:`contains` on the loop). A True must be as good as
        ``contains``'s. (A tier written for the first release of this contract may still answer
        None; the manager reads it as :data:`UNKNOWN` until the next release.)"""
        return UNKNOWN

    def stats(self) -> dict[str, Any]:
        """Backend-specific figures (``entries``, ``bytes``, ``evictions``, ...), numbers only.
        Any thread (the metrics exporter calls it); cheap, no I/O; may trail the loop slightly."""
        return {}


@runtime_checkable
class LocalTier(Protocol):
    """The reading side of a tier that answers on the caller's thread (no loop hop).

    Every method may be called from any thread except the manager's loop thread, concurrently
    with each other and with the tier's coroutines; each is bounded (a short lock, or a blocking
    socket with its own timeout) and never raises for storage trouble: trouble is a miss, counted
    in the tier's ``stats()``. Answers are final for the manager: a miss here is not asked again
    on the loop (the lower tiers below are).

    The manager consults every tier declaring this protocol (:meth:`StorageBackend.as_local`),
    in tier order, before it hops to the loop for the tiers that do not.
    """

    #: The registry name (the tier's identity).
    name: str

    def lookup(self, key: CacheEngineKey) -> MemoryObj | None:
        """The entry with one reference that the caller now owns (release it with
        ``ref_count_down()``), touching it for the tier's policy; None: not held here (or the
        tier could not tell). The buffer stays valid while the reference is held."""
        ...

    def lookup_many(self, keys: Sequence[CacheEngineKey], alloc: Allocate | None = None) -> list[MemoryObj | None]:
        """:meth:`lookup` of each key, one answer per key (a tier behind a socket answers the
        batch in one round trip); the caller owns one reference of each entry returned. A tier
        that copies out of its medium reads into ``alloc`` buffers when given (else its own
        staging); a tier whose entries already are memory (the CPU tier) ignores it."""
        ...

    def contains_nowait(self, key: CacheEngineKey) -> bool | CannotTell:
        """Presence without touching the entry; :data:`UNKNOWN`: cannot tell on this thread."""
        ...

    def prefix_len(self, keys: Sequence[CacheEngineKey]) -> int:
        """How many leading ``keys`` this tier holds (0 when it cannot tell)."""
        ...

    def present_flags(self, keys: Sequence[CacheEngineKey]) -> list[bool]:
        """Presence of each key, one flag per key (False when it cannot tell)."""
        ...

    def touch(self, keys: Sequence[CacheEngineKey]) -> None:
        """Mark the ``keys`` it holds as recently used (no-op for other policies)."""
        ...


@runtime_checkable
class DirectReader(Protocol):
    """A lower tier that reads entries straight into caller-owned host memory on the caller's
    thread: the local disk tier (a file read into the caller's pieces) and the node cache
    server's client (a copy out of the node's shared pool, one round trip per batch).

    :meth:`StorageManager.read_into_sync
    <lmcache_async.storage_manager.StorageManager.read_into_sync>` calls it on the calling
    thread (never the loop's); the call blocks for the reads and is not cancellable, which is
    why only tiers whose reads are local and bounded (by a file read, or by the tier's own
    timeout) implement it. A tier that is also a :class:`LocalTier` reads memory, not a device:
    the KV connector loads its hits synchronously, like the CPU tier's
    (:meth:`StorageManager.memory_prefix_len
    <lmcache_async.storage_manager.StorageManager.memory_prefix_len>`).
    """

    #: The registry name (the tier's identity).
    name: str

    def read_into_many(self, keys: Sequence[CacheEngineKey], sinks: Sequence[ReadSink], prefix: bool) -> list[bool]:
        """Fill ``sinks[i]`` with ``keys[i]``'s verified payload; one flag per key, True for a
        hit. False for a miss, an entry of another shape or dtype, damage or trouble (counted
        in ``stats()``); that sink may then be partly written and its bytes are not to be used.
        ``prefix``: stop at the first key not filled (every later flag False, nothing later
        read). Never raises for storage trouble; thread-safe; every write into a sink is over
        when it returns."""
        ...


@runtime_checkable
class PoolTier(LocalTier, Protocol):
    """A :class:`LocalTier` indexing blocks of the manager's CPU pool: the write front.

    Puts land here first (the manager copies into a block from :meth:`allocate`, then
    :meth:`insert` indexes it); the index holds one reference per entry and never evicts an entry
    somebody else holds a reference to. Same thread rules as :class:`LocalTier`.
    """

    #: The pool this tier's entries live in (the manager's CPU pool).
    pool: PoolAllocator

    def __contains__(self, key: object) -> bool:
        """Presence in the index, lock-free (one dict lookup); may be stale by one racing
        eviction or insert, like any answer without a lock."""
        ...

    def allocate(
        self,
        shape: Sequence[int],
        dtype: torch.dtype,
        fmt: MemoryFormat = MemoryFormat.UNDEFINED,
        *,
        evict: bool = True,
        protect: frozenset[CacheEngineKey] | set[CacheEngineKey] | None = None,
    ) -> MemoryObj | None:
        """A pool block with one reference the caller owns, evicting (when ``evict``) entries
        nobody holds, never those in ``protect``; None at once when it cannot fit. Never waits."""
        ...

    def insert(self, key: CacheEngineKey, obj: MemoryObj, extra_refs: int = 0) -> MemoryObj | None:
        """Index ``obj`` (a block of :attr:`pool`): the caller's reference becomes the index's
        and ``extra_refs`` more are taken atomically. None: inserted. An entry: ``key`` was
        present (nothing changed, the caller keeps its reference; the returned entry carries no
        reference for the caller). Raises :class:`~lmcache_async.errors.ManagerClosedError`
        after :meth:`close_nowait` (the caller keeps its reference)."""
        ...

    def remove_nowait(self, key: CacheEngineKey) -> bool:
        """Drop the entry (readers keep theirs); True when it was present."""
        ...

    def clear_nowait(self) -> None:
        """Drop every entry (readers keep theirs)."""
        ...

    def close_nowait(self) -> None:
        """Drop every entry and refuse inserts from now on. Idempotent."""
        ...

    def can_ever_hold(self, nbytes: int) -> bool:
        """True when an entry of ``nbytes`` payload bytes fits into the empty pool."""
        ...


def _release_task_result(task: asyncio.Future[Any]) -> None:
    if not task.cancelled() and task.exception() is None and isinstance(task.result(), MemoryObj):
        task.result().ref_count_down()


@runtime_checkable
class BatchLookup(Protocol):
    """A tier that reads a batch of entries on the caller's thread into buffers the caller
    supplies (the node server's client tier): one copy out of the tier. Never raises for storage
    trouble and never runs on the manager's loop."""

    name: str

    @property
    def call_timeout_s(self) -> float:
        """The longest one caller-thread call takes (waiting for the tier's connection included)."""
        ...

    def lookup_many(self, keys: Sequence[CacheEngineKey], alloc: Allocate | None = None) -> list[MemoryObj | None]:
        """One entry per key (a buffer from ``alloc`` with one reference the caller owns) or
        None per miss or trouble."""
        ...


@runtime_checkable
class DirectPut(Protocol):
    """A tier that stores a put on the caller's thread, copying the payload once, from the
    caller's buffer straight into the tier's own storage (no staging block, no loop hop).

    :meth:`put_direct` runs on caller threads (never the manager's loop thread), concurrently
    with itself and with the tier's coroutines; it is bounded by the tier's own timeout and
    never raises for storage trouble.
    """

    name: str

    def put_direct(
        self, items: Sequence[tuple[CacheEngineKey, torch.Tensor | MemoryObj]], fmt: MemoryFormat
    ) -> list[bool] | None:
        """Store each value (borrowed: read during the call, never kept) under its key with its
        own shape and dtype, and the format ``fmt`` for a tensor (a MemoryObj carries its own).
        One flag per item: True when stored or already held, readable by every client now; False
        when refused (no room). None: the tier could not be asked (down, slow, circuit open)."""
        ...


class PromiseLeases(Protocol):
    """Leases keeping promised entries readable by workers in other processes until they load.

    ``take`` returns a lease string (None: the entry cannot be leased, so it must not be
    promised); ``read`` raises ``OSError`` (or a ``RecordError``) when the leased bytes cannot be
    read; ``drop`` and ``reap`` never raise for storage trouble; ``owns`` does no I/O.
    """

    def take(self, key: CacheEngineKey) -> str | None: ...

    def drop(self, lease: str) -> bool: ...

    def owns(self, lease: str) -> bool: ...

    def read(self, lease: str, key: CacheEngineKey) -> torch.Tensor: ...

    def reap(self) -> int: ...


@runtime_checkable
class Leasing(Protocol):
    """A tier that can keep entries readable past their eviction or deletion for a while (the
    disk tier hard-links records, the node server's tier holds pool blocks)."""

    name: str

    def leases(self, ttl_s: float) -> PromiseLeases:
        """Leases on this tier that live at most ``ttl_s`` seconds unless dropped first.
        ``ValueError`` unless ``ttl_s`` > 0. Blocking calls; caller threads."""
        ...


@runtime_checkable
class Locator(Protocol):
    """A tier that tells, per key, whether it holds the entry in memory or only in a slower
    medium behind it (the node server: its shared pool, or only its own lower tiers)."""

    name: str

    def locate_many(self, keys: Sequence[CacheEngineKey]) -> list[bool | None] | CannotTell:
        """Per key: True (held, in memory), False (held, not in memory), None (not held);
        :data:`UNKNOWN` when the tier could not be asked. Caller threads, bounded."""
        ...


@runtime_checkable
class Describer(Protocol):
    """A tier that keeps, beside each entry, a description of the engine blocks it holds, for a
    publisher of KV events that runs with the tier (the node server's ``--events``)."""

    name: str

    def describe(self, keys: Sequence[CacheEngineKey], chunks: Sequence[Any]) -> list[bool] | None:
        """Record ``chunks[i]`` (an :class:`~lmcache_async.events.chunks.Chunk`) for committed
        entry ``keys[i]``: one flag per key (False: not held, nothing recorded), None when the
        tier could not be asked. Caller threads, bounded (one round trip)."""
        ...


CAPABILITIES: Final[dict[str, tuple[str, type]]] = {
    "pool": ("as_pool", PoolTier),
    "local": ("as_local", LocalTier),
    "batch_lookup": ("as_batch_lookup", BatchLookup),
    "direct_reader": ("as_direct_reader", DirectReader),
    "direct_put": ("as_direct_put", DirectPut),
    "leasing": ("as_leasing", Leasing),
    "locator": ("as_locator", Locator),
    "describer": ("as_describer", Describer),
}
"""Capability name → (the declaring method of :class:`StorageBackend`, the protocol its answer
implements). The conformance kit checks each declared answer against its protocol."""
