"""``LMCacheHiCacheStorage``: a SGLang HiCache storage backend (L3) over our StorageManager.

SGLang builds it through its storage factory::

    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "lmcache_async",
        "module_path": "lmcache_async.integration.sglang", "class_name": "LMCacheHiCacheStorage",
        "interface_v1": 1, "local_disk": "/var/cache/sglang", "max_local_disk_size": 64}'

The factory calls ``LMCacheHiCacheStorage(storage_config, kwargs)``, then SGLang's cache
controller calls :meth:`register_mem_pool_host` with its host KV pool. With ``interface_v1``
SGLang moves pages zero-copy: :meth:`batch_set_v1` gathers each page straight from the host pool
into a block of our CPU pool (one copy; lower tiers are written in the background) and
:meth:`batch_get_v1` reads each record straight into its host-pool page through the manager's
one read path (:meth:`StorageManager.read_into_sync`, each page a
:meth:`~lmcache_async.integration.sglang.pool_layout.HostPoolPages.sink`: a CPU-tier hit is
one ``copy_`` into the page's strided view, a disk record is read from its file into the page
and checked there). The older tensor interface (:meth:`get`, :meth:`set`, :meth:`batch_get`, :meth:`batch_set`) moves
the same records through SGLang's flat page tensors, read the same way.

Threads: SGLang calls from its prefetch threads (``batch_exists``, ``batch_get_v1``) and its
backup thread (``batch_set_v1``), concurrently. Every call is bounded: CPU-tier work runs on the
calling thread; lower-tier work is one hop per batch to the manager's loop, bounded by
``blocking_timeout_secs`` (each remote/NIXL operation also by ``remote_timeout_s``).

Faults never raise into SGLang: a timeout, a tier that fails, a damaged or vanished record, a
closed manager, a pool that is not registered yet give ``False``/``None``/``0`` and a counter
(:meth:`stats`) plus a rate-limited log line. Wiring mistakes (``host_indices`` that do not name
whole pages of the pool, non-string keys) raise ``ValueError``/``TypeError``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from lmcache_async.errors import MisuseError
from lmcache_async.integration.sglang.pool_layout import HostPoolPages
from lmcache_async.integration.sglang.settings import NAMESPACE_KEY, PageNamespace, load_hicache_config
from lmcache_async.integration.sglang.shared_manager import ManagerLease, acquire_manager, release_manager
from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import MemoryFormat, MemoryObj
from lmcache_async.metadata import LMCacheEngineMetadata
from lmcache_async.ratelog import RateLimitedLog
from lmcache_async.read_sinks import ReadSink
from lmcache_async.storage_manager import StorageManager

logger = logging.getLogger(__name__)

__all__ = ["COUNTER_NAMES", "LMCacheHiCacheStorage"]

T = TypeVar("T")

COUNTER_NAMES = (
    "set_pages",
    "set_stored",
    "set_already_present",
    "set_rejected",
    "set_not_writer",
    "get_pages",
    "get_hits",
    "get_misses",
    "get_mismatched",
    "exists_calls",
    "timeouts",
    "errors",
    "closed_calls",
    "unregistered_calls",
)


class _Fault(Exception):
    """A storage fault already counted and logged (the call answers its miss value)."""


class LMCacheHiCacheStorage(HiCacheStorage):
    """SGLang ``HiCacheStorage`` over one process-wide :class:`StorageManager` per configuration.

    ``storage_config`` is SGLang's ``HiCacheStorageConfig``; its ``extra_config`` carries our
    configuration (see :mod:`lmcache_async.integration.sglang.settings`). ``kwargs`` is what the
    factory passes through (its ``mem_pool_host``, when present, is registered at once).
    Building the manager may raise (invalid configuration): SGLang then fails the attach.
    """

    def __init__(self, storage_config: Any, kwargs: Mapping[str, Any] | None = None) -> None:
        if storage_config is None or not hasattr(storage_config, "tp_rank"):
            raise TypeError(
                f"storage_config must be SGLang's HiCacheStorageConfig, got {type(storage_config).__name__}"
            )
        if kwargs is not None and not isinstance(kwargs, Mapping):
            raise TypeError(f"kwargs must be a mapping, got {type(kwargs).__name__}")
        extra = dict(storage_config.extra_config or {})
        namespace = extra.get(NAMESPACE_KEY)
        if namespace is not None and (not isinstance(namespace, str) or not namespace):
            raise ValueError(f"extra_config[{NAMESPACE_KEY!r}] must be a non-empty string, got {namespace!r}")
        self.storage_config = storage_config
        self.config = load_hicache_config(extra)
        self._namespace_override: str | None = namespace
        self.is_writer = bool(getattr(storage_config, "is_storage_writer", True))
        self._lock = threading.Lock()
        self._local = threading.local()
        self.counters: dict[str, int] = dict.fromkeys(COUNTER_NAMES, 0)
        self._log = RateLimitedLog(logger)
        self.pages: HostPoolPages | None = None
        self.namespace: PageNamespace | None = None
        self.mem_pool_host: Any = None
        model = namespace or getattr(storage_config, "model_name", None) or "sglang"
        metadata = LMCacheEngineMetadata(
            model_name=model,
            world_size=int(getattr(storage_config, "tp_size", 1) or 1),
            worker_id=int(getattr(storage_config, "tp_rank", 0) or 0),
        )
        self._lease: ManagerLease | None = acquire_manager(self.config, metadata)
        self.manager: StorageManager = self._lease.manager
        pool = (kwargs or {}).get("mem_pool_host")
        if pool is not None:
            self.register_mem_pool_host(pool)

    # ---- setup ------------------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Adopt SGLang's host KV pool: records get its page geometry, keys its namespace.

        ``ValueError``/``TypeError`` for a pool whose layout cannot be copied page by page (see
        :class:`HostPoolPages`); SGLang then fails the attach. SGLang keeps the pool.
        """
        pages = HostPoolPages(mem_pool_host)
        namespace = PageNamespace.from_storage_config(
            self.storage_config,
            record_order=pages.record_order,
            page_size=pages.page_size,
            dtype=pages.dtype,
            is_mla=pages.is_mla,
            namespace=self._namespace_override,
        )
        super().register_mem_pool_host(mem_pool_host)
        self.pages, self.namespace = pages, namespace

    # ---- bookkeeping ------------------------------------------------------------------------------
    def _add(self, **deltas: int) -> None:
        with self._lock:
            for name, n in deltas.items():
                self.counters[name] += n

    def _guard(self, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn``; a storage fault is counted, logged (rate-limited) and raised as _Fault."""
        try:
            return fn()
        except TimeoutError:
            self._add(timeouts=1)
            self._log.warning("SGLang backend: %s timed out (blocking_timeout_secs)", what, key=("timeout", what))
        except MisuseError as exc:  # closed, or used in a forked child: a miss, never an error in SGLang
            self._add(closed_calls=1)
            self._log.warning("SGLang backend: %s after close: %s", what, exc, key=("closed", what))
        except Exception as exc:
            self._add(errors=1)
            self._log.warning("SGLang backend: %s failed: %s: %s", what, type(exc).__name__, exc, key=("error", what))
        raise _Fault(what)

    def _ready(self, what: str) -> tuple[HostPoolPages, PageNamespace] | None:
        pages, namespace = self.pages, self.namespace
        if pages is None or namespace is None:
            self._add(unregistered_calls=1)
            self._log.warning("SGLang backend: %s before register_mem_pool_host", what, key=("unregistered", what))
            return None
        if self._lease is None or self.manager.closed:
            self._add(closed_calls=1)
            self._log.warning("SGLang backend: %s after close", what, key=("closed", what))
            return None
        return pages, namespace

    @staticmethod
    def _check_keys(keys: Any) -> list[str]:
        if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
            raise TypeError(f"keys must be a list of page hashes, got {type(keys).__name__}")
        return list(keys)

    # ---- presence ---------------------------------------------------------------------------------
    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many of ``keys``, from the first, are stored in some tier (a gap stops the count).

        0 on any storage fault (timeout, failing tier, closed) and before the pool is registered.
        """
        keys = self._check_keys(keys)
        ready = self._ready("batch_exists")
        self._add(exists_calls=1)
        if ready is None or not keys:
            return 0
        ckeys = [ready[1].key(k) for k in keys]
        try:
            return int(self._guard("batch_exists", lambda: self.manager.prefix_len_sync(ckeys)))
        except _Fault:
            return 0

    def exists(self, key: str) -> bool:
        """True when the page ``key`` is stored in some tier; False on any fault."""
        return self.batch_exists([key]) == 1

    # ---- zero-copy interface ----------------------------------------------------------------------
    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Store the pages ``host_indices`` names (``page_size`` slots per key, in key order)
        under ``keys``; one result per key. True: the page is readable now (lower tiers follow
        in the background). A key already held locally is not copied again (content-addressed).
        False for every key on a rank that is not the storage writer (MLA: rank 0 writes), on a
        fault, and for a page no tier can take right now (pressure; counted)."""
        keys = self._check_keys(keys)
        n = len(keys)
        ready = self._ready("batch_set_v1")
        if ready is None:
            return [False] * n
        pages, namespace = ready
        run = pages.pages_of(host_indices, n)
        if not self.is_writer:
            self._add(set_not_writer=n)
            return [False] * n
        ckeys = [namespace.key(k) for k in keys]
        self._add(set_pages=n)
        try:
            return self._guard("batch_set_v1", lambda: self._store(pages, ckeys, run.page_ids))
        except _Fault:
            return [False] * n

    def _store(self, pages: HostPoolPages, keys: list[CacheEngineKey], page_ids: list[int]) -> list[bool]:
        sm = self.manager
        results = [False] * len(keys)
        todo: list[int] = []
        direct: list[int] = []
        values: list[MemoryObj] = []
        try:
            # Blocks first, then one gather for all of them: blocks the pool hands out one after
            # another move in one index_select (see HostPoolPages.gather_many).
            for i, key in enumerate(keys):
                if sm.holds_locally(key):
                    results[i] = True
                    continue
                obj = sm.allocate(pages.record_shape, pages.dtype, MemoryFormat.UNDEFINED)
                if obj is None:
                    direct.append(i)
                    continue
                values.append(obj)
                todo.append(i)
            if todo:
                pages.gather_many([page_ids[i] for i in todo], [obj.tensor for obj in values])
                oks = sm.batched_put_sync([keys[i] for i in todo], values, MemoryFormat.UNDEFINED)
                for i, ok in zip(todo, oks, strict=True):
                    results[i] = bool(ok)
            # No CPU tier (or it holds only entries in use): gather into this thread's scratch
            # page, which put copies into the manager's staging area at once.
            for i in direct:
                scratch = self._scratch(pages)
                pages.gather(page_ids[i], scratch)
                results[i] = bool(sm.put_sync(keys[i], scratch, MemoryFormat.UNDEFINED))
        finally:
            for obj in values:
                obj.ref_count_down()
        tried = todo + direct
        stored = sum(1 for i in tried if results[i])
        self._add(
            set_stored=stored,
            set_already_present=len(keys) - len(tried),
            set_rejected=len(tried) - stored,
        )
        return results

    def _scratch(self, pages: HostPoolPages) -> torch.Tensor:
        """A record-shaped buffer of the calling thread, reused across calls (touched once)."""
        buf: torch.Tensor | None = getattr(self._local, "scratch", None)
        if buf is None or tuple(buf.shape) != pages.record_shape or buf.dtype != pages.dtype:
            buf = torch.empty(pages.record_shape, dtype=pages.dtype)
            self._local.scratch = buf
        return buf

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Load the records of ``keys`` into the pages ``host_indices`` names; one result per key.

        True: that page now holds the record's bytes. False: not stored, unreadable (damaged or
        vanished record, counted by its tier), of another geometry, or a fault (timeout, failing
        tier, closed); SGLang uses the leading run of True. A page whose key is False holds
        bytes not to be used (a record found damaged after it was read into the page may have
        written part of it). Every tier reads through the manager's one read path,
        :meth:`StorageManager.read_into_sync`, straight into the pages."""
        keys = self._check_keys(keys)
        n = len(keys)
        ready = self._ready("batch_get_v1")
        if ready is None:
            return [False] * n
        pages, namespace = ready
        run = pages.pages_of(host_indices, n)
        ckeys = [namespace.key(k) for k in keys]
        self._add(get_pages=n)
        return self._read(ckeys, [pages.sink(pid) for pid in run.page_ids], "batch_get_v1")

    def _read(self, keys: list[CacheEngineKey], sinks: list[ReadSink], what: str) -> list[bool]:
        """``read_into_sync`` of ``keys`` into ``sinks``, counted; all False on a fault."""
        try:
            flags = self._guard(what, lambda: self.manager.read_into_sync(keys, sinks))
        except _Fault:
            return [False] * len(keys)
        hits = sum(flags)
        self._add(get_hits=hits, get_misses=len(keys) - hits)
        return flags

    # ---- tensor interface (SGLang's generic page path) --------------------------------------------
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        """The page ``key`` as a flat tensor (SGLang's ``get_data_page(flat=True)`` order).

        With ``target_location`` (a tensor of the page's element count and dtype) the bytes are
        copied into it and it is returned; otherwise a new tensor the caller owns. None for a
        miss or any fault."""
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """:meth:`get` for each key (one batched read); ``target_locations`` is None or one
        tensor per key. ``ValueError`` for a target of the wrong size or dtype."""
        keys = self._check_keys(keys)
        n = len(keys)
        ready = self._ready("batch_get")
        if ready is None:
            return [None] * n
        pages, namespace = ready
        targets = self._targets(pages, target_locations, n)
        ckeys = [namespace.key(k) for k in keys]
        self._add(get_pages=n)
        flat = pages.record_bytes // pages.paged.element_size()
        dsts = [torch.empty(flat, dtype=pages.dtype) if t is None else t for t in targets]
        sinks = [ReadSink(pages.record_shape, pages.dtype, ((t.data_ptr(), pages.record_bytes),)) for t in dsts]
        flags = self._read(ckeys, sinks, "batch_get")
        return [t if ok else None for t, ok in zip(dsts, flags, strict=True)]

    @staticmethod
    def _targets(pages: HostPoolPages, target_locations: Any, n: int) -> list[torch.Tensor | None]:
        if target_locations is None:
            return [None] * n
        targets = list(target_locations)
        if len(targets) != n:
            raise ValueError(f"target_locations has {len(targets)} entries for {n} keys")
        numel = pages.record_bytes // pages.paged.element_size()
        for i, t in enumerate(targets):
            if t is None:
                continue
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"target_locations[{i}] must be a tensor, got {type(t).__name__}")
            if t.numel() != numel or t.dtype != pages.dtype or not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError(
                    f"target_locations[{i}] is {tuple(t.shape)} {t.dtype} on {t.device}; "
                    f"a page is {numel} contiguous {pages.dtype} in host memory"
                )
        return targets

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Store ``value`` (a page as SGLang's ``get_data_page`` returns it, flat or shaped)
        under ``key``; False on a fault or pressure. ``ValueError`` for a value that is not one
        page of the registered pool."""
        return self.batch_set([key], [value])

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        """:meth:`set` for each pair; True only when every page was stored."""
        keys = self._check_keys(keys)
        n = len(keys)
        ready = self._ready("batch_set")
        if ready is None:
            return False
        pages, namespace = ready
        vals = list(values) if values is not None else []
        if len(vals) != n:
            raise ValueError(f"values has {len(vals)} entries for {n} keys")
        records: list[torch.Tensor] = []
        for i, v in enumerate(vals):
            if not isinstance(v, torch.Tensor):
                raise TypeError(f"values[{i}] must be a tensor, got {type(v).__name__}")
            if v.numel() * v.element_size() != pages.record_bytes or v.dtype != pages.dtype:
                raise ValueError(f"values[{i}] is {tuple(v.shape)} {v.dtype}; not one page of the host pool")
            records.append(v.reshape(pages.record_shape))
        if not self.is_writer:
            self._add(set_not_writer=n)
            return False
        ckeys = [namespace.key(k) for k in keys]
        self._add(set_pages=n)

        def put() -> list[bool]:
            oks = self.manager.batched_put_sync(ckeys, records, MemoryFormat.UNDEFINED)
            stored = sum(1 for ok in oks if ok)
            self._add(set_stored=stored, set_rejected=n - stored)
            return oks

        try:
            return all(self._guard("batch_set", put))
        except _Fault:
            return False

    # ---- maintenance ------------------------------------------------------------------------------
    def flush(self) -> bool:
        """Wait until every page stored so far reached every lower tier (bounded by
        ``blocking_timeout_secs``); False on a fault. For tools and tests: SGLang never waits."""
        if self._lease is None:
            return False
        try:
            self._guard("flush", self.manager.flush_sync)
            return True
        except _Fault:
            return False

    def clear(self) -> None:
        """Remove every entry of this backend's manager from every tier (shared tiers
        included: other processes sharing them lose those entries too). Faults are counted."""
        if self._lease is None:
            return
        try:
            self._guard("clear", self.manager.clear_sync)
        except _Fault:
            pass

    def get_stats(self) -> None:
        """SGLang's storage-metrics hook: None (SGLang then records its own figures); our
        counters are in :meth:`stats`."""
        return None

    def stats(self) -> dict[str, Any]:
        """Our counters, the pool geometry and the manager's per-tier stats (any thread).

        ``get_mismatched`` (stored records of another geometry, answered as misses) is the
        manager read path's count (``manager["read_into"]["mismatches"]``): shared by every
        backend on this manager."""
        with self._lock:
            out: dict[str, Any] = dict(self.counters)
        out["pool"] = self.pages.describe() if self.pages is not None else None
        manager = self.manager.stats() if not self.manager.closed else None
        out["manager"] = manager
        if manager is not None:
            out["get_mismatched"] = manager["read_into"]["mismatches"]
        return out

    def close(self) -> None:
        """Give back this backend's share of the manager (the last one closes it, flushing
        pending writes, bounded). Idempotent; later calls answer misses."""
        lease, self._lease = self._lease, None
        if lease is not None:
            release_manager(lease)
