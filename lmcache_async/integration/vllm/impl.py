"""The framework-free half of the vLLM encoder-cache connector.

:class:`LMCacheECConnectorImpl` holds an :class:`~lmcache_async.engines.encoder_cache.ECCacheEngine`
and implements every method of vLLM's ``ECConnectorBase`` without importing vLLM: it reads the
vLLM objects it is handed (config, requests, metadata) by attribute, so it works across vLLM's
encoder-cache API versions (0.11.1 onwards). :mod:`.connector` wraps it in the class vLLM loads.

Scheduler side: :meth:`has_cache_item` (vLLM >= 0.15) / :meth:`has_caches` (0.11.1-0.14),
:meth:`update_state_after_alloc`, :meth:`build_connector_meta` (sorted hashes; the pending set
is drained every step). Worker side: :meth:`save_caches` (producers only),
:meth:`start_load_caches` (fills only entries vLLM lacks, on the worker's device).

Failures inside the connector (storage trouble, a bad tensor, a request without the expected
fields) never raise into vLLM's step: they are counted in :meth:`stats` and logged (at most
once per few seconds per operation). The one exception is a metadata object of the wrong type
in :meth:`start_load_caches`, a wiring mistake that raises ``TypeError``.

Engine sharing: within one process every connector built from the same configuration (the
scheduler-role and the worker-role one under vLLM's single-process executor) shares one
engine, so a CPU-only cache works there. Separate processes see each other's entries only
through a shared tier (a ``local_disk`` directory they all use, or a remote store).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import torch

from lmcache_async.config import (
    CONFIG_FILE_ENV,
    LMCacheEngineConfig,
    load_ec_engine_config,
    load_engine_config,
)
from lmcache_async.dtypes import dtype_name, parse_dtype
from lmcache_async.engines.encoder_cache import ECCacheEngine
from lmcache_async.metadata import LMCacheEngineMetadata

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
    """What the scheduler tells the workers to load this step: ``mm_hashes``, sorted.

    :mod:`.connector` subclasses it together with vLLM's ``ECConnectorMetadata``.
    """

    mm_hashes: list[str] = field(default_factory=list)


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


def model_identity(vllm_config: Any) -> tuple[str, torch.dtype]:
    """``(model name, encoder dtype)`` from ``vllm_config.model_config``.

    Name: ``served_model_name`` (its first entry when a list), else ``model``, else
    :data:`DEFAULT_MODEL_NAME`. Dtype: ``model_config.dtype`` (a ``torch.dtype`` or a name),
    else :data:`DEFAULT_ENCODER_DTYPE`.
    """
    mc = getattr(vllm_config, "model_config", None)
    name: str | None = None
    dtype: torch.dtype | None = None
    if mc is not None:
        served = getattr(mc, "served_model_name", None)
        if isinstance(served, (list, tuple)):
            served = served[0] if served else None
        if isinstance(served, str) and served:
            name = served
        else:
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
    """``(is_producer, is_consumer)``: the parent's flags when it has them, else ``ec_role``."""
    prod = getattr(parent, "is_producer", None)
    cons = getattr(parent, "is_consumer", None)
    if isinstance(prod, bool) and isinstance(cons, bool):
        return prod, cons
    tc = getattr(vllm_config, "ec_transfer_config", None)
    role = getattr(tc, "ec_role", None)
    return role in ("ec_producer", "ec_both"), role in ("ec_consumer", "ec_both")


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
        entry.engine.close()


# ---- the connector logic ----
class LMCacheECConnectorImpl:
    """vLLM encoder-cache connector logic over an :class:`ECCacheEngine`; see the module docstring.

    ``vllm_config`` must carry an ``ec_transfer_config`` (its ``ec_connector_extra_config`` may
    name a ``config_file`` or hold config keys inline); ``role`` is vLLM's ``ECConnectorRole``
    (or ``"scheduler"``/``"worker"``); ``parent`` is the vLLM connector object (its connector
    metadata and producer/consumer flags are read). ``metadata_cls`` is the metadata type
    built by :meth:`build_connector_meta` and required by :meth:`start_load_caches`.
    ``engine`` injects an engine (then it is not shared and not closed by :meth:`close`).

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
        self._pending: set[str] = set()
        self._lock = threading.Lock()
        self._counters: dict[str, int] = {
            "saved": 0,
            "save_rejected": 0,
            "save_skipped": 0,
            "loaded": 0,
            "load_misses": 0,
            "load_skipped_present": 0,
            "lookups": 0,
            "lookup_hits": 0,
            "errors": 0,
        }
        self._errors_by_op: dict[str, int] = {}
        self._last_log: dict[str, float] = {}
        self._device: torch.device | None = None
        self._token: tuple[Any, ...] | None = None
        self.model_name, self.encoder_dtype = model_identity(vllm_config)
        if engine is not None:
            self._engine = engine
        else:
            extra = getattr(transfer, "ec_connector_extra_config", None) or {}
            config = load_connector_config(extra)
            self._token, self._engine = acquire_engine(config, self.model_name, self.encoder_dtype)
        self._closed = False
        logger.info(
            "encoder-cache connector (%s, producer=%s, consumer=%s) on tiers %s",
            self.role,
            self.is_producer,
            self.is_consumer,
            self._engine.storage_manager.tier_names,
        )

    # ---- helpers ----
    @property
    def engine(self) -> ECCacheEngine:
        """The engine (shared with the other connectors of this process and config)."""
        return self._engine

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n

    def _failed(self, op: str, exc: BaseException) -> None:
        with self._lock:
            self._counters["errors"] += 1
            self._errors_by_op[op] = self._errors_by_op.get(op, 0) + 1
            now = time.monotonic()
            if now - self._last_log.get(op, -_LOG_EVERY_S) < _LOG_EVERY_S:
                return
            self._last_log[op] = now
            total = self._errors_by_op[op]
        logger.warning(
            "encoder-cache connector: %s failed (%d so far): %s: %s",
            op,
            total,
            type(exc).__name__,
            exc,
        )

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

    # ---- scheduler side ----
    def has_cache_item(self, identifier: str) -> bool:
        """True when the encoder output of ``identifier`` is cached (any tier); False on a miss
        or any failure (counted)."""
        try:
            hit = self._engine.contains(identifier)
        except Exception as exc:
            self._failed("has_cache_item", exc)
            return False
        with self._lock:
            self._counters["lookups"] += 1
            if hit:
                self._counters["lookup_hits"] += 1
        return hit

    def has_caches(self, request: Any) -> list[bool]:
        """One flag per multimodal item of ``request`` (the vLLM 0.11.1-0.14 API)."""
        try:
            n = item_count(request)
            ids = [item_identifier(request, i) for i in range(n)]
        except Exception as exc:
            self._failed("has_caches", exc)
            return [False] * _safe_len(request)
        return [self.has_cache_item(h) for h in ids]

    def update_state_after_alloc(self, request: Any, index: int) -> None:
        """Queue item ``index`` of ``request`` for loading this step when this connector
        consumes and the item is cached (items vLLM will compute are not queued)."""
        if not self.is_consumer:
            return
        try:
            mm_hash = item_identifier(request, index)
        except Exception as exc:
            self._failed("update_state_after_alloc", exc)
            return
        if self.has_cache_item(mm_hash):
            with self._lock:
                self._pending.add(mm_hash)

    def build_connector_meta(self, scheduler_output: Any = None) -> ECLoadMetadata:
        """The hashes queued since the last call, sorted; the queue is emptied."""
        with self._lock:
            hashes = sorted(self._pending)
            self._pending.clear()
        return self._metadata_cls(mm_hashes=hashes)

    # ---- worker side ----
    def start_load_caches(self, encoder_cache: MutableMapping[str, torch.Tensor], **kwargs: Any) -> None:
        """Fill ``encoder_cache`` with the entries the bound metadata lists and it lacks.

        Never overwrites an entry vLLM holds; loads onto the worker's device; no bound metadata
        is a no-op; metadata of another type raises ``TypeError``.
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
        try:
            device = self._load_device()
        except Exception as exc:
            self._failed("start_load_caches", exc)
            return
        for mm_hash in hashes:
            if mm_hash in encoder_cache:
                self._count("load_skipped_present")
                continue
            try:
                tensor = self._engine.get(mm_hash, device)
            except Exception as exc:
                self._failed("start_load_caches", exc)
                continue
            if tensor is None:
                self._count("load_misses")
                continue
            encoder_cache[mm_hash] = tensor
            self._count("loaded")

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
        self._count("saved" if ok else "save_rejected")

    # ---- lifecycle ----
    def close(self) -> None:
        """Release this connector's share of the engine (the last one closes it). Idempotent."""
        if self._closed:
            return
        self._closed = True
        token, self._token = self._token, None
        if token is not None:
            try:
                release_engine(token)
            except Exception as exc:  # pragma: no cover - shutdown must not raise
                self._failed("close", exc)

    shutdown = close

    def stats(self) -> dict[str, Any]:
        """Connector counters (errors per operation included) and the engine's stats."""
        with self._lock:
            out: dict[str, Any] = dict(self._counters)
            out["errors_by_op"] = dict(self._errors_by_op)
            out["pending"] = len(self._pending)
        out["role"] = self.role
        try:
            out["engine"] = self._engine.stats()
        except Exception as exc:  # a closed engine still reports its counters elsewhere
            out["engine"] = {"error": f"{type(exc).__name__}: {exc}"}
        return out


def _safe_len(request: Any) -> int:
    try:
        return item_count(request)
    except Exception:
        return 0
