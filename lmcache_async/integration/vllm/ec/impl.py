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
  processes get a disk lease (:mod:`.leases`), or a server hold (:mod:`.ec_server_leases`)
  when the shared tier is the cache server with no disk tier, so eviction or deletion after the
  promise cannot make the load miss.
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

Layout: this module builds the connector and owns its lifecycle and :meth:`stats`; the
scheduler half lives in :mod:`.ec_scheduler`, the worker half in :mod:`.ec_worker`, the counters
in :mod:`.ec_counters`, the per-process engines and hand-off tables in :mod:`.ec_engines`, the
configuration in :mod:`.ec_config` and the reading of vLLM objects in :mod:`.ec_vllm_objects`.
Every public name of those modules that callers used from here is re-exported (``__all__``).
"""

from __future__ import annotations

import logging
from typing import Any

from lmcache_async.dtypes import dtype_name
from lmcache_async.engines.encoder_cache import ECCacheEngine
from lmcache_async.integration.vllm.ec.config import (
    CONFIG_FILE_KEY,
    CONNECTOR_KEYS,
    load_connector_config,
)
from lmcache_async.integration.vllm.ec.counters import COUNTERS, describe_error
from lmcache_async.integration.vllm.ec.engines import acquire_engine, handoff_of, release_engine
from lmcache_async.integration.vllm.ec.scheduler import ECSchedulerSide
from lmcache_async.integration.vllm.ec.vllm_objects import (
    DEFAULT_ENCODER_DTYPE,
    DEFAULT_MODEL_NAME,
    ECLoadMetadata,
    connector_roles,
    item_count,
    item_identifier,
    model_identity,
    role_name,
    worker_device,
)
from lmcache_async.integration.vllm.ec.worker import ECWorkerSide

__all__ = [
    "CONFIG_FILE_KEY",
    "CONNECTOR_KEYS",
    "COUNTERS",
    "DEFAULT_ENCODER_DTYPE",
    "DEFAULT_MODEL_NAME",
    "ECLoadMetadata",
    "LMCacheECConnectorImpl",
    "acquire_engine",
    "connector_roles",
    "handoff_of",
    "item_count",
    "item_identifier",
    "load_connector_config",
    "model_identity",
    "release_engine",
    "worker_device",
]

logger = logging.getLogger(__name__)


class LMCacheECConnectorImpl(ECSchedulerSide, ECWorkerSide):
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
        self.role = role_name(role)
        self.is_producer, self.is_consumer = connector_roles(vllm_config, parent)
        self._metadata_cls = metadata_cls
        self._init_counters(logger)
        self._init_worker_side()
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
        self._cpu_lookup = sm.lookup_local
        self._has_lower = sm.has_lower_tiers
        # The disk tier's leases (hard-linked records, sealed like the tier's own) when it has one.
        self._leases = sm.leases(knobs["lease_max_age_s"], tier="disk")
        self._handoff = handoff_of(self._engine)
        self._is_worker = self.role == "worker"
        if self._is_worker:
            with self._handoff.lock:
                self._handoff.workers += 1
        self._init_scheduler_side()
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

    @property
    def engine(self) -> ECCacheEngine:
        """The engine (shared with the other connectors of this process and config)."""
        return self._engine

    # ---- stats ----
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
            out["engine"] = {"error": describe_error(exc)}
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
