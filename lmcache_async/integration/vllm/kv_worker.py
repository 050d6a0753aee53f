"""The worker half of the KV connector: records ↔ vLLM's paged KV blocks.

Framework-free (no vLLM import). Runs on vLLM's model-runner thread.

* **Load** (:meth:`KVWorkerSide.load`, from ``start_load_kv``): one batched read of the chunk
  records of every load run, then whole-block scatters into every layer. Synchronous runs are
  done before the forward; asynchronous ones (lower-tier hits) run on the connector's load
  thread (``lmcache-async-kv-load``) into blocks vLLM keeps for them and no one else touches
  until :meth:`finished_loads` reports their request. A chunk whose record
  is missing, unreadable, or of another shape or dtype stops that run: its blocks and every
  later block of the run are reported by :meth:`take_load_errors`, and vLLM (with
  ``kv_load_failure_policy="recompute"``) recomputes them. Nothing raises into the step.
* **Save** (:meth:`KVWorkerSide.save`, from ``wait_for_save``): each planned chunk the CPU tier
  does not already hold is gathered straight into a block of the manager's pool (one copy)
  and put (borrowed: no second copy); lower tiers are written through in the background. A full
  pool stops the run (counted): a later request stores it.

Every record is ``[num_layers, *blocks of one chunk]`` in the caches' dtype
(:mod:`.kv_layout`). The manager's returned ``MemoryObj`` references are always released.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Mapping
from typing import Any

import torch

from lmcache_async.integration.vllm.kv_layout import PagedCaches, gather_blocks, scatter_blocks
from lmcache_async.integration.vllm.kv_metadata import BlockRun, KVStepMetadata
from lmcache_async.memory import MemoryFormat, MemoryObj
from lmcache_async.ratelog import RateLimitedLog
from lmcache_async.storage_manager import StorageManager
from lmcache_async.token_database import ChunkedTokenDatabase

logger = logging.getLogger(__name__)

__all__ = ["KVWorkerSide"]

COUNTER_NAMES = (
    "load_runs",
    "loaded_chunks",
    "loaded_blocks",
    "loaded_bytes",
    "load_failures",
    "failed_blocks",
    "saved_chunks",
    "saved_bytes",
    "save_skipped",
    "save_rejected",
    "errors",
)


class KVWorkerSide:
    """Worker-side state over ``manager``; call :meth:`register` before loads and saves."""

    def __init__(
        self, manager: StorageManager, token_database: ChunkedTokenDatabase, block_size: int, blocks_per_chunk: int
    ) -> None:
        self.manager = manager
        self.db = token_database
        self.block_size = block_size
        self.blocks_per_chunk = blocks_per_chunk
        self.caches: PagedCaches | None = None
        self._stream: Any = None
        self._errors: set[int] = set()
        self._lock = threading.Lock()  # errors and counters: the load thread updates them too
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._inflight: dict[str, concurrent.futures.Future[None]] = {}
        self._log = RateLimitedLog(logger)
        self.counters: dict[str, int] = dict.fromkeys(COUNTER_NAMES, 0)

    def _add(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                self.counters[k] += v

    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> PagedCaches:
        """Adopt vLLM's per-layer caches (``ValueError`` for a layout the connector cannot copy)."""
        self.caches = PagedCaches(kv_caches, self.block_size, self.blocks_per_chunk)
        if self.caches.device.type == "cuda":
            self._stream = torch.cuda.Stream(self.caches.device)
        return self.caches

    def _fault(self, what: str, exc: BaseException) -> None:
        self._add(errors=1)
        self._log.warning("KV connector: %s failed: %s: %s", what, type(exc).__name__, exc, key=what)

    # ---- load ----
    def load(self, meta: KVStepMetadata) -> None:
        """Do this step's synchronous loads and start its asynchronous ones; failures are
        recorded for :meth:`take_load_errors`."""
        for run in meta.loads:
            self._load_guarded(run)
        for run in meta.async_loads:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lmcache-async-kv-load")
            try:
                self._inflight[run.req_id] = self._executor.submit(self._load_guarded, run)
            except RuntimeError as exc:  # shut down: the load is a failure, reported at once
                self._fault("load", exc)
                self._fail(run.block_ids)
                done: concurrent.futures.Future[None] = concurrent.futures.Future()
                done.set_result(None)
                self._inflight[run.req_id] = done

    def _load_guarded(self, run: BlockRun) -> None:
        try:
            self._load_run(run)
        except Exception as exc:  # a wiring or storage surprise: recompute the whole run
            self._fault("load", exc)
            self._fail(run.block_ids)

    def finished_loads(self) -> set[str]:
        """Requests whose asynchronous load ended (loaded or failed) since the last call; their
        failed blocks are already in :meth:`take_load_errors`."""
        done = {req_id for req_id, fut in self._inflight.items() if fut.done()}
        for req_id in done:
            del self._inflight[req_id]
        return done

    def _fail(self, block_ids: Any) -> None:
        ids = list(block_ids)
        if ids:
            with self._lock:
                self.counters["load_failures"] += 1
                self.counters["failed_blocks"] += len(ids)
                self._errors.update(ids)

    def _load_run(self, run: BlockRun) -> None:
        caches = self.caches
        if caches is None:
            self._fail(run.block_ids)
            return
        self._add(load_runs=1)
        chunks = run.chunks(self.blocks_per_chunk)
        keys = self.db.make_keys([c[0] for c in chunks])
        try:
            objs: list[MemoryObj | None] = self.manager.batched_get_sync(keys)
        except Exception as exc:  # timeout, closed tier: the whole run is recomputed
            self._fault("load", exc)
            self._fail(run.block_ids)
            return
        done = 0
        try:
            for key, (_, _, first, bids), obj in zip(keys, chunks, objs, strict=True):
                if obj is None:
                    break
                rec = obj.tensor
                if tuple(rec.shape) != caches.record_shape or rec.dtype != caches.dtype:
                    self._log.warning(
                        "KV connector: record %s is %s %s, expected %s %s; recomputing",
                        key,
                        tuple(rec.shape),
                        rec.dtype,
                        caches.record_shape,
                        caches.dtype,
                        key="shape",
                    )
                    break
                scatter_blocks(caches, bids, rec, first, self._stream)
                done += len(bids)
                self._add(
                    loaded_chunks=1,
                    loaded_blocks=len(bids),
                    loaded_bytes=caches.record_bytes * len(bids) // self.blocks_per_chunk,
                )
        finally:
            for obj in objs:
                if obj is not None:
                    obj.ref_count_down()
        self._fail(run.block_ids[done:])

    def take_load_errors(self) -> set[int]:
        """Block ids whose load failed since the last call (vLLM recomputes them); clears."""
        with self._lock:
            errors, self._errors = self._errors, set()
        return errors

    # ---- save ----
    def save(self, meta: KVStepMetadata) -> None:
        """Store this step's completed chunks; never raises (faults are counted and logged)."""
        for run in meta.saves:
            try:
                self._save_run(run)
            except Exception as exc:
                self._fault("save", exc)

    def _save_run(self, run: BlockRun) -> None:
        caches = self.caches
        if caches is None:
            return
        sm = self.manager
        for chunk_hash, _, first, bids in run.chunks(self.blocks_per_chunk):
            if first != 0 or len(bids) != self.blocks_per_chunk:
                continue  # only whole chunks are records
            key = self.db.make_key(chunk_hash)
            if sm.holds_locally(key):
                self._add(save_skipped=1)
                continue
            obj = sm.allocate(caches.record_shape, caches.dtype, MemoryFormat.UNDEFINED)
            if obj is None:
                self._add(save_rejected=1)
                return
            try:
                gather_blocks(caches, bids, obj.tensor, self._stream)
                if self._stream is not None:
                    self._stream.synchronize()
                ok = sm.put_sync(key, obj, MemoryFormat.UNDEFINED)
            finally:
                obj.ref_count_down()
            if not ok:
                self._add(save_rejected=1)
                return
            self._add(saved_chunks=1, saved_bytes=caches.record_bytes)

    def stats(self) -> dict[str, Any]:
        """The worker's counters and the manager's per-tier stats."""
        with self._lock:
            out: dict[str, Any] = dict(self.counters)
        out["loads_in_flight"] = len(self._inflight)
        out["manager"] = self.manager.stats()
        return out

    def close(self) -> None:
        """Wait for asynchronous loads in flight (each bounded by the manager's timeouts)."""
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)
