"""The backend interface and the registry that builds backends by name.

A backend is one storage tier. Its coroutines run on the owning manager's loop thread.
Contract every backend honours (the conformance suite in :mod:`lmcache_async.testing` checks it):

* ``put(key, obj)`` stores a copy of ``obj``'s payload (or takes its own reference to it); it
  never keeps the caller's reference. A put of a key already present is a no-op returning True
  (entries are content-addressed). False means "not stored" (no space, tier disabled, error).
* ``get(key)`` returns a :class:`MemoryObj` the caller owns (one reference) or None. Lower tiers
  read into memory from the ``alloc`` callable they are given (the manager's staging area
  by default) so a full CPU tier never blocks them.
* ``contains`` is True only for an entry a following ``get`` can return (barring eviction).
* ``remove`` returns True when an entry was removed, False when absent.
* ``clear()`` removes every entry this tier owns (a tier whose ``supports_delete`` is False is
  never asked); entries other processes wrote to a shared location are theirs only when the tier
  says so in its docstring. Readers holding a reference keep valid bytes until they release it.
* Storage trouble is a miss/False plus a counter; backends may also raise, in which case the
  manager counts the error, treats the answer as "unknown" and feeds the tier's circuit breaker.
* A tier's identity is its registry name: :attr:`StorageBackend.name` equals the name it was
  registered (and listed in ``tier_order``) under; ``stats()`` and metrics label it so.

Threads: the coroutines, ``start``, ``flush``, ``clear`` and ``close`` run on the manager's loop
thread. ``contains_nowait`` runs on caller threads and ``stats()`` on any thread (the metrics
exporter's included); both must be cheap, take only the tier's own short locks and never wait
for I/O. :attr:`StorageBackend.max_entry_bytes` and the capability properties are read on any
thread too.

Two protocols declare the caller-thread surface the manager uses without a loop hop:

* :class:`LocalTier` — the reading side (``lookup``, ``contains_nowait``, ``prefix_len``,
  ``present_flags``, ``touch``) that any tier able to answer on the caller's thread implements:
  the CPU tier, or a client of a node-local cache server answering over a blocking socket.
* :class:`PoolTier` — a :class:`LocalTier` that also indexes blocks of the manager's CPU pool
  (``allocate``, ``insert``, ``remove_nowait``, ...): the write front every put lands in first.

A third, :class:`DirectReader` (``read_into_many``), lets a lower tier read entries straight into
caller-owned memory on the caller's thread: the disk tier (local file I/O) and the node cache
server's client (a copy out of the node's shared pool).

Registry: built-ins by dotted path (imported on first use), third parties through the
``lmcache_async.backends`` entry-point group or :func:`register_backend`. The core never imports
a concrete backend module directly.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import importlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from lmcache_async.errors import BackendUnavailableError
from lmcache_async.keys import CacheEngineKey
from lmcache_async.lazy_registry import LazyRegistry
from lmcache_async.memory import MemoryFormat, MemoryObj, PoolAllocator

if TYPE_CHECKING:
    from lmcache_async.config import LMCacheEngineConfig
    from lmcache_async.metadata import LMCacheEngineMetadata
    from lmcache_async.read_sinks import ReadSink

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "lmcache_async.backends"


class Presence(enum.Enum):
    """Tri-state presence used inside the manager: a tier that failed answers UNKNOWN."""

    PRESENT = "present"
    ABSENT = "absent"
    UNKNOWN = "unknown"


class Allocate(Protocol):
    """Allocates a buffer for a read: returns a MemoryObj the caller owns, or None."""

    def __call__(self, shape: Sequence[int], dtype: torch.dtype, fmt: MemoryFormat) -> MemoryObj | None: ...


@dataclass
class BackendContext:
    """Everything a backend factory may need. Built by the StorageManager.

    ``staging`` allocates read buffers outside the cache budget (never None for entries that
    fit in memory at all, except that registered-memory backends must use ``staging_pool``).
    ``pool`` is the manager's CPU pool (None without a CPU tier); ``staging_pool`` the
    preallocated staging area — both can be registered with transfer engines once.
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

    # ---- optional synchronous fast path ------------------------------------------------------
    def contains_nowait(self, key: CacheEngineKey) -> bool | None:
        """Answer ``contains`` on a caller thread (any thread but the loop's, concurrently with
        the loop's coroutines) without waiting for I/O, or None when it cannot tell (the manager
        then asks :meth:`contains` on the loop). A True must be as good as ``contains``'s."""
        return None

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

    The manager consults every tier implementing this protocol, in tier order, before it hops
    to the loop for the tiers that do not.
    """

    #: The registry name (the tier's identity).
    name: str

    def lookup(self, key: CacheEngineKey) -> MemoryObj | None:
        """The entry with one reference that the caller now owns (release it with
        ``ref_count_down()``), touching it for the tier's policy; None: not held here (or the
        tier could not tell). The buffer stays valid while the reference is held."""
        ...

    def lookup_many(self, keys: Sequence[CacheEngineKey]) -> list[MemoryObj | None]:
        """:meth:`lookup` of each key, one answer per key (a tier behind a socket answers the
        batch in one round trip); the caller owns one reference of each entry returned."""
        ...

    def contains_nowait(self, key: CacheEngineKey) -> bool | None:
        """Presence without touching the entry; None: cannot tell on this thread."""
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


BackendFactory = Callable[[BackendContext], "StorageBackend | None"]
"""Builds a backend from the context, or returns None when the config does not enable it."""

_BUILTINS: dict[str, str] = {
    "cpu": "lmcache_async.backends.cpu:create",
    "disk": "lmcache_async.backends.disk:create",
    "remote": "lmcache_async.backends.remote:create",
    "nixl": "lmcache_async.backends.nixl:create",
    "server": "lmcache_async.backends.server_tier:create",
}
# Built-ins are imported only when their configuration key is set (no redis/NIXL import otherwise).
BUILTIN_TIER_KEYS: dict[str, str] = {
    "cpu": "local_cpu",
    "disk": "local_disk",
    "remote": "remote_url",
    "nixl": "nixl_path",
    "server": "cache_server_socket",
}
"""The configuration key whose value turns each built-in tier on."""
# What each built-in tier says about its own configuration before it is built ("module:attr" of a
# ``(config) -> list[str]`` of errors), imported only when that tier is configured.
_BUILTIN_CONFIG_CHECKS: dict[str, str] = {
    "remote": "lmcache_async.backends.remote.checks:config_findings",
}
_registry: LazyRegistry[BackendFactory] = LazyRegistry(
    "backend",
    _BUILTINS,
    default_attr="create",
    entry_point_group=ENTRY_POINT_GROUP,
    unknown=lambda name, known: BackendUnavailableError(f"unknown backend {name!r}; known: {', '.join(known)}"),
    import_failed=lambda name, exc: BackendUnavailableError(f"backend {name!r} cannot be imported: {exc}"),
)


def register_backend(name: str, factory: BackendFactory | str, *, replace: bool = False) -> None:
    """Register a backend factory (or a ``"module:attr"`` path, imported on first use) under
    ``name``. ValueError for an empty or (unless ``replace``) taken name, TypeError for a
    factory that is neither callable nor a str."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty str, got {name!r}")
    if not (callable(factory) or isinstance(factory, str)):
        raise TypeError("factory must be callable or a 'module:attr' string")
    _registry.register(name, factory, replace=replace)


def known_backends() -> list[str]:
    """Names that can be used in ``tier_order`` (entry points of the
    ``lmcache_async.backends`` group included)."""
    return _registry.names()


def is_configured(name: str, config: LMCacheEngineConfig) -> bool:
    """False when ``name`` is a built-in whose configuration key is unset (skip importing it)."""
    key = BUILTIN_TIER_KEYS.get(name)
    return True if key is None else bool(getattr(config, key))


def tier_config_errors(name: str, config: LMCacheEngineConfig) -> list[str]:
    """The errors built-in tier ``name`` finds in ``config`` before it is built (``[]`` for a
    tier without such a check, or one that is not configured)."""
    where = _BUILTIN_CONFIG_CHECKS.get(name)
    if where is None or not is_configured(name, config):
        return []
    module, _, attr = where.partition(":")
    check: Callable[[LMCacheEngineConfig], list[str]] = getattr(importlib.import_module(module), attr)
    return list(check(config))


def get_backend_factory(name: str) -> BackendFactory:
    """The factory registered as ``name`` (importing it on first use).

    Raises :class:`BackendUnavailableError` for an unknown name (naming the known ones) and for
    a factory whose module does not import."""
    return _registry.get(name)
