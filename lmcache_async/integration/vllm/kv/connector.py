"""The class vLLM loads: ``LMCacheKVConnector``, a subclass of vLLM's ``KVConnectorBase_V1``.

Load it with::

    --kv-transfer-config '{"kv_connector": "LMCacheKVConnector",
                           "kv_connector_module_path": "lmcache_async.integration.vllm",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}'

Settings come from the normal engine config: ``kv_connector_extra_config`` may name a YAML
file (``config_file``) and give keys inline; ``LMCACHE_CONFIG_FILE`` and ``LMCACHE_<KEY>`` work
as everywhere (:func:`~.kv_engine.load_kv_connector_config`).

The scheduler-role instance answers lookups and plans loads and saves
(:mod:`.kv_scheduler`); the worker-role instance copies whole blocks between vLLM's paged caches
and the records (:mod:`.kv_worker`, :mod:`.kv_layout`). Both share one store per process
(:mod:`.kv_engine`). With ``enable_hidden_state_cache`` the worker's connector also owns a
:class:`~lmcache_async.engines.hidden_states.HiddenStateStore` over its KV manager,
``connector.hidden_state_store``; :meth:`LMCacheKVConnector.save_hidden_states` and
:meth:`LMCacheKVConnector.load_hidden_states` share hidden states across processes through the
KV tiers (:mod:`.kv_hidden`).

Only the part of a hit worth loading is offered: per-tier read costs and the engine's prefill
rate are measured and kept across processes (:mod:`.kv_costs`), lower tiers are located off the
scheduler thread (:mod:`.kv_lookup`; the hook answers None, "ask again", meanwhile), loads carry
deadlines the worker enforces, and a request whose load failed is never offered one again
(``load_policy``, ``max_load_s``; docs/vllm.md, "Load or recompute").

The connector declares vLLM's ``SupportsHMA``: with a model that mixes layer kinds (full and
sliding-window attention, ``extract_hidden_states``) vLLM keeps its hybrid KV-cache manager and
several KV-cache groups, and each chunk's record holds every attention group as a part
(:mod:`.kv_groups`; a sliding-window part only the blocks inside the window).

A cache fault never ends the engine or a request: lookups that fail are misses, loads that fail
are reported through ``get_block_ids_with_load_errors`` (vLLM recomputes those blocks when
``kv_load_failure_policy`` is ``"recompute"``; the connector warns at start-up otherwise) or,
with several KV-cache groups, where vLLM refuses block ids, by request (``failed_recving`` of
``get_transfer_results``: vLLM recomputes the request).
Importing this module imports vLLM; ``import lmcache_async.integration.vllm`` does not.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from lmcache_async.config import LMCacheEngineConfig
from lmcache_async.engines.hidden_states import HiddenStateStore
from lmcache_async.integration.vllm.kv.costs import CostBook, cost_book
from lmcache_async.integration.vllm.kv.event_reports import (
    LMCacheKVReports,
    SchedulerEvents,
    ServerDescriber,
    WorkerEventReports,
    events_enabled,
)
from lmcache_async.integration.vllm.kv.groups import NULL_BLOCK_ID, GroupLayout, describe_groups
from lmcache_async.integration.vllm.kv.hidden import publish_hidden_states, restore_hidden_states
from lmcache_async.integration.vllm.kv.layout import check_chunk_alignment
from lmcache_async.integration.vllm.kv.lookup import LoadSettings
from lmcache_async.integration.vllm.kv.metadata import KVStepMetadata
from lmcache_async.integration.vllm.kv.scheduler import KVSchedulerSide
from lmcache_async.integration.vllm.kv.store import (
    KVStore,
    acquire_store,
    find_worker_store,
    kv_dtype_of,
    load_kv_connector_config,
    release_store,
)
from lmcache_async.integration.vllm.kv.worker import KVWorkerSide
from lmcache_async.key_extras import KeyExtras
from lmcache_async.metadata import LMCacheEngineMetadata
from lmcache_async.storage_manager import StorageManager

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

__all__ = ["IDLE_STEP_WAIT_S", "PROBE_WAIT_S", "LMCacheKVConnector", "LMCacheKVConnectorMetadata"]

PROBE_WAIT_S = 10.0
"""How long the scheduler-role connector's construction waits for the start-up probe of the
lower tiers (each probe call is bounded by the tier's timeout; past this the probe goes on in
the background and the first lookups wait behind it)."""

IDLE_STEP_WAIT_S = 0.01
"""How long ``get_finished`` of a step with no tokens scheduled waits for an asynchronous load
in flight (a request arriving meanwhile waits at most this long more)."""


@dataclass
class LMCacheKVConnectorMetadata(KVConnectorMetadata, KVStepMetadata):
    """Scheduler → worker for one step: the load and save runs (:class:`KVStepMetadata`)."""


def tier_locations(config: LMCacheEngineConfig) -> dict[str, str]:
    """Where each configured lower tier is, as a short digest (the cost book keys its
    estimates by tier and location; a URL's credentials never reach the state file)."""
    where = {
        "disk": config.local_disk,
        "remote": config.remote_url,
        "server": config.cache_server_socket,
        "nixl": config.nixl_path,
    }
    return {t: hashlib.sha256(str(v).encode()).hexdigest()[:16] for t, v in where.items() if v}


def cost_file(config: LMCacheEngineConfig) -> str | None:
    """The load-cost state file: ``load_cost_file``, else ``<local_disk>.kv-costs.json`` beside
    the disk tier's directory, else None (estimates live in this process only)."""
    if config.load_cost_file:
        return os.path.expanduser(config.load_cost_file)
    if config.local_disk:
        return os.path.abspath(config.local_disk).rstrip(os.sep) + ".kv-costs.json"
    return None


def chunk_record_bytes(kv_cache_config: Any, groups: tuple[int, ...], blocks_per_chunk: int) -> int | None:
    """Bytes of one chunk's record (every layer of the attention groups ``groups``, its parts),
    from vLLM's ``KVCacheConfig``; None when it does not say."""
    try:
        total = 0
        for i in groups:
            g = kv_cache_config.kv_cache_groups[i]
            total += int(g.kv_cache_spec.page_size_bytes) * len(g.layer_names) * blocks_per_chunk
        return total or None
    except Exception:
        return None


def model_order(layer_name: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key putting layer names in model order: digit runs compare as numbers
    (``model.layers.2.self_attn.attn`` before ``model.layers.10.self_attn.attn``)."""
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"(\d+)", layer_name) if p)


def _worker_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_world_group

        return int(get_world_group().rank_in_group)
    except Exception:  # not initialised (a unit test building the worker role by hand)
        return 0


class LMCacheKVConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector over this project's tiered storage; see the module docstring.

    Declares ``SupportsHMA``: vLLM keeps its hybrid KV-cache manager on, and a model with
    several KV-cache groups (full and sliding-window attention) stores each chunk's groups as
    the parts of one record (:mod:`.kv_groups`). Groups it cannot restore (Mamba /
    linear-attention state) turn loads and saves off, with one warning naming them.

    Raises ``ValueError`` naming ``chunk_size`` at construction when it is not a multiple of
    vLLM's block size.
    """

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = self._kv_transfer_config
        policy = getattr(ktc, "kv_load_failure_policy", None)
        if policy != "recompute":
            logger.warning(
                "LMCacheKVConnector: kv_load_failure_policy is %r; set it to 'recompute' so that a "
                "failed cache load recomputes its blocks instead of failing the request",
                policy,
            )
        config = load_kv_connector_config(getattr(ktc, "kv_connector_extra_config", None) or {})
        self.groups: GroupLayout = describe_groups(kv_cache_config)
        self.block_size = self.groups.block_size or int(vllm_config.cache_config.block_size)
        self.blocks_per_chunk = check_chunk_alignment(config.chunk_size, self.block_size)
        model = vllm_config.model_config
        served = getattr(model, "served_model_name", None)
        if isinstance(served, (list, tuple)):
            served = served[0] if served else None
        model_name = str(served or model.model)
        kv_dtype = kv_dtype_of(getattr(vllm_config.cache_config, "cache_dtype", "auto"), model.dtype)
        world = int(vllm_config.parallel_config.world_size)
        is_worker = role == KVConnectorRole.WORKER
        rank = _worker_rank() if is_worker else 0
        self.metadata = LMCacheEngineMetadata(
            model_name=model_name,
            world_size=world,
            worker_id=rank,
            kv_dtype=kv_dtype,
            role="worker" if is_worker else "scheduler",
        )
        # Stores are shared by identity; the role is not part of it.
        ident = LMCacheEngineMetadata(model_name=model_name, world_size=world, worker_id=rank, kv_dtype=kv_dtype)
        self._ident = ident
        self._config = config
        lease, self.store = acquire_store(config, ident, role="worker" if is_worker else "scheduler")
        self._lease: tuple[Any, ...] | None = lease
        self.scheduler_side: KVSchedulerSide | None = None
        self.worker_side: KVWorkerSide | None = None
        self.costs: CostBook = cost_book(tier_locations(config), cost_file(config))
        per_request = self.groups.several  # vLLM refuses block ids there: failures go by request
        if is_worker:
            self.worker_side = KVWorkerSide(
                self.store.storage_manager,
                self.store.token_database,
                self.block_size,
                self.blocks_per_chunk,
                costs=self.costs,
                per_request_failures=per_request,
            )
        else:
            self._start_scheduler_side(config, kv_cache_config)
        self._event_reports: WorkerEventReports | None = None
        self._describer: ServerDescriber | None = None
        if events_enabled(vllm_config):
            self._start_events(world)

    def _start_events(self, world_size: int) -> None:
        """vLLM publishes KV events: the worker reports what its tiers hold and drop (the
        manager's removal listeners), the scheduler describes and publishes (:mod:`.kv_event_reports`)."""
        if self.worker_side is not None:
            reports = WorkerEventReports(self.store.storage_manager, self.metadata.worker_id)
            self.store.storage_manager.removals.add(reports.tier_removed)
            self.worker_side.reports = self._event_reports = reports
        elif self.scheduler_side is not None:
            chunk_size = self.block_size * self.blocks_per_chunk
            describer = None
            if "server" in self._lookup_manager().tier_names:  # lmcache-async serve --events publishes it
                describer = ServerDescriber(self._lookup_manager, self.store.token_database.make_key, world_size)
            self._describer = describer
            self.scheduler_side.events = SchedulerEvents(world_size, self.block_size, chunk_size, describer)

    def _start_scheduler_side(self, config: LMCacheEngineConfig, kv_cache_config: Any) -> None:
        """Build the scheduler side, probe the lower tiers (bounded) and register its metrics;
        warn once when some KV-cache group cannot be restored (nothing is loaded then)."""
        settings = LoadSettings(config.load_policy, config.max_load_s, config.load_margin, config.load_deadline_factor)
        if self.groups.unsupported:
            logger.warning(
                "LMCacheKVConnector: KV-cache group(s) %s hold state the connector cannot restore; "
                "it loads and saves nothing for this model (0 external tokens)",
                ", ".join(self.groups.unsupported),
            )
        chunk_bytes = chunk_record_bytes(kv_cache_config, self.groups.attention, self.blocks_per_chunk) or (1 << 20)
        self.scheduler_side = KVSchedulerSide(
            self._lookup_manager,
            self.store.token_database,
            self.block_size,
            self.blocks_per_chunk,
            costs=self.costs,
            settings=settings,
            chunk_bytes=chunk_bytes,
            per_request_failures=self.groups.several,
            lookup_give_up_s=2.0 * float(config.remote_timeout_s) + 1.0,
            groups=self.groups,
        )
        if config.load_policy != "never" and self.store.storage_manager.has_lower_tiers:
            probe = self.scheduler_side.lookups.start_probe(chunk_bytes)
            if probe is not None:  # engine start-up, not a step: the first request is priced
                with contextlib.suppress(Exception):
                    probe.result(timeout=PROBE_WAIT_S)
        self._metrics = None
        if self.store.metrics is not None:
            from lmcache_async.integration.vllm.kv.metrics import SchedulerMetrics

            self._metrics = SchedulerMetrics(self.scheduler_side)
            self.store.metrics.registry.register(self._metrics)

    def _lookup_manager(self) -> StorageManager:
        """A worker's manager of this process when there is one (it sees the CPU tier too)."""
        store: KVStore = self.store
        if store.lookup_only:
            worker = find_worker_store(self._config, self._ident)
            if worker is not None:
                store = worker
        return store.storage_manager

    # ---- hidden states ----
    @property
    def hidden_state_store(self) -> HiddenStateStore | None:
        """The hidden-state store over this connector's KV manager (worker role, with
        ``enable_hidden_state_cache``); None otherwise. Same keys as the KV records."""
        return self.store.hidden_state_store

    def save_hidden_states(
        self,
        token_ids: Any,
        hidden_states: torch.Tensor,
        layer_idx: int = 0,
        token_offset: int = 0,
        *,
        extras: KeyExtras | None = None,
    ) -> int:
        """Store hidden states (:meth:`HiddenStateStore.store_hidden_states` arguments) and
        publish them to the shared KV tiers; returns the chunks published. ``extras`` (the
        request's :class:`~lmcache_async.key_extras.KeyExtras`; :func:`.kv_request_keys.request_key_inputs`
        reads them from a vLLM request) key them as the request's KV is keyed. ``RuntimeError``
        when the connector has no hidden-state store (enable ``enable_hidden_state_cache``)."""
        hs = self._require_hs()
        return publish_hidden_states(
            hs, self.store.storage_manager, token_ids, hidden_states, layer_idx, token_offset, extras
        )

    def load_hidden_states(
        self, token_ids: Any, layer_idx: int = 0, max_tokens: int | None = None, *, extras: KeyExtras | None = None
    ) -> torch.Tensor | None:
        """Hidden states of the longest prefix of ``token_ids`` whose KV and hidden states are
        both stored under ``extras``, capped at ``max_tokens`` (pass the KV prefix vLLM
        restored); a fresh CPU float32 tensor the caller owns, or None. See
        :func:`.kv_hidden.restore_hidden_states`."""
        hs = self._require_hs()
        return restore_hidden_states(hs, self.store.storage_manager, token_ids, layer_idx, max_tokens, extras)

    def _require_hs(self) -> HiddenStateStore:
        hs = self.store.hidden_state_store
        if hs is None:
            raise RuntimeError(
                "this KV connector has no hidden-state store: set enable_hidden_state_cache "
                "(worker-role connectors only)"
            )
        return hs

    # ---- scheduler side ----
    def _sched(self) -> KVSchedulerSide:
        if self.scheduler_side is None:
            raise RuntimeError("a scheduler-side method was called on the worker-role KV connector")
        return self.scheduler_side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Keys the request from its token ids and key extras (images, LoRA adapter,
        ``cache_salt``, prompt embeddings: :mod:`.kv_request_keys`) and answers the stored prefix."""
        return self._sched().num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        block_ids = blocks.get_block_ids() if num_external_tokens > 0 else None
        self._sched().after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        step = self._sched().build_meta(scheduler_output)
        return LMCacheKVConnectorMetadata(
            loads=step.loads,
            saves=step.saves,
            async_loads=step.async_loads,
            idle=step.idle,
            hs_saves=step.hs_saves,
            hs_loads=step.hs_loads,
            num_tokens=step.num_tokens,
        )

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._sched().finished(request.request_id)
        return False, None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hook with the hybrid manager on: saves never outlive their step, so every
        group's blocks may be freed at once (False); the request is forgotten."""
        self._sched().finished(request.request_id)
        return False, None

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """How this step's loads went (failed ones are never offered again)."""
        if self.scheduler_side is not None:
            self.scheduler_side.after_step(connector_output)

    def take_events(self) -> Iterable[Any]:
        """The KV events since the last call (scheduler side, vLLM publishes them with its own):
        ``BlockStored`` when a chunk became durable on a tier, ``BlockRemoved`` when a tier
        dropped it; medium ``CPU`` or ``STORAGE``, ownership ``lmcache_async:<tier>``. Empty when
        vLLM runs without ``--kv-events-config``."""
        side = self.scheduler_side
        if side is None or side.events is None:
            return ()
        events: list[Any] = side.events.take_events()
        return events

    def get_kv_connector_kv_cache_events(self) -> LMCacheKVReports | None:
        """This worker's reports since the last step (saves durable on a tier, removals) for the
        scheduler's :meth:`update_connector_output`; None without KV events."""
        reports = self._event_reports
        if reports is None:
            return None
        return LMCacheKVReports(reports.take())

    # ---- worker side ----
    def _worker(self) -> KVWorkerSide:
        if self.worker_side is None:
            raise RuntimeError("a worker-side method was called on the scheduler-role KV connector")
        return self.worker_side

    def _step_meta(self) -> KVStepMetadata | None:
        meta = self._connector_metadata
        if meta is None:
            return None
        if not isinstance(meta, KVStepMetadata):
            raise TypeError(f"KV connector metadata must be LMCacheKVConnectorMetadata, got {type(meta).__name__}")
        return meta

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.groups.unsupported:  # the scheduler offers no load and plans no save
            logger.info("LMCacheKVConnector: no KV records for this model (groups %s)", self.groups.unsupported)
            return
        layers, parts = self._record_layers(self._attention_layers_only(kv_caches))
        null = NULL_BLOCK_ID if self.groups.several or self.groups.windowed else None
        caches = self._worker().register(layers, layer_parts=parts, null_block=null)
        logger.info(
            "LMCacheKVConnector: %d layers, layout %s, record %s %s (%d bytes per chunk of %d tokens)",
            caches.num_layers,
            caches.layout.name,
            caches.record_shape,
            caches.dtype,
            caches.record_bytes,
            self.block_size * self.blocks_per_chunk,
        )

    def _record_layers(self, kv_caches: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[int] | None]:
        """The layers of the record's parts and each one's part (None: one group, every layer
        in part 0). Layers of groups the connector does not restore are left out. With several
        groups vLLM hands the layers group by group; the record keeps them in model order (as
        one group has them), so an engine running the same model with the hybrid manager off
        reads the same records layer for layer."""
        if not self.groups.several:
            return kv_caches, None
        names = sorted((n for n in kv_caches if self.groups.position(n) is not None), key=model_order)
        if not names:  # no attention group: nothing is loaded or saved (the scheduler offers none)
            return kv_caches, None
        return {n: kv_caches[n] for n in names}, [self.groups.position(n) or 0 for n in names]

    def _attention_layers_only(self, kv_caches: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``kv_caches`` without the hidden-state layers of vLLM's ``extract_hidden_states`` path
        (``CacheOnlyAttentionLayer``: ``[blocks, aux layers, block_size, hidden]``, not K/V).
        Those are not part of a KV record: a model runner stores hidden states through
        :attr:`hidden_state_store`. Unchanged when this vLLM has no such layers."""
        try:
            from vllm.config import get_layers_from_vllm_config
            from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer
        except ImportError:
            return kv_caches
        try:
            skip = set(get_layers_from_vllm_config(self._vllm_config, CacheOnlyAttentionLayer, list(kv_caches)))
        except Exception:  # an unexpected config shape: keep every layer (register() checks them)
            return kv_caches
        if skip:
            logger.info("LMCacheKVConnector: %s hold hidden states, not KV; left out of KV records", sorted(skip))
        return {name: t for name, t in kv_caches.items() if name not in skip}

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """vLLM hands the step's metadata before the forward: the step's clock starts (the
        worker times steps that compute many tokens: the engine's prefill rate)."""
        super().bind_connector_metadata(connector_metadata)
        if self.worker_side is not None:
            self.worker_side.step_started(time.perf_counter())

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._step_meta()
        if meta is not None and (meta.loads or meta.async_loads):
            self._worker().load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: :meth:`start_load_kv` completes every synchronous load before
        the forward (asynchronous ones fill blocks this step does not read)."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        """Nothing per layer: records hold every layer of a chunk, saved in :meth:`wait_for_save`."""

    def wait_for_save(self) -> None:
        meta = self._step_meta()
        if meta is not None and self.worker_side is not None:
            self.worker_side.step_computed(meta.num_tokens, time.perf_counter())
        if meta is not None and meta.saves:
            self._worker().save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """No saves outlive their step; the requests whose asynchronous load ended. In a step
        that schedules no tokens, waits up to :data:`IDLE_STEP_WAIT_S` for a load in flight."""
        if self.worker_side is None:
            return None, None
        meta = self._step_meta()
        wait_s = IDLE_STEP_WAIT_S if meta is not None and meta.idle else 0.0
        return None, self.worker_side.finished_loads(wait_s) or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """:meth:`get_finished`'s requests, and those whose asynchronous load failed or was
        abandoned when vLLM has more than one KV-cache group (it takes no block ids there)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

        _, recving = self.get_finished(finished_req_ids)
        failed = self.worker_side.take_failed_requests() if self.worker_side is not None else set()
        return KVConnectorTransferResults(finished_recving=set(recving or ()) | failed, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self.worker_side is None:
            return set()
        return self.worker_side.take_load_errors()

    # ---- introspection and teardown ----
    def stats(self) -> dict[str, Any]:
        """Counters of this connector's side and its manager's per-tier stats."""
        if self.worker_side is not None:
            out_w = self.worker_side.stats()
            if self._event_reports is not None:
                out_w["events"] = dict(self._event_reports.counters)
            return out_w
        out: dict[str, Any] = self._sched().stats()
        if self._sched().events is not None:
            out["events"] = self._sched().events.stats()
            if self._describer is not None:
                out["events"]["describe"] = dict(self._describer.counters)
        out["manager"] = self._lookup_manager().stats()
        return out

    def flush(self) -> None:
        """Wait until every pending lower-tier write of this process's store is done."""
        self.store.storage_manager.flush_sync()

    def shutdown(self) -> None:
        reports, self._event_reports = getattr(self, "_event_reports", None), None
        describer, self._describer = getattr(self, "_describer", None), None
        if describer is not None:
            describer.close()
        if reports is not None:
            self.store.storage_manager.removals.discard(reports.tier_removed)
        if self.worker_side is not None:
            self.worker_side.close()
        if self.scheduler_side is not None:
            self.scheduler_side.close()
            metrics, server = getattr(self, "_metrics", None), self.store.metrics
            if metrics is not None and server is not None:
                with contextlib.suppress(Exception):  # the exporter may be closed already
                    server.registry.unregister(metrics)
        self.costs.save(force=True)
        lease, self._lease = self._lease, None
        if lease is not None:
            release_store(lease)
