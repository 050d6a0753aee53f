"""The KV connector's storage: its configuration and the per-process shared KV store.

:class:`KVStore` bundles what both halves of the connector use: a :class:`StorageManager`
(named ``kv``), the :class:`ChunkedTokenDatabase` that keys its records (model, world size,
rank, KV dtype, prefix-chained chunk hash: the same keys the hidden-state store uses) and,
when ``enable_hidden_state_cache`` is set, a :class:`HiddenStateStore` over that manager.

Sharing within a process: :func:`acquire_store` hands every connector with the same
configuration and identity one store (vLLM's default single-worker engine core runs the
scheduler-role and the worker-role connector in one process, so a CPU-only cache serves both).
A scheduler that finds no store of a worker in its process builds a lookup-only one without
a CPU pool: it then sees only the shared tiers (``local_disk``, ``remote_url``, NIXL), exactly
the entries a worker in another process can read.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

import torch

from lmcache_async.config import CONFIG_FILE_ENV, LMCacheEngineConfig, load_engine_config
from lmcache_async.dtypes import dtype_name
from lmcache_async.engines.hidden_states import HiddenStateStore
from lmcache_async.metadata import LMCacheEngineMetadata
from lmcache_async.metrics import serve_configured_metrics
from lmcache_async.storage_manager import StorageManager
from lmcache_async.token_database import ChunkedTokenDatabase

logger = logging.getLogger(__name__)

__all__ = ["CONFIG_FILE_KEY", "KVStore", "acquire_store", "load_kv_connector_config", "release_store"]

CONFIG_FILE_KEY = "config_file"
"""``kv_connector_extra_config`` key naming a YAML config file (else ``$LMCACHE_CONFIG_FILE``)."""


def load_kv_connector_config(extra_config: Mapping[str, Any] | None = None) -> LMCacheEngineConfig:
    """The engine config of the KV connector.

    The YAML named by ``extra_config["config_file"]`` (else ``$LMCACHE_CONFIG_FILE``), then
    ``LMCACHE_<KEY>`` env vars, then the other ``extra_config`` keys given inline (any key of
    :class:`LMCacheEngineConfig`). Unknown inline keys are logged and dropped; invalid values
    raise the config's error naming the key and ``kv_connector_extra_config`` as the source.
    """
    extra = dict(extra_config or {})
    path = extra.pop(CONFIG_FILE_KEY, None)
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"kv_connector_extra_config[{CONFIG_FILE_KEY!r}] must be a path, got {type(path).__name__}")
    config = load_engine_config(path if path else os.environ.get(CONFIG_FILE_ENV) or None)
    fields = LMCacheEngineConfig.model_fields
    for key, value in extra.items():
        if key in fields:
            config.set(key, value, "kv_connector_extra_config")
        else:
            logger.warning("unknown kv_connector_extra_config key %r dropped", key)
    return config


class KVStore:
    """A KV manager, its token database and (optionally) its hidden-state store.

    ``lookup_only`` builds the manager without a CPU pool (a scheduler with no worker in its
    process: only shared tiers answer). Closing closes the hidden-state store, then the manager.
    """

    def __init__(self, config: LMCacheEngineConfig, metadata: LMCacheEngineMetadata, *, lookup_only: bool = False):
        if config.save_unfull_chunk:
            # Records hold whole blocks of whole chunks; a partial tail chunk is never stored.
            config = config.clone()
            config.save_unfull_chunk = False
        self.config = config
        self.metadata = metadata
        self.lookup_only = lookup_only
        self.token_database = ChunkedTokenDatabase(config.chunk_size, False, metadata)
        self.storage_manager = StorageManager(config, metadata, name="kv", cpu_size_gib=0.0 if lookup_only else None)
        self.hidden_state_store: HiddenStateStore | None = None
        if config.enable_hidden_state_cache and not lookup_only:
            try:
                self.hidden_state_store = HiddenStateStore(
                    config, metadata, token_database=self.token_database, kv_storage_manager=self.storage_manager
                )
            except BaseException:
                self.storage_manager.close_sync()
                raise
        #: The Prometheus exporter serving this store (when ``metrics_port`` is set), else None.
        self.metrics = serve_configured_metrics(self.storage_manager, config)

    @property
    def closed(self) -> bool:
        return self.storage_manager.closed

    def close(self) -> None:
        """Close the hidden-state store and the manager (idempotent)."""
        if self.hidden_state_store is not None and not self.hidden_state_store.closed:
            self.hidden_state_store.close()
        if not self.storage_manager.closed:
            self.storage_manager.close_sync()


class _Entry:
    __slots__ = ("pid", "refs", "store")

    def __init__(self, store: KVStore) -> None:
        self.store = store
        self.refs = 0
        self.pid = os.getpid()


_stores: dict[tuple[Any, ...], _Entry] = {}
_lock = threading.Lock()


def _token(config: LMCacheEngineConfig, metadata: LMCacheEngineMetadata, lookup_only: bool) -> tuple[Any, ...]:
    fingerprint = json.dumps(config.to_dict(), sort_keys=True, default=str)
    m = metadata
    return (os.getpid(), fingerprint, m.model_name, m.world_size, m.worker_id, dtype_name(m.kv_dtype), lookup_only)


def _live(token: tuple[Any, ...]) -> _Entry | None:
    entry = _stores.get(token)
    if entry is not None and (entry.pid != os.getpid() or entry.store.closed):
        del _stores[token]  # inherited through fork, or closed behind our back
        return None
    return entry


def acquire_store(
    config: LMCacheEngineConfig, metadata: LMCacheEngineMetadata, *, role: str
) -> tuple[tuple[Any, ...], KVStore]:
    """The process-wide store for (config, identity); returns ``(lease, store)``.

    ``role`` is ``"worker"`` or ``"scheduler"``. A worker gets (or creates) the full store; a
    scheduler gets a worker's store of the same identity when this process has one, else a
    lookup-only store (see the module docstring). Give the lease back with
    :func:`release_store`; the last release closes the store.
    """
    if role not in ("worker", "scheduler"):
        raise ValueError(f"role must be 'worker' or 'scheduler', got {role!r}")
    full = _token(config, metadata, False)
    with _lock:
        entry = _live(full)
        if entry is None and role == "scheduler":
            token = _token(config, metadata, True)
            entry = _live(token)
            if entry is None:
                entry = _stores[token] = _Entry(KVStore(config, metadata, lookup_only=True))
        elif entry is None:
            token = full
            entry = _stores[token] = _Entry(KVStore(config, metadata))
        else:
            token = full
        entry.refs += 1
        return (token, entry), entry.store


def find_worker_store(config: LMCacheEngineConfig, metadata: LMCacheEngineMetadata) -> KVStore | None:
    """The full (worker) store of this identity in this process, or None."""
    with _lock:
        entry = _live(_token(config, metadata, False))
        return None if entry is None else entry.store


def release_store(lease: tuple[Any, ...]) -> None:
    """Give back one reference taken by :func:`acquire_store` (closing the store at zero)."""
    token, entry = lease
    with _lock:
        if entry.refs <= 0:
            return
        entry.refs -= 1
        if entry.refs > 0:
            return
        if _stores.get(token) is entry:
            del _stores[token]
    try:
        entry.store.close()
    except Exception:  # closing must never fail vLLM's shutdown
        logger.warning("KV connector: closing the store failed", exc_info=True)


def kv_dtype_of(cache_dtype: object, model_dtype: object) -> torch.dtype:
    """The KV dtype keys carry: vLLM's ``cache_dtype`` unless it is ``"auto"`` (the model's)."""
    if isinstance(cache_dtype, torch.dtype):
        return cache_dtype
    name = str(cache_dtype or "auto").lower()
    if name == "auto":
        if isinstance(model_dtype, torch.dtype):
            return model_dtype
        from lmcache_async.dtypes import parse_dtype

        return parse_dtype(str(model_dtype))
    fp8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
    if name in fp8:
        return fp8[name]
    from lmcache_async.dtypes import parse_dtype

    return parse_dtype(name)
