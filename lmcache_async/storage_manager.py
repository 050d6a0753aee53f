"""The async StorageManager: one CPU tier on the caller's thread, lower tiers on a loop thread.

Paths (see ``docs/architecture.md``):

* **local path** — ``put``/``get``/``contains``/``batched_contains`` first try the CPU tier on
  the caller's thread under its lock; a hit or a put that fits returns without touching the loop.
* **loop path** — write-through to lower tiers is queued and the loop is woken once per batch
  (:mod:`lmcache_async.write_through`); a local miss makes one hop for the whole batch of keys
  (:mod:`lmcache_async.lower_tiers`); every lower-tier call runs under a timeout and its tier's
  circuit breaker (:mod:`lmcache_async.tier_guard`).

Ownership: ``get`` hands the caller one reference to a :class:`MemoryObj` (release it with
``ref_count_down()`` or a ``with`` block); ``put`` borrows a MemoryObj it is given.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Literal, TypeVar

import torch

from lmcache_async import at_exit
from lmcache_async.backend import (
    BackendContext,
    Presence,
    StorageBackend,
    get_backend_factory,
    is_configured,
)
from lmcache_async.config import LMCacheEngineConfig
from lmcache_async.errors import LoopThreadCallError, ManagerClosedError
from lmcache_async.keys import CacheEngineKey
from lmcache_async.loop import LoopThread
from lmcache_async.lower_tiers import LowerTiers, release_objs
from lmcache_async.memory import (
    HeapAllocator,
    MemoryFormat,
    MemoryObj,
    PoolAllocator,
    gib_to_bytes,
)
from lmcache_async.metadata import NEUTRAL_METADATA, LMCacheEngineMetadata
from lmcache_async.ratelog import RateLimitedLog
from lmcache_async.staging import StagingArea, default_reserve_bytes
from lmcache_async.tensor_checks import check_storable_layout, check_storable_tensor
from lmcache_async.tier_guard import LOG_BURST_S, NO_ANSWER, NoAnswer, TierGuard
from lmcache_async.write_through import WriteThrough

logger = logging.getLogger(__name__)

T = TypeVar("T")

_CLOSE_FLUSH_S = 10.0


class StorageManager:
    """Tiered async storage for cache entries; see the module docstring.

    Coroutines can be awaited from any event loop; ``*_sync`` twins serve threads without one.
    Misuse raises a named ``RuntimeError`` subclass at once: a ``*_sync`` call on the manager's
    loop thread (:class:`LoopThreadCallError`), any call after :meth:`close`
    (:class:`ManagerClosedError`), any call in a forked child (:class:`ForkedProcessError`).
    ``*_sync`` calls that need the loop raise ``TimeoutError`` after ``blocking_timeout_secs``
    (the coroutine is cancelled). Storage trouble never raises: it is a miss/False plus a counter.

    ``cpu_size_gib``/``cpu_size_key`` let an engine size the CPU pool from another key (the
    hidden-state store uses ``max_hidden_state_cpu_size``); ``name`` names the loop thread
    (``lmcache-async-<name>``).
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
        if not isinstance(config, LMCacheEngineConfig):
            raise TypeError(f"config must be an LMCacheEngineConfig, got {type(config).__name__}")
        if metadata is not None and not isinstance(metadata, LMCacheEngineMetadata):
            raise TypeError(f"metadata must be an LMCacheEngineMetadata, got {type(metadata).__name__}")
        self.config = config
        self.metadata = metadata if metadata is not None else NEUTRAL_METADATA
        self.name = name
        self._closed = False
        self._close_lock = threading.Lock()
        self._timeout = float(config.blocking_timeout_secs)
        reserve = None if config.memory_reserve_size is None else gib_to_bytes(config.memory_reserve_size)
        # One-off buffers (entries larger than the staging area) must leave this much free too.
        one_off_reserve = reserve if reserve is not None else default_reserve_bytes()

        size_gib = config.max_local_cpu_size if cpu_size_gib is None else cpu_size_gib
        self.pool: PoolAllocator | None = None
        if config.local_cpu and size_gib > 0:
            self.pool = PoolAllocator(
                gib_to_bytes(size_gib), name=f"{name} CPU pool ({cpu_size_key})", reserve_bytes=reserve
            )
        wants_lower = lower_tiers and bool(
            config.local_disk
            or config.remote_url
            or config.nixl_path
            or any(t not in ("cpu", "nixl", "disk", "remote") for t in config.tier_order)
        )
        self.staging_pool: PoolAllocator | None = None
        if (wants_lower or self.pool is None) and config.staging_size > 0:
            self.staging_pool = PoolAllocator(
                gib_to_bytes(config.staging_size), name=f"{name} staging (staging_size)", reserve_bytes=reserve
            )
        self._heap = HeapAllocator(f"{name}-heap")
        self._staging = StagingArea(self.staging_pool, self._heap, one_off_reserve)

        self._lt = LoopThread(name)
        self._loop = self._lt.loop
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=config.executor_workers, thread_name_prefix=f"lmcache-async-{name}-io"
        )
        self.put_rejected = 0
        self.put_too_large = 0
        self._refuse_log = RateLimitedLog(logger, LOG_BURST_S)

        self._cpu: Any = None
        self._tiers = LowerTiers(self._read_alloc, self._promote, log=logger)
        self._lower = self._tiers.guards  # filled by _build_tiers, in search order
        self._wt = WriteThrough(self._lt, self._lower)
        # The same dict as the queue's: the caller-thread paths read it without a hop or lock.
        self._pending = self._wt.pending
        try:
            self._build_tiers(lower_tiers)
            self._lt.run_sync(self._tiers.start(), timeout=max(self._timeout, 30.0))
        except BaseException:
            self._abort_init()
            raise
        at_exit.close_at_exit(self)
        self._metrics_server: Any = None
        if config.metrics_port is not None:
            from lmcache_async.metrics import start_metrics_server

            self._metrics_server = start_metrics_server(config.metrics_port, self, config.metrics_host)

    # ---- construction -------------------------------------------------------------------------
    def _build_tiers(self, lower_tiers: bool) -> None:
        ctx = BackendContext(
            config=self.config,
            metadata=self.metadata,
            cache_name=self.name,
            loop=self._loop,
            executor=self._executor,
            staging=self._staging.allocate,
            staging_pool=self.staging_pool,
            pool=self.pool,
        )
        order = list(self.config.tier_order)
        if "cpu" in order:  # the CPU tier always answers first, on the caller's thread
            order.remove("cpu")
            order.insert(0, "cpu")
        for tier_name in order:
            if tier_name != "cpu" and not lower_tiers:
                continue
            if tier_name == "cpu" and self.pool is None:
                continue
            if not is_configured(tier_name, self.config):
                continue
            backend = get_backend_factory(tier_name)(ctx)
            if backend is None:
                continue
            if tier_name == "cpu":
                self._cpu = backend
            else:
                # Local lower tiers get half the sync bound so a stuck tier yields a miss,
                # not a TimeoutError in the caller; remote/NIXL tiers use remote_timeout_s.
                timeout = self.config.remote_timeout_s if backend.is_remote else self._timeout / 2
                self._lower.append(TierGuard(backend, timeout, self.config.remote_breaker_max_backoff_s, log=logger))

    def _abort_init(self) -> None:
        self._closed = True
        if self._lower and not self._lt.closed:
            try:
                self._lt.run_sync(self._tiers.close(), timeout=30.0)
            except Exception:
                logger.warning("StorageManager %r: tiers did not close after a failed start", self.name)
        self._lt.stop()
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ---- allocation helpers ---------------------------------------------------------------------
    def _read_alloc(self, shape: Sequence[int], dtype: torch.dtype, fmt: MemoryFormat) -> MemoryObj | None:
        """Where a lower-tier read lands: the CPU pool when it has room (no second copy for
        promotion), else the staging area, else a one-off buffer."""
        if self._cpu is not None:
            obj: MemoryObj | None = self._cpu.allocate(shape, dtype, fmt)
            if obj is not None:
                return obj
        return self._staging.allocate(shape, dtype, fmt)

    def allocate(
        self, shape: Sequence[int], dtype: torch.dtype, fmt: MemoryFormat = MemoryFormat.UNDEFINED
    ) -> MemoryObj | None:
        """A CPU-pool block the caller owns (one reference), evicting entries nobody holds when
        needed; None at once when it cannot fit (or there is no CPU tier).

        Fill it and pass it to :meth:`put` (which borrows it: no second copy); keep the
        reference while the entry must not be evicted, then release it. Any thread.
        """
        self._check_usable()
        if self._cpu is None:
            return None
        obj: MemoryObj | None = self._cpu.allocate(shape, dtype, fmt)
        return obj

    # ---- checks --------------------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._closed:
            raise ManagerClosedError(f"StorageManager {self.name!r} is closed")
        self._lt.check_usable()

    def _check_sync(self) -> None:
        self._check_usable()
        if self._lt.in_loop_thread():
            raise LoopThreadCallError(
                f"a *_sync call was made on the loop thread of StorageManager {self.name!r}; "
                "await the coroutine instead"
            )

    @staticmethod
    def _check_key(key: object) -> CacheEngineKey:
        if type(key) is not CacheEngineKey:
            raise TypeError(f"key must be a CacheEngineKey, got {type(key).__name__}")
        return key

    @property
    def closed(self) -> bool:
        """True once :meth:`close` started."""
        return self._closed

    @property
    def one_off_refused(self) -> int:
        """One-off buffers refused because they would eat into the memory reserve."""
        return self._staging.one_off_refused

    @property
    def has_lower_tiers(self) -> bool:
        """True when a tier below the CPU tier is configured."""
        return bool(self._lower)

    @property
    def tier_names(self) -> list[str]:
        """Names of the tiers in search order."""
        return (["cpu"] if self._cpu is not None else []) + [t.name for t in self._lower]

    @property
    def loop_thread(self) -> LoopThread:
        """The manager's loop thread (its ``loop`` runs every lower-tier coroutine)."""
        return self._lt

    # ---- bridges --------------------------------------------------------------------------------
    def _run_sync(
        self, coro: Coroutine[Any, Any, T], timeout: float | None, orphan: Callable[[T], None] | None = None
    ) -> T:
        return self._lt.run_sync(coro, timeout, orphan)

    async def _run_async(self, coro: Coroutine[Any, Any, T], orphan: Callable[[T], None] | None = None) -> T:
        return await self._lt.run_async(coro, orphan)

    # ---- put -----------------------------------------------------------------------------------
    def _put_front(
        self, key: CacheEngineKey, value: torch.Tensor | MemoryObj, fmt: MemoryFormat, checked: bool = False
    ) -> bool:
        """:meth:`put` on the caller's thread (``checked``: the value was validated already)."""
        self._check_usable()
        if type(key) is not CacheEngineKey:
            self._check_key(key)
        src_obj: MemoryObj | None = None
        if isinstance(value, torch.Tensor):
            if not checked:
                check_storable_tensor(value, "value")
            tensor = value
            shape = tuple(value.shape)
            dtype = value.dtype
        elif isinstance(value, MemoryObj):
            src_obj = value
            tensor = value.tensor
            shape, dtype, fmt = value.shape, value.dtype, value.fmt
            if not checked:
                check_storable_layout(dtype, len(shape), "value")
        else:
            raise TypeError(f"value must be a torch.Tensor or MemoryObj, got {type(value).__name__}")
        if not isinstance(fmt, MemoryFormat):
            raise TypeError(f"fmt must be a MemoryFormat, got {type(fmt).__name__}")
        cpu = self._cpu
        if cpu is not None:
            # Only what this manager holds itself makes a put the content-addressed no-op. A lower
            # tier's "present" is unverified (an index entry, a file's size) and may stand for a
            # damaged record: the CPU tier takes the entry and the write-through lets each lower
            # tier keep its record or replace a damaged one.
            if key in cpu._index or key in self._pending:
                return True
            if src_obj is not None and src_obj.allocator is self.pool:
                src_obj.ref_count_up()
                obj = src_obj
            else:
                got = cpu.allocate(shape, dtype, fmt)
                if got is None:
                    # CPU full of entries nobody may evict (readers, pending write-through):
                    # carry this one to the lower tiers through the staging area instead.
                    return self._stage_write(key, tensor, shape, dtype, fmt)
                obj = got
                try:
                    obj.tensor.copy_(tensor)
                except BaseException:
                    obj.ref_count_down()
                    raise
            lower = bool(self._lower)
            try:
                existing = cpu.insert(key, obj, extra_refs=1 if lower else 0)
            except ManagerClosedError:  # closed since _check_usable
                obj.ref_count_down()
                raise
            if existing is not None:
                obj.ref_count_down()
                return True
            if lower and not self._wt.enqueue(key, obj, None):
                obj.ref_count_down()  # the queue closed meanwhile: its reference goes back
            return True
        if key in self._pending:  # a lower tier's unverified "present" does not count (see above)
            return True
        return self._stage_write(key, tensor, shape, dtype, fmt)

    def holds_locally(self, key: CacheEngineKey) -> bool:
        """True when :meth:`put` of ``key`` would be the content-addressed no-op: the CPU tier
        holds it or its write-through is still queued. Lower tiers are not asked (their
        "present" is unverified until read; see :meth:`put`). Caller's thread, no hop; a racing
        eviction can make the answer stale, which only costs the put a copy. Raises like
        :meth:`put` after :meth:`close` or in a forked child."""
        if self._closed or self._lt._forked:
            self._check_usable()
        cpu = self._cpu
        return (cpu is not None and key in cpu._index) or key in self._pending

    def local_prefix_len(self, keys: Sequence[CacheEngineKey]) -> int:
        """Length of the prefix of ``keys`` that :meth:`holds_locally` answers True for: the
        chunks a store may skip without losing anything. Caller's thread, no hop; lower tiers
        are not asked (a damaged lower-tier record must not make a store skip its chunk)."""
        self._check_usable()
        cpu = self._cpu
        n = cpu.prefix_len(keys) if cpu is not None else 0
        pending = self._pending
        while n < len(keys) and (keys[n] in pending or (cpu is not None and keys[n] in cpu._index)):
            n += 1
        return n

    def _refuse_too_large(self, key: CacheEngineKey, nbytes: int) -> bool:
        """Count (and log, once per burst) a put no tier could ever hold; returns False."""
        self.put_rejected += 1
        self.put_too_large += 1
        self._refuse_log.warning(
            "StorageManager %r: refused an entry of %d bytes (%s): larger than any tier can hold",
            self.name,
            nbytes,
            key.to_string()[:200],
        )
        return False

    def _stage_write(
        self, key: CacheEngineKey, tensor: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, fmt: MemoryFormat
    ) -> bool:
        """Write-through without a CPU-tier copy: a staging block (a one-off buffer for an entry
        larger than the whole staging area) carries the bytes until the lower tiers have them;
        the pending map serves reads meanwhile.

        False (counted in ``put_rejected``) when there is no lower tier, when no lower tier could
        ever hold the record (also counted in ``put_too_large`` when the CPU tier could not
        either), when the staging area is full right now, or when a one-off buffer is not
        allowed. One-off buffers are bounded: at most one at a time beyond the staging size
        (reads aside), never larger than the largest record a lower tier accepts
        (:attr:`~StorageBackend.max_entry_bytes`), and never eating into the memory reserve
        (``memory_reserve_size``; ``one_off_refused`` counts those refusals)."""
        n = dtype.itemsize
        for d in shape:
            n *= d
        if not self._lower:
            cpu = self._cpu
            if cpu is not None and not cpu.can_ever_hold(n):
                return self._refuse_too_large(key, n)
            self.put_rejected += 1
            return False
        if not self._tiers.could_hold(key, len(shape), n):
            cpu = self._cpu
            if cpu is None or not cpu.can_ever_hold(n):
                return self._refuse_too_large(key, n)
            self.put_rejected += 1  # the CPU tier could, but is full of held entries right now
            return False
        staged = self._staging.allocate_write(shape, dtype, fmt, n)
        if staged is None:
            self.put_rejected += 1
            return False
        try:
            staged.tensor.copy_(tensor)
        except BaseException:
            staged.ref_count_down()
            raise
        if not self._wt.enqueue(key, staged, None, only_if_new=True):
            staged.ref_count_down()
        return True

    async def put(
        self, key: CacheEngineKey, value: torch.Tensor | MemoryObj, fmt: MemoryFormat = MemoryFormat.UNDEFINED
    ) -> bool:
        """Store ``value`` under ``key``; False only when no tier could take it right now.

        A tensor is copied into the pool (its own shape and dtype kept); a MemoryObj is borrowed
        (the caller keeps its reference). A key the CPU tier holds, or whose write-through is
        queued, is a no-op returning True; a key only a lower tier claims to hold is stored
        again (that tier's record is unverified until read: it keeps it when intact). True
        means readable now (CPU tier or queued write-through) and, after :meth:`flush`, in every
        lower tier that accepted the write. Lower tiers are written in the background.

        False at once, counted in ``stats()["put_rejected"]``: transient pressure (the CPU tier
        and staging area hold only entries nobody may evict), or an entry larger than every tier
        could ever hold (also ``put_too_large``; see :attr:`StorageBackend.max_entry_bytes`).
        Caller mistakes raise before anything is stored: ``TypeError`` naming ``value`` for a
        non-tensor, a quantized, sparse, nested or meta tensor or a dtype records cannot carry,
        ``ValueError`` for more than 32 dimensions (:func:`check_storable_tensor`). A put that
        races :meth:`close` either raises :class:`ManagerClosedError` or returns True without
        reaching the lower tiers; it never leaves a pool block behind.
        """
        return self._put_front(key, value, fmt)

    def put_sync(
        self, key: CacheEngineKey, value: torch.Tensor | MemoryObj, fmt: MemoryFormat = MemoryFormat.UNDEFINED
    ) -> bool:
        """Blocking twin of :meth:`put` (it never waits for lower tiers)."""
        if self._lt.in_loop_thread():
            self._check_sync()
        return self._put_front(key, value, fmt)

    async def batched_put(
        self,
        keys: Sequence[CacheEngineKey],
        values: Sequence[torch.Tensor | MemoryObj],
        fmt: MemoryFormat = MemoryFormat.UNDEFINED,
    ) -> list[bool]:
        """:meth:`put` for each pair; one result per key. Every pair is validated first (errors
        name ``keys[i]``/``values[i]``), so a caller mistake stores nothing."""
        return self.batched_put_sync_inner(keys, values, fmt)

    def batched_put_sync(
        self,
        keys: Sequence[CacheEngineKey],
        values: Sequence[torch.Tensor | MemoryObj],
        fmt: MemoryFormat = MemoryFormat.UNDEFINED,
    ) -> list[bool]:
        """Blocking twin of :meth:`batched_put`."""
        if self._lt.in_loop_thread():
            self._check_sync()
        return self.batched_put_sync_inner(keys, values, fmt)

    def batched_put_sync_inner(
        self,
        keys: Sequence[CacheEngineKey],
        values: Sequence[torch.Tensor | MemoryObj],
        fmt: MemoryFormat,
    ) -> list[bool]:
        if len(keys) != len(values):
            raise ValueError(f"keys and values differ in length ({len(keys)} != {len(values)})")
        # Every pair is checked before anything is stored: a caller mistake stores nothing.
        for i, (k, v) in enumerate(zip(keys, values, strict=True)):
            if type(k) is not CacheEngineKey:
                raise TypeError(f"keys[{i}] must be a CacheEngineKey, got {type(k).__name__}")
            if isinstance(v, torch.Tensor):
                check_storable_tensor(v, f"values[{i}]")
            elif isinstance(v, MemoryObj):
                check_storable_layout(v.dtype, len(v.shape), f"values[{i}]")
            else:
                raise TypeError(f"values[{i}] must be a torch.Tensor or MemoryObj, got {type(v).__name__}")
        return [self._put_front(k, v, fmt, checked=True) for k, v in zip(keys, values, strict=True)]

    # ---- write-through ----------------------------------------------------------------------------
    async def flush(self) -> None:
        """Wait until every write-through queued so far has reached (or failed on) every tier."""
        self._check_usable()
        if not self._lower:
            return
        await self._run_async(self._wt.flush())

    def flush_sync(self, timeout: float | None = None) -> None:
        """Blocking twin of :meth:`flush`; every tier call inside is already bounded by its
        timeout, ``timeout`` bounds the whole wait (``TimeoutError``)."""
        self._check_sync()
        if not self._lower:
            return
        self._run_sync(self._wt.flush(), timeout)

    # ---- get -----------------------------------------------------------------------------------
    def _get_front(self, key: CacheEngineKey) -> MemoryObj | Literal[NoAnswer.NO_ANSWER] | None:
        """The CPU tier's (or the queued write-through's) answer with the caller's reference, None
        for a miss with no lower tier to ask, :data:`NO_ANSWER` when the lower tiers must be asked."""
        self._check_usable()
        if type(key) is not CacheEngineKey:
            self._check_key(key)
        cpu = self._cpu
        if cpu is not None:
            obj = cpu.lookup(key)
            if obj is not None:
                self._cpu_hits += 1
                return obj
        pend = self._pending.get(key)
        if pend is not None and pend.try_ref_count_up():
            return pend
        self._cpu_misses += 1
        if not self._lower:
            return None
        return NO_ANSWER

    _cpu_hits = 0
    _cpu_misses = 0

    def _promote(self, key: CacheEngineKey, obj: MemoryObj, tier_idx: int) -> MemoryObj:
        """Index a lower-tier hit in the CPU tier when it landed in the pool; write it back to
        the lower tiers above the one that had it. Returns the caller's reference."""
        cpu = self._cpu
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
            if not self._wt.enqueue(key, obj, tuple(range(tier_idx))):
                obj.ref_count_down()
        return obj

    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        """The entry (the caller owns one reference) or None, falling through the tiers.

        A lower-tier hit is promoted into the CPU tier when it has room.
        """
        r = self._get_front(key)
        if r is not NO_ANSWER:
            return r
        return await self._run_async(self._tiers.get(key), _release_obj)

    def get_sync(self, key: CacheEngineKey) -> MemoryObj | None:
        """Blocking twin of :meth:`get` (``TimeoutError`` after ``blocking_timeout_secs``)."""
        self._check_sync()
        r = self._get_front(key)
        if r is not NO_ANSWER:
            return r
        return self._run_sync(self._tiers.get(key), self._timeout, _release_obj)

    def _batched_get_front(self, keys: Sequence[CacheEngineKey]) -> tuple[list[MemoryObj | None], list[int]]:
        for k in keys:  # check every key before taking any reference
            if type(k) is not CacheEngineKey:
                self._check_key(k)
        out: list[MemoryObj | None] = []
        missing: list[int] = []
        for i, k in enumerate(keys):
            r = self._get_front(k)
            if r is NO_ANSWER:
                out.append(None)
                missing.append(i)
            else:
                out.append(r)
        return out, missing

    async def batched_get(self, keys: Sequence[CacheEngineKey]) -> list[MemoryObj | None]:
        """One result per key (each falling through the tiers independently; one hop for all misses)."""
        out, missing = self._batched_get_front(keys)
        if missing:
            try:
                got = await self._run_async(self._tiers.batched_get([keys[i] for i in missing]), release_objs)
            except BaseException:
                release_objs(out)
                raise
            for i, obj in zip(missing, got, strict=True):
                out[i] = obj
        return out

    def batched_get_sync(self, keys: Sequence[CacheEngineKey]) -> list[MemoryObj | None]:
        """Blocking twin of :meth:`batched_get`."""
        self._check_sync()
        out, missing = self._batched_get_front(keys)
        if missing:
            try:
                got = self._run_sync(self._tiers.batched_get([keys[i] for i in missing]), self._timeout, release_objs)
            except BaseException:
                release_objs(out)
                raise
            for i, obj in zip(missing, got, strict=True):
                out[i] = obj
        return out

    # ---- contains -------------------------------------------------------------------------------
    def _contains_front(self, key: CacheEngineKey) -> bool | None:
        """True/False when answered on this thread, None when a lower tier must be asked."""
        self._check_usable()
        if type(key) is not CacheEngineKey:
            self._check_key(key)
        cpu = self._cpu
        if cpu is not None and key in cpu._index:
            return True
        if key in self._pending:
            return True
        need_loop = False
        for tier in self._lower:
            r = tier.backend.contains_nowait(key)
            if r is None:
                need_loop = True
            elif r:
                return True
        return None if need_loop else False

    async def contains(self, key: CacheEngineKey) -> bool:
        """True when some tier holds ``key`` (a tier that fails to answer counts as absent)."""
        r = self._contains_front(key)
        if r is not None:
            return r
        return await self._run_async(self._tiers.presence(key)) is Presence.PRESENT

    def contains_sync(self, key: CacheEngineKey) -> bool:
        """Blocking twin of :meth:`contains`; a CPU hit answers in about a microsecond."""
        cpu = self._cpu
        if cpu is not None and type(key) is CacheEngineKey and key in cpu._index:
            if self._closed or self._lt._forked or self._lt.in_loop_thread():
                self._check_sync()
            return True
        self._check_sync()
        r = self._contains_front(key)
        if r is not None:
            return r
        return self._run_sync(self._tiers.presence(key), self._timeout) is Presence.PRESENT

    async def presence(self, key: CacheEngineKey) -> Presence:
        """Tri-state presence: UNKNOWN when a tier that might hold it failed or was skipped."""
        r = self._contains_front(key)
        if r:
            return Presence.PRESENT
        if r is False:
            return Presence.ABSENT
        return await self._run_async(self._tiers.presence(key))

    def presence_sync(self, key: CacheEngineKey) -> Presence:
        """Blocking twin of :meth:`presence`."""
        self._check_sync()
        r = self._contains_front(key)
        if r:
            return Presence.PRESENT
        if r is False:
            return Presence.ABSENT
        try:
            return self._run_sync(self._tiers.presence(key), self._timeout)
        except TimeoutError:
            return Presence.UNKNOWN

    def _prefix_front(self, keys: Sequence[CacheEngineKey]) -> tuple[int, bool]:
        """(prefix present locally, whether lower tiers must be asked about the rest)."""
        self._check_usable()
        for k in keys:
            if type(k) is not CacheEngineKey:
                self._check_key(k)
        n = self._cpu.prefix_len(keys) if self._cpu is not None else 0
        pending = self._pending
        while n < len(keys) and keys[n] in pending:
            n += 1
        if n == len(keys) or not self._lower:
            return n, False
        need_loop = False
        cpu = self._cpu
        while n < len(keys):
            k = keys[n]
            # a later key may be local again (queued write-through, CPU) after a lower-tier hit
            found = k in pending or (cpu is not None and cpu.contains_nowait(k))
            for tier in () if found else self._lower:
                r = tier.backend.contains_nowait(k)
                if r is None:
                    need_loop = True
                elif r:
                    found = True
                    break
            if not found:
                break
            n += 1
        return n, need_loop and n < len(keys)

    async def _prefix_lower(self, keys: list[CacheEngineKey]) -> int:
        # Read-your-writes: a key whose write-through is still queued counts as present. Checked
        # before asking the tiers: a key released from the pending map meanwhile is in its tier.
        pending = self._pending
        cpu = self._cpu
        present = [k in pending or (cpu is not None and cpu.contains_nowait(k)) for k in keys]
        return await self._tiers.prefix_len(keys, present)

    async def batched_contains(self, keys: Sequence[CacheEngineKey]) -> int:
        """Length of the prefix of ``keys`` present in some tier."""
        n, need_loop = self._prefix_front(keys)
        if not need_loop:
            return n
        return n + await self._run_async(self._prefix_lower(list(keys[n:])))

    def batched_contains_sync(self, keys: Sequence[CacheEngineKey]) -> int:
        """Blocking twin of :meth:`batched_contains` (CPU-only: no hop, ~0.1 µs per key)."""
        self._check_sync()
        n, need_loop = self._prefix_front(keys)
        if not need_loop:
            return n
        return n + self._run_sync(self._prefix_lower(list(keys[n:])), self._timeout)

    def touch(self, keys: Sequence[CacheEngineKey]) -> None:
        """Mark ``keys`` recently used in the CPU tier (LRU)."""
        if self._cpu is not None:
            self._cpu.touch(keys)

    # ---- remove / clear ---------------------------------------------------------------------------
    async def _remove_lower(self, key: CacheEngineKey) -> bool:
        if key in self._pending:
            await self._wt.flush()
        return await self._tiers.remove(key)

    async def remove(self, key: CacheEngineKey) -> bool:
        """Delete ``key`` from every tier; True when some tier held it. Readers holding a
        reference keep valid data until they release it."""
        self._check_usable()
        self._check_key(key)
        removed = self._cpu.remove_nowait(key) if self._cpu is not None else False
        if self._lower:
            removed = await self._run_async(self._remove_lower(key)) or removed
        return removed

    def remove_sync(self, key: CacheEngineKey) -> bool:
        """Blocking twin of :meth:`remove`."""
        self._check_sync()
        self._check_key(key)
        removed = self._cpu.remove_nowait(key) if self._cpu is not None else False
        if self._lower:
            removed = self._run_sync(self._remove_lower(key), self._timeout) or removed
        return removed

    async def _clear_lower(self) -> None:
        await self._wt.flush()
        await self._tiers.clear()

    async def clear(self) -> None:
        """Remove every entry from every tier (pending writes are flushed first)."""
        self._check_usable()
        if self._cpu is not None:
            self._cpu.clear_nowait()
        if self._lower:
            await self._run_async(self._clear_lower())

    def clear_sync(self) -> None:
        """Blocking twin of :meth:`clear`."""
        self._check_sync()
        if self._cpu is not None:
            self._cpu.clear_nowait()
        if self._lower:
            self._run_sync(self._clear_lower(), None)

    # ---- close ------------------------------------------------------------------------------------
    async def _shutdown(self, flush_timeout: float) -> None:
        if not await self._wt.shutdown(flush_timeout):
            logger.warning(
                "StorageManager %r: pending writes did not finish in %.1fs; dropped", self.name, flush_timeout
            )
        await self._tiers.close()

    def _in_forked_child(self) -> bool:
        return self._lt._forked or os.getpid() != self._lt._pid

    def _begin_close(self) -> bool:
        if self._in_forked_child():
            # Locks and threads of the parent are not ours: mark closed and touch nothing.
            self._closed = True
            return False
        with self._close_lock:
            if self._closed:
                return False
            self._closed = True
        at_exit.forget(self)
        return True

    def _finish_close(self) -> None:
        self._lt.stop()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._wt.close()  # a shutdown that timed out, or writes queued after it
        if self._cpu is not None:
            self._cpu.close_nowait()
        if self._metrics_server is not None:
            self._metrics_server.close()
        if self.pool is not None and self.pool.used_bytes:
            logger.warning(
                "StorageManager %r closed while callers hold %d bytes of its pool; the pool is "
                "released once they drop their references",
                self.name,
                self.pool.used_bytes,
            )
        # Drop every reference to the pools and tiers: their memory goes as soon as callers
        # release what they still hold, even while this object lives on.
        self._cpu = None
        self._lower = []
        self._tiers.detach()
        self.pool = None
        self.staging_pool = self._staging.pool = None

    def close_sync(self, flush_timeout: float = _CLOSE_FLUSH_S) -> None:
        """Refuse new work, flush pending writes (bounded), close the tiers and stop the loop.

        Idempotent. Raises :class:`LoopThreadCallError` on the loop thread.
        """
        if self._closed:
            return
        if self._lt.in_loop_thread():
            raise LoopThreadCallError("close_sync() on the manager's loop thread; await close() instead")
        if not self._begin_close():
            return
        if not self._lt.closed:
            try:
                fut = self._lt.submit(self._shutdown(flush_timeout))
                fut.result(flush_timeout + 30.0)
            except Exception:
                logger.warning("StorageManager %r: shutdown did not complete", self.name, exc_info=True)
        self._finish_close()

    async def close(self, flush_timeout: float = _CLOSE_FLUSH_S) -> None:
        """Async twin of :meth:`close_sync`, awaitable from any loop (also the manager's own)."""
        if not self._begin_close():
            return
        if self._lt.in_loop_thread():
            await self._shutdown(flush_timeout)
            self._lt.loop.call_soon(self._finish_close)
            return
        if not self._lt.closed:
            try:
                fut = self._lt.submit(self._shutdown(flush_timeout))
                await asyncio.wrap_future(fut)
            except Exception:
                logger.warning("StorageManager %r: shutdown did not complete", self.name, exc_info=True)
        await asyncio.to_thread(self._finish_close)

    async def __aenter__(self) -> StorageManager:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __enter__(self) -> StorageManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close_sync()

    # ---- stats ------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Per tier: entries, bytes, hits, misses, evictions, errors (plus timeouts, skipped,
        writes, circuit state); the pool and staging usage; pending writes."""
        tiers: dict[str, dict[str, Any]] = {}
        if self._cpu is not None:
            cpu = self._cpu.stats()
            cpu.update(hits=self._cpu_hits, misses=self._cpu_misses, errors=0)
            tiers["cpu"] = cpu
        for t in self._lower:
            tiers[t.name] = t.stats()
        return {
            "name": self.name,
            "tiers": tiers,
            "pool": self.pool.stats() if self.pool is not None else None,
            "staging": self.staging_pool.stats() if self.staging_pool is not None else None,
            "pending_writes": len(self._pending),
            "put_rejected": self.put_rejected,
            "put_too_large": self.put_too_large,
            "one_off_refused": self._staging.one_off_refused,
        }

    def backend(self, name: str) -> StorageBackend | None:
        """The backend of tier ``name`` (None when not configured). For tests and tools."""
        if name == "cpu":
            return self._cpu
        for t in self._lower:
            if t.name == name:
                return t.backend
        return None

    def __repr__(self) -> str:
        return f"StorageManager(name={self.name!r}, tiers={self.tier_names}, closed={self._closed})"


def _release_obj(obj: MemoryObj | None) -> None:
    if obj is not None:
        obj.ref_count_down()
