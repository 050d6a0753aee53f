"""The framework-free half of the vLLM encoder-cache connector.

:class:`LMCacheECConnectorImpl` holds an :class:`~lmcache_async.engines.encoder_cache.ECCacheEngine`
and implements every method of vLLM's ``ECConnectorBase`` without importing vLLM: it reads the
vLLM objects it is handed (config, requests, metadata) by attribute, so it works across vLLM's
encoder-cache API versions (0.11.1 onwards). :mod:`.connector` wraps it in the class vLLM loads.

**No cache fault ends the engine.** Once ``has_cache_item`` said True, vLLM will not encode the
item and a missing load is fatal to it, so the connector says True only for an entry it has
read with every check and holds:

* ``ensure_cache_available`` (vLLM >= 0.32, called before any per-item question) holds CPU-tier
  entries at once and promotes lower-tier ones on the manager's loop, deferring the request
  meanwhile; ``has_cache_item`` then answers from what it holds (no I/O). Without that hook
  (older vLLM) ``has_cache_item`` reads the entry itself (one verified lookup per item).
* ``update_state_after_alloc`` moves the held entry into this step's metadata, without asking
  the storage again. A worker in the same process takes the held reference; workers in other
  processes get a disk lease (:mod:`.leases`), so eviction or deletion after the promise
  cannot make the load miss.
* What can still fail (a promised item only a remote tier holds, loaded by a worker in another
  process, when the remote goes away) gets a zero tensor so the step runs, is counted as a
  ``load_failure`` and its requests are failed through ``take_unavailable_requests``.

Any other failure inside the connector (storage trouble, a bad tensor, a request without the
expected fields) never raises into vLLM's step: it is counted in :meth:`stats` and logged (at
most once per few seconds per operation). The one exception is a metadata object of the wrong
type in :meth:`start_load_caches`, a wiring mistake that raises ``TypeError``.

Engine sharing: within one process every connector built from the same configuration (the
scheduler-role and the worker-role one under vLLM's single-process executor) shares one
engine, so a CPU-only cache works there. Separate processes see each other's entries only
through a shared tier (a ``local_disk`` directory they all use, or a remote store).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import torch

from lmcache_async.backend import Presence
from lmcache_async.config import (
    CONFIG_FILE_ENV,
    LMCacheEngineConfig,
    load_ec_engine_config,
    load_engine_config,
)
from lmcache_async.dtypes import dtype_name, parse_dtype
from lmcache_async.engines.encoder_cache import ECCacheEngine
from lmcache_async.integration.vllm.leases import LeaseDir, read_record
from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import MemoryObj
from lmcache_async.metadata import LMCacheEngineMetadata
from lmcache_async.ratelog import RateLimitedLog
from lmcache_async.records import RecordError

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "default"
"""Model name used in keys when vLLM's config carries no model config."""
DEFAULT_ENCODER_DTYPE = torch.bfloat16
"""Key dtype used when vLLM's config carries no (resolvable) model dtype."""
CONFIG_FILE_KEY = "config_file"
"""``ec_connector_extra_config`` key naming a YAML configuration file."""

_LOG_EVERY_S = 5.0


@dataclass
class ECLoadMetadata:
    """What the scheduler tells the workers to load this step.

    ``mm_hashes``: sorted; ``leases``: hash → path of its disk lease (workers in other
    processes); ``specs``: hash → ``(shape, dtype name)`` of the verified entry. Plain data, so it
    crosses to worker processes however vLLM serialises it. :mod:`.connector` subclasses it
    together with vLLM's ``ECConnectorMetadata``.
    """

    mm_hashes: list[str] = field(default_factory=list)
    leases: dict[str, str] = field(default_factory=dict)
    specs: dict[str, tuple[list[int], str]] = field(default_factory=dict)


# ---- reading vLLM objects ----
def item_identifier(request: Any, index: int) -> str:
    """The hash of ``request``'s multimodal item ``index``.

    ``request.mm_features[index].identifier`` (vLLM >= 0.11.1), falling back to its
    ``.mm_hash``, then to ``request.mm_hashes[index]`` (0.11.x). ``ValueError`` when none is there.
    """
    feats = getattr(request, "mm_features", None)
    if feats is not None and index < len(feats):
        feat = feats[index]
        for attr in ("identifier", "mm_hash"):
            value = getattr(feat, attr, None)
            if isinstance(value, str) and value:
                return value
    hashes = getattr(request, "mm_hashes", None)
    if hashes is not None and index < len(hashes):
        value = hashes[index]
        if isinstance(value, str) and value:
            return value
    raise ValueError(f"request has no multimodal item hash at index {index}")


def item_count(request: Any) -> int:
    """How many multimodal items ``request`` carries (``mm_features``, else ``mm_hashes``)."""
    feats = getattr(request, "mm_features", None)
    if feats is not None:
        return len(feats)
    hashes = getattr(request, "mm_hashes", None)
    return len(hashes) if hashes is not None else 0


def model_identity(vllm_config: Any, pinned: str | None = None) -> tuple[str, torch.dtype]:
    """``(model name, encoder dtype)`` used in encoder-cache keys.

    Name: ``pinned`` (the ``ec_model_name`` key) when given, else ``model_config.model`` (the
    weights vLLM loads: a hub id or a path), else :data:`DEFAULT_MODEL_NAME`.
    ``served_model_name`` is an API alias and never enters the keys. Dtype:
    ``model_config.dtype`` (a ``torch.dtype`` or a name), else :data:`DEFAULT_ENCODER_DTYPE`.
    """
    mc = getattr(vllm_config, "model_config", None)
    name: str | None = pinned if isinstance(pinned, str) and pinned else None
    dtype: torch.dtype | None = None
    if mc is not None:
        if name is None:
            model = getattr(mc, "model", None)
            if isinstance(model, str) and model:
                name = model
        raw = getattr(mc, "dtype", None)
        if raw is not None:
            try:
                dtype = parse_dtype(raw)
                dtype_name(dtype)
            except ValueError:
                logger.warning(
                    "model dtype %r cannot key the encoder cache; using %s",
                    raw,
                    DEFAULT_ENCODER_DTYPE,
                )
                dtype = None
    if name is None:
        logger.warning("vLLM config has no model name; encoder-cache keys use %r", DEFAULT_MODEL_NAME)
        name = DEFAULT_MODEL_NAME
    return name, dtype if dtype is not None else DEFAULT_ENCODER_DTYPE


def worker_device(vllm_config: Any) -> torch.device:
    """The device loaded entries go to: ``vllm_config.device_config.device`` (or its
    ``device_type``); a CUDA device without an index means the current one."""
    dc = getattr(vllm_config, "device_config", None)
    raw = getattr(dc, "device", None) if dc is not None else None
    if raw is None and dc is not None:
        raw = getattr(dc, "device_type", None)
    dev: torch.device
    try:
        dev = torch.device(raw) if raw is not None else torch.device("cpu")
    except (RuntimeError, TypeError, ValueError):
        logger.warning("unknown vLLM device %r; loading encoder-cache entries to the CPU", raw)
        dev = torch.device("cpu")
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def connector_roles(vllm_config: Any, parent: Any) -> tuple[bool, bool]:
    """``(is_producer, is_consumer)``: each flag from the parent when it has it as a bool (vLLM's
    ``ECConnectorBase``), else from ``ec_transfer_config.ec_role`` (framework-free parents may
    carry one flag, both or none)."""
    tc = getattr(vllm_config, "ec_transfer_config", None)
    role = getattr(tc, "ec_role", None)
    prod = getattr(parent, "is_producer", None)
    cons = getattr(parent, "is_consumer", None)
    if not isinstance(prod, bool):
        prod = role in ("ec_producer", "ec_both")
    if not isinstance(cons, bool):
        cons = role in ("ec_consumer", "ec_both")
    return prod, cons


def _role_name(role: Any) -> str:
    name = getattr(role, "name", role)
    return str(name).lower()


# ---- configuration ----
def load_connector_config(extra_config: Mapping[str, Any] | None = None) -> LMCacheEngineConfig:
    """The engine config of the connector.

    Base: the YAML named by ``extra_config["config_file"]`` (else ``$LMCACHE_CONFIG_FILE``),
    then ``LMCACHE_<KEY>`` env, then the other ``extra_config`` keys given inline (plain keys,
    then ``ec_``-prefixed ones). On top, :func:`load_ec_engine_config` applies the EC overlay
    of that file (``ec_<key>``, ``ec:``), ``LMCACHE_EC_<KEY>`` env and the EC defaults.
    Unknown inline keys are logged and dropped; invalid values raise ``ConfigError``.
    """
    extra = dict(extra_config or {})
    path = extra.pop(CONFIG_FILE_KEY, None)
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"ec_connector_extra_config[{CONFIG_FILE_KEY!r}] must be a path, got {type(path).__name__}")
    file_path = path if path else os.environ.get(CONFIG_FILE_ENV) or None
    base = load_engine_config(file_path)
    fields = LMCacheEngineConfig.model_fields
    plain: list[tuple[str, Any]] = []
    prefixed: list[tuple[str, Any]] = []
    for key, value in extra.items():
        if key in fields:
            plain.append((key, value))
        elif isinstance(key, str) and key.startswith("ec_") and key[3:] in fields:
            prefixed.append((key[3:], value))
        elif key == "ec" and isinstance(value, Mapping):
            prefixed.extend((k, v) for k, v in value.items() if isinstance(k, str) and k in fields)
        else:
            logger.warning("unknown ec_connector_extra_config key %r dropped", key)
    for key, value in plain + prefixed:
        base.set(key, value, "ec_connector_extra_config")
    return load_ec_engine_config(base_config=base, config_file_path=file_path)


# ---- engines shared within a process ----
class _Handoff:
    """Verified entries the scheduler promised, waiting for a worker of the same process.

    The scheduler puts one ``MemoryObj`` reference per promised hash; the worker takes it (and
    releases it once copied out). An entry no worker took within ``ttl_s`` is released by
    :meth:`sweep`. ``workers`` counts the worker-role connectors of this process using the engine.
    """

    __slots__ = ("entries", "lock", "workers")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.entries: dict[str, list[tuple[MemoryObj, float]]] = {}
        self.workers = 0

    def put(self, mm_hash: str, obj: MemoryObj) -> None:
        with self.lock:
            self.entries.setdefault(mm_hash, []).append((obj, time.monotonic()))

    def take(self, mm_hash: str) -> MemoryObj | None:
        with self.lock:
            objs = self.entries.get(mm_hash)
            if not objs:
                return None
            obj, _ = objs.pop(0)
            if not objs:
                del self.entries[mm_hash]
            return obj

    def sweep(self, ttl_s: float, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        stale: list[MemoryObj] = []
        with self.lock:
            for h in list(self.entries):
                keep = [(o, t) for o, t in self.entries[h] if now - t <= ttl_s]
                stale.extend(o for o, t in self.entries[h] if now - t > ttl_s)
                if keep:
                    self.entries[h] = keep
                else:
                    del self.entries[h]
        for o in stale:
            _release(o)
        return len(stale)

    def clear(self) -> None:
        with self.lock:
            objs = [o for lst in self.entries.values() for o, _ in lst]
            self.entries.clear()
        for o in objs:
            _release(o)


_handoffs: weakref.WeakKeyDictionary[ECCacheEngine, _Handoff] = weakref.WeakKeyDictionary()
_handoffs_lock = threading.Lock()


def handoff_of(engine: ECCacheEngine) -> _Handoff:
    """The process-wide hand-off table of ``engine`` (created on first use)."""
    with _handoffs_lock:
        h = _handoffs.get(engine)
        if h is None:
            h = _handoffs[engine] = _Handoff()
        return h


def _release(obj: MemoryObj) -> None:
    try:
        obj.ref_count_down()
    except Exception:  # pragma: no cover - a double release is a bug elsewhere; never raise here
        logger.debug("encoder-cache connector: releasing a held entry failed", exc_info=True)


class _Shared:
    __slots__ = ("engine", "pid", "refs")

    def __init__(self, engine: ECCacheEngine) -> None:
        self.engine = engine
        self.refs = 0
        self.pid = os.getpid()


_shared: dict[tuple[Any, ...], _Shared] = {}
_shared_lock = threading.Lock()


def _config_fingerprint(config: LMCacheEngineConfig) -> str:
    return json.dumps(config.to_dict(), sort_keys=True, default=str)


def acquire_engine(
    config: LMCacheEngineConfig,
    model_name: str,
    encoder_dtype: torch.dtype,
    factory: Callable[[], ECCacheEngine] | None = None,
) -> tuple[tuple[Any, ...], ECCacheEngine]:
    """The process-wide engine for this (config, model, dtype), created on first use.

    Returns ``(lease, engine)``; give ``lease`` back with :func:`release_engine`. The last
    release closes the engine. An engine inherited through ``fork`` is never reused, and a
    closed one is replaced (leases of the replaced engine then release nothing of the new one).
    """
    token = (os.getpid(), _config_fingerprint(config), model_name, dtype_name(encoder_dtype))
    with _shared_lock:
        entry = _shared.get(token)
        if entry is not None and (entry.pid != os.getpid() or entry.engine.closed):
            del _shared[token]
            entry = None
        if entry is None:
            if factory is None:
                meta = LMCacheEngineMetadata(model_name=model_name, kv_dtype=encoder_dtype, role="worker")
                engine = ECCacheEngine(config, meta, encoder_dtype)
            else:
                engine = factory()
            entry = _Shared(engine)
            _shared[token] = entry
        entry.refs += 1
        return (token, entry), entry.engine


def release_engine(lease: tuple[Any, ...]) -> None:
    """Give back one reference taken by :func:`acquire_engine` (closing the engine at zero)."""
    token, entry = lease
    with _shared_lock:
        if entry.refs <= 0:
            return
        entry.refs -= 1
        if entry.refs > 0:
            return
        if _shared.get(token) is entry:
            del _shared[token]
    if entry.pid == os.getpid():
        handoff_of(entry.engine).clear()
        entry.engine.close()


# ---- scheduler-side bookkeeping ----
@dataclass
class _Ready:
    """A verified entry held for a promise: the scheduler's reference, when it was taken, and
    its disk lease when workers live in other processes."""

    obj: MemoryObj
    since: float
    lease: str | None = None


_Fetched = tuple[MemoryObj | None, str, str | None]
"""What a promotion yields: ``(entry, why not, lease path)``."""


@dataclass
class _Prefetch:
    """A promotion queued for (then running on) the manager's loop."""

    future: concurrent.futures.Future[_Fetched]
    deadline: float


COUNTERS = (
    "lookups",
    "hits",
    "misses",
    "promised",
    "deferred",
    "prefetches",
    "prefetch_hits",
    "prefetch_timeouts",
    "faults",
    "loaded",
    "loaded_bytes",
    "loaded_from_hold",
    "loaded_from_lease",
    "load_failures",
    "load_skipped_present",
    "leases",
    "lease_failures",
    "unavailable_requests",
    "saved",
    "saved_bytes",
    "save_rejected",
    "save_skipped",
    "errors",
)
"""Every counter the connector keeps (``stats()`` and vLLM's EC connector stats use these names).

``hits``/``misses``: ``has_cache_item`` answers. ``faults``: an entry a tier claimed but could
not deliver intact (damaged, vanished, tier down) seen before a promise; the item was reported
not cached and vLLM encoded it. ``load_failures``: a promised item the worker could not load
(its request is failed through ``take_unavailable_requests``)."""

CONNECTOR_KEYS: dict[str, float] = {"prefetch_deadline_s": 5.0, "hold_ttl_s": 60.0, "lease_max_age_s": 600.0}
"""``ec_connector_extra_config`` keys read by the connector itself (not engine config keys)."""


class _Promise:
    __slots__ = ("lease", "obj", "requests")

    def __init__(self, obj: MemoryObj, lease: str | None) -> None:
        self.obj = obj
        self.lease = lease
        self.requests: set[str] = set()


# ---- the connector logic ----
class LMCacheECConnectorImpl:
    """vLLM encoder-cache connector logic over an :class:`ECCacheEngine`; see the module docstring.

    ``vllm_config`` must carry an ``ec_transfer_config`` (its ``ec_connector_extra_config`` may
    name a ``config_file`` or hold config keys inline, plus the connector's own
    :data:`CONNECTOR_KEYS`); ``role`` is vLLM's ``ECConnectorRole`` (or
    ``"scheduler"``/``"worker"``); ``parent`` is the vLLM connector object (its connector
    metadata and producer/consumer flags are read). ``metadata_cls`` is the metadata type
    built by :meth:`build_connector_meta` and required by :meth:`start_load_caches`.
    ``engine`` injects an engine (then it is not shared and not closed by :meth:`close`).

    Threads: vLLM calls every scheduler-side method from its scheduler thread and every
    worker-side method from the model-runner thread; counters are safe to read from any thread.
    Construction fails loudly (``ValueError``/``ConfigError``) on a bad configuration.
    """

    def __init__(
        self,
        vllm_config: Any,
        role: Any,
        parent: Any = None,
        *,
        metadata_cls: type[ECLoadMetadata] = ECLoadMetadata,
        engine: ECCacheEngine | None = None,
    ) -> None:
        transfer = getattr(vllm_config, "ec_transfer_config", None)
        if transfer is None:
            raise ValueError("vllm_config.ec_transfer_config must be set for the encoder-cache connector")
        if not (isinstance(metadata_cls, type) and issubclass(metadata_cls, ECLoadMetadata)):
            raise TypeError("metadata_cls must be a subclass of ECLoadMetadata")
        self._vllm_config = vllm_config
        self._parent = parent
        self.role = _role_name(role)
        self.is_producer, self.is_consumer = connector_roles(vllm_config, parent)
        self._metadata_cls = metadata_cls
        self._lock = threading.Lock()
        self._counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._reported: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._worker_reported: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._errors_by_op: dict[str, int] = {}
        self._rate_log = RateLimitedLog(logger, _LOG_EVERY_S)
        self._device: torch.device | None = None
        self._token: tuple[Any, ...] | None = None
        extra = dict(getattr(transfer, "ec_connector_extra_config", None) or {})
        knobs = {k: float(extra.pop(k, v)) for k, v in CONNECTOR_KEYS.items()}
        self.prefetch_deadline_s = knobs["prefetch_deadline_s"]
        self.hold_ttl_s = knobs["hold_ttl_s"]
        if engine is not None:
            self._engine = engine
            self.model_name, self.encoder_dtype = engine.model_name, engine.encoder_dtype
        else:
            config = load_connector_config(extra)
            pinned = getattr(config, "ec_model_name", None)
            self.model_name, self.encoder_dtype = model_identity(vllm_config, pinned)
            self._token, self._engine = acquire_engine(config, self.model_name, self.encoder_dtype)
        sm = self._engine.storage_manager
        self._sm = sm
        self._cpu_lookup: Callable[[CacheEngineKey], MemoryObj | None] | None = getattr(
            sm.backend("cpu"), "lookup", None
        )
        self._has_lower = sm.has_lower_tiers
        disk_root = getattr(self._engine.config, "local_disk", None)
        self._leases = (
            LeaseDir(_strip_file_url(disk_root), max_age_s=knobs["lease_max_age_s"])
            if disk_root and "disk" in sm.tier_names
            else None
        )
        self._handoff = handoff_of(self._engine)
        self._is_worker = self.role == "worker"
        if self._is_worker:
            with self._handoff.lock:
                self._handoff.workers += 1
        # scheduler side
        self._ensure_mode = False
        self._ready: dict[str, _Ready] = {}
        self._inflight: dict[str, _Prefetch] = {}
        self._to_submit: list[tuple[CacheEngineKey, concurrent.futures.Future[_Fetched], bool]] = []
        self._unusable: dict[str, float] = {}
        self._ready_requests: set[str] = set()
        self._pending: dict[str, _Promise] = {}
        self._promised_to: dict[str, set[str]] = {}
        self._unavailable: set[str] = set()
        self._last_sweep = time.monotonic()
        # worker side
        self._failed_loads: set[str] = set()
        self._closed = False
        if self._leases is not None and not self._is_worker:
            self._leases.reap()
        logger.info(
            "encoder-cache connector (%s, producer=%s, consumer=%s) model=%r dtype=%s tiers=%s",
            self.role,
            self.is_producer,
            self.is_consumer,
            self.model_name,
            dtype_name(self.encoder_dtype),
            sm.tier_names,
        )

    # ---- helpers ----
    @property
    def engine(self) -> ECCacheEngine:
        """The engine (shared with the other connectors of this process and config)."""
        return self._engine

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n

    def _failed(self, op: str, exc: BaseException | str) -> None:
        with self._lock:
            self._counters["errors"] += 1
            self._errors_by_op[op] = self._errors_by_op.get(op, 0) + 1
            total = self._errors_by_op[op]
        self._log(op, "encoder-cache connector: %s failed (%d so far): %s", op, total, _describe(exc))

    def _log(self, category: str, msg: str, *args: Any) -> None:
        """A warning, at most once per few seconds per category."""
        self._rate_log.warning(msg, *args, key=category)

    def _load_device(self) -> torch.device:
        dev = self._device
        if dev is None:
            dev = self._device = worker_device(self._vllm_config)
        return dev

    def _current_metadata(self, kwargs: Mapping[str, Any]) -> Any:
        meta = kwargs.get("metadata")
        if meta is not None:
            return meta
        parent = self._parent
        if parent is None:
            return None
        # vLLM keeps the bound metadata in `_connector_metadata`; its accessor asserts when
        # nothing is bound, and "nothing bound" must be a no-op here.
        if hasattr(parent, "_connector_metadata"):
            return parent._connector_metadata
        getter = getattr(parent, "_get_connector_metadata", None) or getattr(parent, "get_ec_connector_metadata", None)
        if getter is None:
            return None
        try:
            return getter()
        except AssertionError:
            return None

    def _held_locally(self, mm_hash: str) -> MemoryObj | None:
        """A reference to the CPU-tier entry of ``mm_hash`` (no I/O, no loop hop), or None."""
        lookup = self._cpu_lookup
        if lookup is None:
            return None
        return lookup(self._engine.key(mm_hash))

    def _verified_get(self, mm_hash: str) -> MemoryObj | None:
        """The entry read through every tier with its checks (blocking, bounded by the
        manager's timeout); counts a fault when a tier claimed it but could not deliver it."""
        key = self._engine.key(mm_hash)
        obj = self._held_locally(mm_hash)
        if obj is not None or not self._has_lower:
            return obj
        try:
            presence = self._sm.presence_sync(key)
            if presence is Presence.ABSENT:
                return None
            obj = self._sm.get_sync(key)
        except TimeoutError:
            self._count("faults")
            self._log("verify", "encoder-cache connector: lookup of %s timed out; it is encoded", mm_hash)
            return None
        if obj is None:
            self._count("faults")
            self._log("verify", "encoder-cache connector: %s is listed but unreadable; it is encoded", mm_hash)
        return obj

    async def _fetch(self, key: CacheEngineKey, lease: bool) -> _Fetched:
        """On the manager's loop: ``(entry, "", lease)`` or ``(None, why, None)``; why is
        ``"absent"`` or a fault description. With ``lease`` the record is leased on the disk
        (on an executor thread) and only a leased entry counts."""
        presence = await self._sm.presence(key)
        if presence is Presence.ABSENT:
            return None, "absent", None
        obj = await self._sm.get(key)
        if obj is None:
            return None, ("a tier did not answer" if presence is Presence.UNKNOWN else "listed but unreadable"), None
        if not lease:
            return obj, "", None
        path = await asyncio.to_thread(self._take_lease, key)
        if path is None:
            obj.ref_count_down()
            return None, "absent", None  # not on the shared disk: workers elsewhere cannot read it
        return obj, "", path

    def _take_lease(self, key: CacheEngineKey) -> str | None:
        leases = self._leases
        path = leases.take(key) if leases is not None else None
        self._count("leases" if path is not None else "lease_failures")
        return path

    async def _fetch_all(self, batch: list[tuple[CacheEngineKey, concurrent.futures.Future[_Fetched], bool]]) -> None:
        async def one(key: CacheEngineKey, fut: concurrent.futures.Future[_Fetched], lease: bool) -> None:
            try:
                res = await self._fetch(key, lease)
            except BaseException as exc:  # reported through the future, never raised here
                if not fut.set_running_or_notify_cancel():
                    return
                fut.set_exception(exc)
                if not isinstance(exc, Exception):
                    raise
                return
            if fut.set_running_or_notify_cancel():
                fut.set_result(res)
            else:
                _release_fetched(res)

        await asyncio.gather(*(one(k, f, le) for k, f, le in batch))

    def _submit_prefetches(self) -> None:
        """Hand this step's queued promotions to the loop in one hop (after the hooks ran)."""
        batch, self._to_submit = self._to_submit, []
        if not batch:
            return
        try:
            self._sm.loop_thread.submit(self._fetch_all(batch))
        except Exception as exc:
            for _, fut, _ in batch:
                if fut.set_running_or_notify_cancel():
                    fut.set_exception(exc)
            self._failed("prefetch", exc)

    def _workers_elsewhere(self) -> bool:
        """True when no worker-role connector of this process uses the engine (the workers run
        in other processes and see entries only through a shared tier)."""
        return self._handoff.workers == 0

    # ---- scheduler side ----
    def has_cache_item(self, identifier: str) -> bool:
        """True only when the entry of ``identifier`` is verified readable and held for the
        load vLLM will ask for; False on a miss or any fault (vLLM then encodes the item).

        With vLLM's ``ensure_cache_available`` in use this never does I/O: it answers from what
        that hook prepared, or from the CPU tier. Without it (older vLLM) a CPU miss reads the
        lower tiers once, blocking up to the manager's timeout.
        """
        try:
            with self._lock:
                self._counters["lookups"] += 1
            if identifier in self._ready:
                self._count("hits")
                return True
            if identifier in self._unusable or identifier in self._inflight:
                self._count("misses")
                return False
            lease: str | None = None
            if self._ensure_mode:
                # Workers elsewhere can only use what a promotion leased on the shared disk.
                obj = None if self._workers_elsewhere() and self.is_consumer else self._held_locally(identifier)
            else:
                obj = self._verified_get(identifier)
                if obj is not None and self.is_consumer and self._workers_elsewhere() and self._leases is not None:
                    lease = self._take_lease(self._engine.key(identifier))
        except Exception as exc:
            self._failed("has_cache_item", exc)
            return False
        if obj is None:
            self._count("misses")
            return False
        if self.is_consumer:
            self._ready[identifier] = _Ready(obj, time.monotonic(), lease)
        else:  # a producer only skips encoding; nothing will be loaded
            _release(obj)
        self._count("hits")
        return True

    def has_caches(self, request: Any) -> list[bool]:
        """One flag per multimodal item of ``request`` (the vLLM 0.11.1-0.14 API)."""
        try:
            n = item_count(request)
            ids = [item_identifier(request, i) for i in range(n)]
        except Exception as exc:
            self._failed("has_caches", exc)
            return [False] * _safe_len(request)
        return [self.has_cache_item(h) for h in ids]

    def ensure_cache_available(self, request: Any, num_computed_tokens: int = 0, *args: Any, **kwargs: Any) -> bool:
        """vLLM >= 0.32: make ``request``'s cached items local and held before vLLM asks.

        A CPU-tier entry is held at once; an entry only a lower tier may have is promoted on
        the manager's loop (this returns False at once, so vLLM defers the request and asks
        again next step). A promotion that has not finished after ``prefetch_deadline_s`` is
        given up: the hook returns True and ``has_cache_item`` says False for those items (vLLM
        encodes them). Once every item is settled the request is remembered: later calls cost
        one set lookup. Never raises, never waits on I/O.
        """
        if not self.is_consumer:
            return True
        self._ensure_mode = True
        try:
            rid = request.request_id
            if rid in self._ready_requests:
                return True
            feats = getattr(request, "mm_features", None) or ()
            now = time.monotonic()
            settled = True
            for index, feat in enumerate(feats):
                pos = getattr(feat, "mm_position", None)
                if pos is not None and pos.offset + pos.length <= num_computed_tokens:
                    continue
                if not self._settle(item_identifier(request, index), now):
                    settled = False
        except Exception as exc:
            self._failed("ensure_cache_available", exc)
            return True
        if settled:
            self._ready_requests.add(rid)
            return True
        self._count("deferred")
        return False

    def _settle(self, mm_hash: str, now: float) -> bool:
        """True once ``mm_hash`` is held, known unusable or not cached; starts its promotion
        (and returns False) when only a lower tier may have it."""
        if mm_hash in self._ready or mm_hash in self._unusable:
            return True
        pf = self._inflight.get(mm_hash)
        if pf is None:
            elsewhere = self._workers_elsewhere()
            if not elsewhere:
                obj = self._held_locally(mm_hash)
                if obj is not None:
                    self._ready[mm_hash] = _Ready(obj, now)
                    return True
            if not self._has_lower:
                return True  # nothing below the CPU tier: not cached
            fut: concurrent.futures.Future[_Fetched] = concurrent.futures.Future()
            self._to_submit.append((self._engine.key(mm_hash), fut, elsewhere and self._leases is not None))
            self._inflight[mm_hash] = _Prefetch(fut, now + self.prefetch_deadline_s)
            self._count("prefetches")
            return False
        if pf.future.done():
            del self._inflight[mm_hash]
            try:
                obj, why, lease = pf.future.result()
            except Exception as exc:
                obj, why, lease = None, _describe(exc), None
            if obj is not None:
                self._ready[mm_hash] = _Ready(obj, now, lease)
                self._count("prefetch_hits")
            elif why == "absent":  # not asked again while this request settles its other items
                self._unusable[mm_hash] = now + self.prefetch_deadline_s
            else:
                self._unusable[mm_hash] = now + self.hold_ttl_s
                self._count("faults")
                self._log("prefetch", "encoder-cache connector: %s: %s; it is encoded", mm_hash, why)
            return True
        if now >= pf.deadline:
            del self._inflight[mm_hash]
            self._unusable[mm_hash] = now + self.hold_ttl_s
            self._count("prefetch_timeouts")
            self._log("prefetch", "encoder-cache connector: promotion of %s timed out; it is encoded", mm_hash)
            pf.future.add_done_callback(self._release_late)
            return True
        return False

    def _release_late(self, fut: concurrent.futures.Future[_Fetched]) -> None:
        """A promotion nobody waits for any more: give its entry and lease back."""
        if fut.cancelled() or fut.exception() is not None:
            return
        self._release_fetched(fut.result())

    @staticmethod
    def _release_fetched(res: _Fetched) -> None:
        _release_fetched(res)

    def update_state_after_alloc(self, request: Any, index: int) -> None:
        """Queue item ``index`` of ``request`` for loading when ``has_cache_item`` promised it
        (its held entry moves to this step's metadata); items vLLM encodes are not queued.
        No storage lookup happens here."""
        if not self.is_consumer:
            return
        try:
            mm_hash = item_identifier(request, index)
            rid = str(getattr(request, "request_id", ""))
        except Exception as exc:
            self._failed("update_state_after_alloc", exc)
            return
        ready = self._ready.pop(mm_hash, None)
        promise = self._pending.get(mm_hash)
        if ready is not None:
            if promise is None:
                promise = self._pending[mm_hash] = _Promise(ready.obj, ready.lease)
            else:
                self._release_fetched((ready.obj, "", ready.lease))
        if promise is None:
            return
        promise.requests.add(rid)
        self._promised_to.setdefault(mm_hash, set()).add(rid)
        self._count("promised")

    def build_connector_meta(self, scheduler_output: Any = None) -> ECLoadMetadata:
        """This step's promised hashes, sorted, with how a worker reaches each one.

        A worker in this process takes the scheduler's held reference (nothing can evict or
        delete it before the load). For workers in other processes the record is leased on
        the shared disk (a hard link the worker reads when the record itself is gone). The
        queue is emptied every step; holds nobody used within ``hold_ttl_s`` are released.
        """
        pending, self._pending = self._pending, {}
        leases: dict[str, str] = {}
        specs: dict[str, tuple[list[int], str]] = {}
        local_worker = not self._workers_elsewhere()
        for mm_hash, promise in pending.items():
            obj = promise.obj
            try:
                specs[mm_hash] = (list(obj.shape), dtype_name(obj.dtype))
            except Exception:  # pragma: no cover - a pool object always has both
                pass
            if promise.lease is not None:
                leases[mm_hash] = promise.lease
            if local_worker:
                self._handoff.put(mm_hash, obj)
            else:
                _release(obj)
        self._sweep()
        self._submit_prefetches()  # last: the loop wakes up after this step's hooks are done
        return self._metadata_cls(mm_hashes=sorted(pending), leases=leases, specs=specs)

    def _sweep(self) -> None:
        now = time.monotonic()
        if now - self._last_sweep < 1.0:
            return
        self._last_sweep = now
        ttl = self.hold_ttl_s
        for h in [h for h, r in self._ready.items() if now - r.since > ttl]:
            r = self._ready.pop(h)
            self._release_fetched((r.obj, "", r.lease))
        for h in [h for h, t in self._unusable.items() if t <= now]:
            del self._unusable[h]
        self._handoff.sweep(ttl, now)

    def update_connector_output(self, connector_output: Any) -> None:
        """Take the workers' report of this step: failed loads (their requests are handed to
        :meth:`take_unavailable_requests`) and the workers' counters."""
        meta = getattr(connector_output, "ec_connector_worker_meta", None)
        if meta is None:
            return
        try:
            for mm_hash in getattr(meta, "failed", ()) or ():
                self._unavailable.update(self._promised_to.get(mm_hash, ()))
            counts = getattr(meta, "counters", None) or {}
            with self._lock:
                for k, v in counts.items():
                    if k in self._worker_reported:
                        self._worker_reported[k] += int(v)
        except Exception as exc:
            self._failed("update_connector_output", exc)

    def take_unavailable_requests(self) -> set[str]:
        """Requests with a promised item no worker could load (vLLM fails them cleanly)."""
        out, self._unavailable = self._unavailable, set()
        if out:
            self._count("unavailable_requests", len(out))
        return out

    def update_state_after_free(self, request: Any, index: int) -> None:
        """vLLM released item ``index`` of ``request`` from its encoder cache."""
        try:
            mm_hash = item_identifier(request, index)
        except Exception:
            return
        reqs = self._promised_to.get(mm_hash)
        if reqs is not None:
            reqs.discard(str(getattr(request, "request_id", "")))
            if not reqs:
                del self._promised_to[mm_hash]

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """Forget ``request`` (nothing is sent asynchronously: never delays freeing)."""
        self._ready_requests.discard(str(getattr(request, "request_id", "")))
        return False, None

    # ---- worker side ----
    def start_load_caches(self, encoder_cache: MutableMapping[str, torch.Tensor], **kwargs: Any) -> None:
        """Fill ``encoder_cache`` with the entries the bound metadata lists and it lacks.

        Order per hash: the scheduler's held reference (same process), the engine (any tier),
        the disk lease. Never overwrites an entry vLLM holds; loads onto the worker's device; no
        bound metadata is a no-op; metadata of another type raises ``TypeError``. A hash that
        cannot be loaded gets a zero tensor of the recorded shape (so the step runs) and is
        reported through :meth:`build_connector_worker_meta`; its requests are then failed by
        vLLM instead of the engine.
        """
        meta = self._current_metadata(kwargs)
        if meta is None:
            return
        if not isinstance(meta, self._metadata_cls):
            raise TypeError(
                f"encoder-cache connector metadata must be {self._metadata_cls.__name__}, got {type(meta).__name__}"
            )
        hashes = meta.mm_hashes
        if not hashes:
            return
        leases = getattr(meta, "leases", None) or {}
        try:
            device = self._load_device()
        except Exception as exc:
            self._failed("start_load_caches", exc)
            device = torch.device("cpu")
        for mm_hash in hashes:
            lease = leases.get(mm_hash)
            try:
                self._load_one(encoder_cache, mm_hash, lease, device, meta)
            except Exception as exc:
                self._failed("start_load_caches", exc)
                self._load_failed(encoder_cache, mm_hash, meta, device)
            finally:
                if lease is not None and self._leases is not None and self._leases.owns(lease):
                    self._leases.drop(lease)

    def _load_one(
        self,
        encoder_cache: MutableMapping[str, torch.Tensor],
        mm_hash: str,
        lease: str | None,
        device: torch.device,
        meta: Any,
    ) -> None:
        held = self._handoff.take(mm_hash)
        if mm_hash in encoder_cache:
            if held is not None:
                _release(held)
            self._count("load_skipped_present")
            return
        tensor: torch.Tensor | None = None
        source = ""
        if held is not None:
            try:
                src = held.tensor
                tensor = src.clone() if device.type == "cpu" else src.to(device=device, copy=True)
            finally:
                _release(held)
            source = "loaded_from_hold"
        if tensor is None:
            tensor = self._engine.get(mm_hash, device)
        if tensor is None and lease is not None and self._leases is not None and self._leases.owns(lease):
            try:
                tensor = read_record(lease, self._engine.key(mm_hash)).to(device)
                source = "loaded_from_lease"
            except (OSError, RecordError) as exc:
                self._log("lease", "encoder-cache connector: lease of %s unreadable: %s", mm_hash, _describe(exc))
        if tensor is None:
            self._load_failed(encoder_cache, mm_hash, meta, device)
            return
        encoder_cache[mm_hash] = tensor
        with self._lock:
            self._counters["loaded"] += 1
            self._counters["loaded_bytes"] += tensor.numel() * tensor.element_size()
            if source:
                self._counters[source] += 1

    def _load_failed(
        self, encoder_cache: MutableMapping[str, torch.Tensor], mm_hash: str, meta: Any, device: torch.device
    ) -> None:
        self._count("load_failures")
        self._failed_loads.add(mm_hash)
        self._log("load", "encoder-cache connector: promised item %s could not be loaded; its request fails", mm_hash)
        spec = (getattr(meta, "specs", None) or {}).get(mm_hash)
        if spec is not None and mm_hash not in encoder_cache:
            shape, dtype = spec
            encoder_cache[mm_hash] = torch.zeros(tuple(shape), dtype=parse_dtype(dtype), device=device)

    def take_worker_report(self) -> tuple[set[str], dict[str, int]] | None:
        """What the worker reports to the scheduler this step: failed hashes and the counter
        increments since the last report; None when there is nothing new."""
        failed, self._failed_loads = self._failed_loads, set()
        with self._lock:
            delta = {k: v - self._reported[k] for k, v in self._counters.items() if v != self._reported[k]}
            self._reported = dict(self._counters)
        if not failed and not delta:
            return None
        return failed, delta

    def save_caches(self, encoder_cache: Mapping[str, torch.Tensor], mm_hash: str, **kwargs: Any) -> None:
        """Store ``encoder_cache[mm_hash]`` when this connector produces (else a no-op)."""
        if not self.is_producer:
            return
        try:
            tensor = encoder_cache.get(mm_hash)
            if tensor is None:
                self._count("save_skipped")
                return
            ok = self._engine.put(mm_hash, tensor)
        except Exception as exc:
            self._failed("save_caches", exc)
            return
        with self._lock:
            if ok:
                self._counters["saved"] += 1
                self._counters["saved_bytes"] += tensor.numel() * tensor.element_size()
            else:
                self._counters["save_rejected"] += 1

    # ---- stats ----
    def take_stats_delta(self) -> dict[str, int]:
        """Scheduler side: counter increments since the last call, this connector's own plus
        what the workers reported (vLLM's EC connector stats are built from it)."""
        with self._lock:
            out = {k: v - self._reported[k] for k, v in self._counters.items() if v != self._reported[k]}
            self._reported = dict(self._counters)
            for k, v in self._worker_reported.items():
                if v:
                    out[k] = out.get(k, 0) + v
            self._worker_reported = dict.fromkeys(COUNTERS, 0)
        return out

    def stats(self) -> dict[str, Any]:
        """Connector counters (errors per operation included) and the engine's stats."""
        with self._lock:
            out: dict[str, Any] = dict(self._counters)
            out["errors_by_op"] = dict(self._errors_by_op)
        out["pending"] = len(self._pending)
        out["held"] = len(self._ready)
        out["prefetching"] = len(self._inflight)
        out["role"] = self.role
        out["model_name"] = self.model_name
        try:
            out["engine"] = self._engine.stats()
        except Exception as exc:  # a closed engine still reports its counters elsewhere
            out["engine"] = {"error": _describe(exc)}
        return out

    # ---- lifecycle ----
    def close(self) -> None:
        """Release held entries and this connector's share of the engine (the last one closes
        it). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for r in self._ready.values():
            self._release_fetched((r.obj, "", r.lease))
        self._ready.clear()
        for p in self._pending.values():
            self._release_fetched((p.obj, "", p.lease))
        self._pending.clear()
        self._submit_prefetches()
        for pf in self._inflight.values():
            pf.future.add_done_callback(self._release_late)
        self._inflight.clear()
        if self._is_worker:
            with self._handoff.lock:
                self._handoff.workers -= 1
        token, self._token = self._token, None
        if token is not None:
            try:
                release_engine(token)
            except Exception as exc:  # pragma: no cover - shutdown must not raise
                self._failed("close", exc)

    shutdown = close


def _release_fetched(res: _Fetched) -> None:
    obj, _, lease = res
    if obj is not None:
        _release(obj)
    if lease is not None:
        LeaseDir.drop(lease)


def _describe(exc: BaseException | str) -> str:
    return exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"


def _strip_file_url(path: str) -> str:
    return path[len("file://") :] if path.startswith("file://") else path


def _safe_len(request: Any) -> int:
    try:
        return item_count(request)
    except Exception:
        return 0
