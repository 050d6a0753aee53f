"""The worker half of the KV connector: records ↔ vLLM's paged KV blocks.

Framework-free (no vLLM import). Runs on vLLM's model-runner thread.

* **Load** (:meth:`KVWorkerSide.load`, from ``start_load_kv``). Host caches (vLLM's CPU
  layout): records are read straight into the request's blocks
  (:meth:`~lmcache_async.storage_manager.StorageManager.read_into_sync`, one
  :class:`~lmcache_async.read_sinks.ReadSink` per chunk: a CPU-tier hit is one ``memmove`` per
  run of consecutive blocks, a node-server hit the same after one round trip, a disk record one
  ``preadv`` checked in place). Synchronous runs are done before the forward; asynchronous ones
  (lower-tier hits) are read on the load thread (``lmcache-async-kv-load``, no torch call, so no
  OpenMP team against vLLM's compute thread) into blocks vLLM keeps for the request, and
  :meth:`finished_loads` (from ``get_finished``) reports a request once its read returned.
  Device caches: records are read into host pool blocks and copied to the device on the
  model-runner thread. A chunk whose record is missing, unreadable, or of another shape or dtype
  stops that run: its blocks and every later block are reported by :meth:`take_load_errors`, and
  vLLM (``kv_load_failure_policy="recompute"``) recomputes them. Nothing raises into the step.
  With several KV-cache groups (each a part of every record, :mod:`.kv_groups`) vLLM takes no
  block ids: a failed load is reported by request (:meth:`KVWorkerSide.take_failed_requests`;
  the scheduler makes every load asynchronous there), and vLLM recomputes the whole request.
* **Deadlines** (load or recompute): an asynchronous run is read in pieces (split where the
  tier changes; :data:`PIECE_BYTES`, or what the tier reads in :data:`PIECE_S` when that is
  more), and before each piece the load thread
  checks the run's ``deadline_s`` (counted from when the step handed it over). Past it, the
  load is abandoned at that chunk boundary: the piece in flight is waited out — it is bounded
  by the tier's own timeouts, and the loop-side tiers read into buffers the manager owns and
  copy on the load thread, so after the thread stops nothing writes into vLLM's blocks — and
  the rest of the run is reported failed (recomputed). Waiting out one piece beats staging
  every slow read: staging would copy every byte twice on a hit that was judged worth loading.
  Each piece's time feeds the :class:`~.kv_costs.CostBook` (bytes, seconds per tier), the
  late piece of an abandoned load included, so a slow tier is priced by what it did; a failing
  tier (its breaker open) is priced unavailable for a while. An abandon alone does not price a
  tier out: one slow first read of a fresh process must not keep a fast tier from every later
  hit. The model-runner thread also
  times steps that compute many tokens: the engine's prefill rate.
* **Save** (:meth:`KVWorkerSide.save`, from ``wait_for_save``): each planned chunk the CPU tier
  does not already hold is gathered straight into a block of the manager's pool (one copy; on
  host caches all of the step's records at once, by address: one ``index_select`` per layer
  over the records the pool laid out one after another, a ``memmove`` per run of blocks per
  layer for the others; a manager without a CPU tier, e.g. on the node server alone, gets a
  host tensor it copies from); then the run's chunks are put in one batch (borrowed: no second
  copy), and lower tiers are written through in the background, woken once the whole save is
  done (``StorageManager.batched_writes``). A full pool stops the run (counted): a later
  request stores the rest.

Every record is ``[num_layers, *blocks of one chunk]`` in the caches' dtype
(:mod:`.kv_layout`). The manager's returned ``MemoryObj`` references are always released.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import math
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from lmcache_async.engines.hidden_states import HiddenStateStore, hs_entry_key
from lmcache_async.integration.vllm.kv.costs import CostBook
from lmcache_async.integration.vllm.kv.gather import gather_chunks
from lmcache_async.integration.vllm.kv.hs_group import HiddenStateGroup, load_hs_run, save_hs_run
from lmcache_async.integration.vllm.kv.layout import PagedCaches, scatter_blocks
from lmcache_async.integration.vllm.kv.metadata import BlockRun, HSRun, KVStepMetadata
from lmcache_async.memory import MemoryFormat, MemoryObj
from lmcache_async.ratelog import RateLimitedLog
from lmcache_async.storage_manager import StorageManager
from lmcache_async.token_database import ChunkedTokenDatabase

logger = logging.getLogger(__name__)

__all__ = ["PIECE_BYTES", "PREFILL_SAMPLE_TOKENS", "KVWorkerSide"]

PIECE_BYTES = 4 << 20
"""Least bytes of a piece of an asynchronous load (one read call; the deadline is checked
between calls), unless a record is larger: a piece is one record at least."""
PIECE_S = 0.1
"""A piece may grow to what its tier is expected to read in this long (a fast tier reads a
whole run in one call; a slow one stops within about this long of its deadline)."""
PREFILL_SAMPLE_TOKENS = 256
"""A step computing at least this many tokens is a sample of the engine's prefill rate."""

COUNTER_NAMES = (
    "load_runs",
    "async_load_runs",
    "loaded_chunks",
    "loaded_blocks",
    "loaded_bytes",
    "load_failures",
    "failed_blocks",
    "abandoned_loads",
    "abandoned_blocks",
    "failed_requests",
    "saved_chunks",
    "saved_bytes",
    "save_skipped",
    "save_rejected",
    "hs_saved_runs",
    "hs_loaded_tokens",
    "hs_short_loads",
    "errors",
)


@dataclass
class _Fetched:
    """The records one load run read: the caller's references until :meth:`release`."""

    keys: list[Any]
    chunks: list[tuple[int, int, int, list[int]]]
    objs: list[MemoryObj | None]
    filled: int | None = None
    """Blocks of the run already read straight into vLLM's caches (host caches); None: the
    records in ``objs`` are still to be scattered."""
    prefetched: list[MemoryObj | None] = field(default_factory=list)
    """Published hidden-state records read beside the KV (held so they stay in the CPU tier
    until the model-runner thread restores them)."""

    def release(self) -> None:
        objs, self.objs = self.objs, []
        extra, self.prefetched = self.prefetched, []
        for obj in objs + extra:
            if obj is not None:
                obj.ref_count_down()


class KVWorkerSide:
    """Worker-side state over ``manager``; call :meth:`register` before loads and saves."""

    def __init__(
        self,
        manager: StorageManager,
        token_database: ChunkedTokenDatabase,
        block_size: int,
        blocks_per_chunk: int,
        hidden_state_store: HiddenStateStore | None = None,
        *,
        costs: CostBook | None = None,
        per_request_failures: bool = False,
    ) -> None:
        self.manager = manager
        self.costs = costs
        self.per_request_failures = per_request_failures
        self._failed_reqs: set[str] = set()
        self._step_t0: float | None = None
        self.hs = hidden_state_store
        self.hs_group: HiddenStateGroup | None = None
        self.recent_hs_runs: collections.deque[tuple[str, HSRun]] = collections.deque(maxlen=16)
        """The latest hidden-state runs done (``("save" | "load", run)``), for inspection."""
        self.db = token_database
        self.block_size = block_size
        self.blocks_per_chunk = blocks_per_chunk
        self.caches: PagedCaches | None = None
        self._stream: Any = None
        self._errors: set[int] = set()
        self._lock = threading.Lock()  # errors and counters: the load thread updates them too
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._inflight: dict[str, tuple[BlockRun, concurrent.futures.Future[_Fetched | None], HSRun | None]] = {}
        self._log = RateLimitedLog(logger)
        self.counters: dict[str, int] = dict.fromkeys(COUNTER_NAMES, 0)
        self.reports: Any = None
        """The KV events' worker half (:class:`~.kv_event_reports.WorkerEventReports`) when vLLM
        publishes KV events, else None (saves and loads report nothing)."""

    def _add(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                self.counters[k] += v

    def register(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        hs_group: HiddenStateGroup | None = None,
        *,
        layer_parts: Sequence[int] | None = None,
        null_block: int | None = None,
    ) -> PagedCaches:
        """Adopt vLLM's per-layer caches (``ValueError`` for a layout the connector cannot copy)
        and, with ``extract_hidden_states``, its hidden-state group (``ValueError`` when there is
        no hidden-state store to keep it in). Several KV-cache groups: ``layer_parts`` gives each
        layer's record part (:class:`~.kv_layout.PagedCaches`), ``null_block`` vLLM's null block."""
        if hs_group is not None and self.hs is None:
            raise ValueError("a hidden-state KV-cache group needs enable_hidden_state_cache")
        self.caches = PagedCaches(
            kv_caches, self.block_size, self.blocks_per_chunk, layer_parts=layer_parts, null_block=null_block
        )
        self.hs_group = hs_group
        if self.caches.device.type == "cuda":
            self._stream = torch.cuda.Stream(self.caches.device)  # type: ignore[no-untyped-call]
        return self.caches

    def _fault(self, what: str, exc: BaseException) -> None:
        self._add(errors=1)
        self._log.warning("KV connector: %s failed: %s: %s", what, type(exc).__name__, exc, key=what)

    # ---- load ----
    def load(self, meta: KVStepMetadata) -> None:
        """Do this step's synchronous loads and start reading its asynchronous ones; failures
        are recorded for :meth:`take_load_errors`."""
        hs_runs = {r.req_id: r for r in meta.hs_loads} if self.hs_group is not None else {}
        for run in meta.loads:
            fetched = self._fetch_guarded(run)
            if fetched is not None:
                self._apply_guarded(run, fetched, hs_runs.get(run.req_id))
        for run in meta.async_loads:
            self._add(async_load_runs=1)
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lmcache-async-kv-load")
            try:
                fut = self._executor.submit(
                    self._fetch_guarded, run, hs_runs.get(run.req_id) is not None, time.monotonic()
                )
                self._inflight[run.req_id] = (run, fut, hs_runs.get(run.req_id))
            except RuntimeError as exc:  # shut down: the load is a failure, reported at once
                self._fault("load", exc)
                self._fail(run.block_ids, run.req_id)
                done: concurrent.futures.Future[_Fetched | None] = concurrent.futures.Future()
                done.set_result(None)
                self._inflight[run.req_id] = (run, done, None)

    def finished_loads(self, wait_s: float = 0.0) -> set[str]:
        """Requests whose asynchronous load ended (loaded or failed) since the last call.

        Model-runner thread: a reported request's blocks are filled (read in place by the load
        thread, or, for device caches, copied here from the records it read) and its failed
        blocks are already in :meth:`take_load_errors`. ``wait_s`` > 0 (an idle step): when loads are in flight and
        none has ended, wait up to that long for the first one (the GIL is free meanwhile for
        the threads doing the reads; vLLM would otherwise spin through empty steps)."""
        if wait_s > 0 and self._inflight:
            futures = [fut for _, fut, _ in self._inflight.values()]
            if not any(f.done() for f in futures):
                concurrent.futures.wait(futures, timeout=wait_s, return_when=concurrent.futures.FIRST_COMPLETED)
        done = {req_id for req_id, (_, fut, _) in self._inflight.items() if fut.done()}
        for req_id in done:
            run, fut, hs_run = self._inflight.pop(req_id)
            fetched = fut.result()  # _fetch_guarded never raises
            if fetched is not None:
                self._apply_guarded(run, fetched, hs_run)
        return done

    def _fail(self, block_ids: Any, req_id: str) -> None:
        """Record ``block_ids`` of request ``req_id`` as not loaded: by block id, or (more than
        one KV-cache group) the request as a whole."""
        null = self.caches.null_block if self.caches is not None else None
        ids = [b for b in block_ids if b != null]  # a null block is no request's: never name it
        if ids:
            with self._lock:
                self.counters["load_failures"] += 1
                self.counters["failed_blocks"] += len(ids)
                if self.per_request_failures:
                    self.counters["failed_requests"] += 1
                    self._failed_reqs.add(req_id)
                else:
                    self._errors.update(ids)

    def take_failed_requests(self) -> set[str]:
        """Requests whose asynchronous load failed since the last call, when failures are
        reported by request (more than one KV-cache group); clears. Model-runner thread."""
        with self._lock:
            failed, self._failed_reqs = self._failed_reqs, set()
        return failed

    # ---- the engine's prefill rate (model-runner thread) ----
    def step_started(self, now: float) -> None:
        """vLLM bound a step's metadata (its forward comes next)."""
        self._step_t0 = now

    def step_computed(self, num_tokens: int, now: float) -> None:
        """The step's forward is done: a step of many tokens is a sample of the prefill rate."""
        t0, self._step_t0 = self._step_t0, None
        if t0 is not None and self.costs is not None and num_tokens >= PREFILL_SAMPLE_TOKENS and now > t0:
            self.costs.observe_prefill(num_tokens, now - t0)
            self.costs.save()

    def _fetch_guarded(
        self, run: BlockRun, with_hidden_states: bool = False, started: float | None = None
    ) -> _Fetched | None:
        """Read ``run``'s records (any thread) and, ``with_hidden_states``, the published
        hidden-state records of its chunks; None when the run failed as a whole (recorded).
        ``started``: when the load was handed over (its deadline counts from then)."""
        caches = self.caches
        if caches is None:
            self._fail(run.block_ids, run.req_id)
            return None
        try:
            self._add(load_runs=1)
            chunks = run.chunks(self.blocks_per_chunk)
            keys = self.db.make_keys([c[0] for c in chunks])
            if caches.host_blocks:
                filled = self._read_into_blocks(caches, keys, chunks, run, started)
                fetched = _Fetched(keys, chunks, [], filled=filled)
            else:
                fetched = _Fetched(keys, chunks, self.manager.batched_get_sync(keys))
        except Exception as exc:  # timeout, closed tier, wiring: the whole run is recomputed
            self._fault("load", exc)
            self._fail(run.block_ids, run.req_id)
            return None
        group = self.hs_group
        if with_hidden_states and group is not None:
            hkeys = [hs_entry_key(k, layer) for k in keys for layer in group.layer_ids]
            try:
                fetched.prefetched = self.manager.batched_get_sync(hkeys)
            except Exception as exc:  # the restore reads them again (and may find them short)
                self._fault("hidden-state prefetch", exc)
        return fetched

    def _read_into_blocks(
        self,
        caches: PagedCaches,
        keys: list[Any],
        chunks: list[tuple[int, int, int, list[int]]],
        run: BlockRun,
        started: float | None = None,
    ) -> int:
        """Read the run's records straight into its blocks (any thread; ``memmove``, file reads
        and the node server's round trips only, no torch op); the blocks filled, a prefix of the
        run. A chunk that is missing, damaged or of another shape ends it (its blocks may be
        partly written: they are failed with the rest), and so does the run's deadline, checked
        between pieces (see the module docstring)."""
        scratch: list[torch.Tensor] = []  # record bytes no block takes (outside the run, null blocks)
        sinks = []
        for (_, _, first, bids), parts in zip(chunks, run.part_ids(self.blocks_per_chunk), strict=True):
            spare = None
            gap = caches.gap_bytes(bids, first, parts[1:])
            if gap:
                spare = torch.empty(gap, dtype=torch.uint8)
                scratch.append(spare)
            sinks.append(caches.read_sink(bids, first, spare, parts[1:]))
        tiers = run.tiers if len(run.tiers) == len(chunks) else ("",) * len(chunks)
        deadline = None if run.deadline_s is None or started is None else started + run.deadline_s
        done = loaded = 0
        i = 0
        while i < len(chunks):
            j = i + 1
            per_piece = self._piece_chunks(tiers[i], caches.record_bytes)
            while j < len(chunks) and j - i < per_piece and tiers[j] == tiers[i]:
                j += 1
            if deadline is not None and time.monotonic() > deadline:
                self._abandon(run, tiers[i], sum(len(c[3]) for c in chunks[i:]))
                break
            t0 = time.perf_counter()
            flags = self.manager.read_into_sync(keys[i:j], sinks[i:j], prefix=True)
            took = time.perf_counter() - t0
            ok = 0
            while ok < len(flags) and flags[ok]:
                ok += 1
            for _, _, _, bids in chunks[i : i + ok]:
                done += len(bids)
                loaded += 1
            if ok == j - i and self.costs is not None and tiers[i]:
                nbytes = sum(len(c[3]) for c in chunks[i:j]) * caches.num_layers * caches.block_bytes
                self.costs.observe_read(tiers[i], nbytes, took)
            late = deadline is not None and time.monotonic() > deadline
            if late and i + ok < len(chunks):  # the piece in flight was waited out; stop here
                self._abandon(run, tiers[i + ok], sum(len(c[3]) for c in chunks[i + ok :]))
                break
            if ok < j - i:
                self._tier_failed(tiers[i + ok])
                if self.reports is not None:
                    self._report_failed_read(tiers[i + ok], keys[i + ok])
                break
            i = j
        self._add(loaded_chunks=loaded, loaded_blocks=done, loaded_bytes=done * caches.num_layers * caches.block_bytes)
        if self.costs is not None:
            self.costs.save()
        return done

    def _piece_chunks(self, tier: str, record_bytes: int) -> int:
        """Chunks one read call of ``tier`` may take: :data:`PIECE_BYTES` worth, or what the
        tier is expected to read in :data:`PIECE_S` when that is more."""
        n = max(1, PIECE_BYTES // max(record_bytes, 1))
        fit = self.costs.read_params(tier) if self.costs is not None and tier else None
        if fit is not None and math.isfinite(fit[1]):
            n = max(n, int(PIECE_S * fit[1]) // max(record_bytes, 1))
        return n

    def _abandon(self, run: BlockRun, tier: str, blocks_left: int) -> None:
        """The run passed its deadline: counted and logged. The tier is priced by the timed
        pieces (recorded before this), not priced out: a tier that is failing is priced
        unavailable by :meth:`_tier_failed` when its read comes back short."""
        self._add(abandoned_loads=1, abandoned_blocks=blocks_left)
        self._log.warning(
            "KV connector: request %s: load abandoned after %.3f s (%d blocks left, tier %s); recomputing",
            run.req_id,
            run.deadline_s or 0.0,
            blocks_left,
            tier or "?",
            key="abandon",
        )

    def _report_failed_read(self, tier: str, key: Any) -> None:
        """A read of ``key`` from ``tier`` came back short while the tier answers (its breaker
        closed): the record is gone or damaged there (KV events withdraw it)."""
        try:
            if self.manager.tier_status().get(tier, (False, False))[1]:
                self.reports.read_failed(tier, key)
        except Exception:
            return

    def _tier_failed(self, tier: str) -> None:
        """A read from ``tier`` came back short: when its breaker is open (it failed or timed
        out, not a mere missing record) it is priced unavailable a while."""
        if self.costs is None or not tier:
            return
        try:
            available = self.manager.tier_status().get(tier, (False, True))[1]
        except Exception:
            return
        if not available:
            self.costs.mark_unavailable(tier)

    def _apply_guarded(self, run: BlockRun, fetched: _Fetched, hs_run: HSRun | None = None) -> None:
        try:
            done = self._apply(run, fetched)
        except Exception as exc:  # a wiring surprise: recompute the whole run
            self._fault("load", exc)
            self._fail(run.block_ids, run.req_id)
            return
        if hs_run is not None:
            self._apply_hidden_states(run, done, hs_run)

    def _apply_hidden_states(self, run: BlockRun, done: int, hs_run: HSRun) -> None:
        """Restore the hidden-state group for the KV blocks loaded (``done`` of the run's); the
        KV blocks beyond the restored hidden-state prefix are failed (recomputed: the forward
        then writes their hidden states)."""
        group, hs = self.hs_group, self.hs
        if group is None or hs is None:
            return
        kv_end = (run.first_block + done) * self.block_size
        end = min(hs_run.end, kv_end)
        try:
            got = load_hs_run(group, hs, self.manager, replace(hs_run, end=end))
        except Exception as exc:
            self._fault("hidden-state load", exc)
            got = hs_run.start
        got = max(got, hs_run.start)
        self._add(hs_loaded_tokens=got - hs_run.start)
        self.recent_hs_runs.append(("load", replace(hs_run, end=got)))
        if got < kv_end:
            self._add(hs_short_loads=1)
            first_bad = max(got // self.block_size - run.first_block, 0)
            self._fail(run.block_ids[first_bad:done], run.req_id)

    def _apply(self, run: BlockRun, fetched: _Fetched) -> int:
        """Scatter the fetched records (model-runner thread); blocks of the first missing or
        mismatched chunk and every later one are failed. Releases every record; returns the
        blocks loaded."""
        if fetched.filled is not None:  # read straight into the blocks already
            fetched.release()
            self._fail(run.block_ids[fetched.filled :], run.req_id)
            return fetched.filled
        caches = self.caches
        done = 0
        try:
            if caches is None:
                raise RuntimeError("the KV caches are not registered")
            parts = run.part_ids(self.blocks_per_chunk)
            for key, (_, _, first, bids), obj, more in zip(
                fetched.keys, fetched.chunks, fetched.objs, parts, strict=True
            ):
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
                scatter_blocks(caches, bids, rec, first, self._stream, more[1:])
                done += len(bids)
                self._add(
                    loaded_chunks=1,
                    loaded_blocks=len(bids),
                    loaded_bytes=caches.record_bytes * len(bids) // self.blocks_per_chunk,
                )
        finally:
            fetched.release()
        self._fail(run.block_ids[done:], run.req_id)
        return done

    def take_load_errors(self) -> set[int]:
        """Block ids whose load failed since the last call (vLLM recomputes them); clears."""
        with self._lock:
            errors, self._errors = self._errors, set()
        return errors

    # ---- save ----
    def save(self, meta: KVStepMetadata) -> None:
        """Store this step's completed chunks; never raises (faults are counted and logged).
        The lower tiers' write-through is woken once, when the whole save is done."""
        with self.manager.batched_writes():
            for run in meta.saves:
                try:
                    self._save_run(run)
                except Exception as exc:
                    self._fault("save", exc)
            group, hs = self.hs_group, self.hs
            if group is None or hs is None:
                return
            for hs_run in meta.hs_saves:
                try:
                    save_hs_run(group, hs, self.manager, hs_run)
                    self._add(hs_saved_runs=1)
                    self.recent_hs_runs.append(("save", hs_run))
                except Exception as exc:
                    self._fault("hidden-state save", exc)

    def _save_run(self, run: BlockRun) -> None:
        """Gather every new whole chunk of ``run`` into pool blocks, then put them in one batch
        (one wake-up of the write-through, after the last copy). A full pool ends the gathering
        (counted); the chunks gathered so far are still stored."""
        caches = self.caches
        if caches is None:
            return
        sm = self.manager
        pooled = "cpu" in sm.tier_names  # else (e.g. tier_order [server]) records go as tensors
        if not pooled and not sm.has_lower_tiers:
            self._add(save_rejected=1)  # no tier at all could take a record
            return
        keys: list[Any] = []
        objs: list[MemoryObj] = []
        values: list[MemoryObj | torch.Tensor] = []
        bpc = self.blocks_per_chunk
        whole = [
            (h, bids, parts[1:])
            for (h, _, first, bids), parts in zip(run.chunks(bpc), run.part_ids(bpc), strict=True)
            if first == 0 and len(bids) == bpc  # records: whole chunks
        ]
        if not whole:
            return
        chunk_ids: list[list[int]] = []  # the blocks of each record in ``values``
        chunk_others: list[list[list[int]]] = []  # and of its other parts
        try:
            for chunk_hash, bids, more in whole:
                key = self.db.make_key(chunk_hash)
                if sm.holds_locally(key):
                    self._add(save_skipped=1)
                    continue
                if pooled:
                    obj = sm.allocate(caches.record_shape, caches.dtype, MemoryFormat.UNDEFINED)
                    if obj is None:
                        self._add(save_rejected=1)
                        break
                    objs.append(obj)
                    values.append(obj)
                else:  # no pool to gather into: a fresh host tensor the put copies from
                    values.append(torch.empty(caches.record_shape, dtype=caches.dtype))
                chunk_ids.append(bids)
                chunk_others.append(more)
                keys.append(key)
            if not keys:
                return
            gather_chunks(caches, chunk_ids, values, chunk_others, self._stream)
            stored = sm.batched_put_sync(keys, values)
            if self.reports is not None:
                self.reports.saved(keys, stored)
        finally:
            for obj in objs:
                obj.ref_count_down()
        ok = sum(1 for r in stored if r)
        self._add(saved_chunks=ok, saved_bytes=ok * caches.record_bytes, save_rejected=len(stored) - ok)

    def stats(self) -> dict[str, Any]:
        """The worker's counters and the manager's per-tier stats."""
        with self._lock:
            out: dict[str, Any] = dict(self.counters)
        out["loads_in_flight"] = len(self._inflight)
        if self.costs is not None:
            out["costs"] = self.costs.snapshot()
        out["manager"] = self.manager.stats()
        return out

    def close(self) -> None:
        """Wait for asynchronous reads in flight (each bounded by the manager's timeouts) and
        release the records they read; those loads are not applied."""
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)
        inflight, self._inflight = self._inflight, {}
        for _, fut, _ in inflight.values():
            if fut.done() and not fut.cancelled():
                fetched = fut.result()
                if fetched is not None:
                    fetched.release()
