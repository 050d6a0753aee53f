"""The worker side of the encoder-cache connector: loading promised entries, saving new ones.

:class:`ECWorkerSide` fills vLLM's encoder cache with what this step's metadata lists (from the
scheduler's hand-off, the engine or a disk lease), stores what a producer encoded, and reports
failed loads and counter increments to the scheduler. Every method runs on vLLM's model-runner
thread.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

import torch

from lmcache_async.dtypes import parse_dtype
from lmcache_async.engines.encoder_cache import ECCacheEngine
from lmcache_async.integration.vllm.ec.counters import ECCounters, describe_error
from lmcache_async.integration.vllm.ec.engines import Handoff, release_entry
from lmcache_async.integration.vllm.ec.vllm_objects import ECLoadMetadata, worker_device
from lmcache_async.records import RecordError
from lmcache_async.tiers import PromiseLeases

__all__ = ["ECWorkerSide"]


class ECWorkerSide(ECCounters):
    """Worker-side half of :class:`~lmcache_async.integration.vllm.ec.impl.LMCacheECConnectorImpl`.

    The connector's constructor sets the shared attributes declared below, then calls
    :meth:`_init_worker_side`.
    """

    is_producer: bool
    _vllm_config: Any
    _parent: Any
    _metadata_cls: type[ECLoadMetadata]
    _engine: ECCacheEngine
    _leases: PromiseLeases | None
    _handoff: Handoff

    def _init_worker_side(self) -> None:
        """Empty worker-side state: device not resolved yet, no failed load to report."""
        self._device: torch.device | None = None
        self._failed_loads: set[str] = set()

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
                release_entry(held)
            self._count("load_skipped_present")
            return
        tensor: torch.Tensor | None = None
        source = ""
        if held is not None:
            try:
                src = held.tensor
                tensor = src.clone() if device.type == "cpu" else src.to(device=device, copy=True)
            finally:
                release_entry(held)
            source = "loaded_from_hold"
        if tensor is None:
            tensor = self._engine.get(mm_hash, device)
        if tensor is None and lease is not None and self._leases is not None and self._leases.owns(lease):
            try:
                tensor = self._leases.read(lease, self._engine.key(mm_hash)).to(device)
                source = "loaded_from_lease"
            except (OSError, RecordError) as exc:
                self._log("lease", "encoder-cache connector: lease of %s unreadable: %s", mm_hash, describe_error(exc))
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
