"""The scheduler half of the KV connector: what to load, what to save, per step.

Framework-free: it reads vLLM's request and scheduler-output objects by attribute and imports
nothing of vLLM. Runs on vLLM's scheduler thread (one thread; no locking).

* **Keys** come from vLLM's ``Request`` once, when the scheduler first shows it
  (:meth:`KVSchedulerSide.num_new_matched_tokens` or :meth:`KVSchedulerSide.after_alloc`): the
  prompt's token ids and its key extras (images, LoRA adapter, ``cache_salt``, prompt
  embeddings; :mod:`.kv_request_keys`) give each whole chunk's hash, kept on the request's
  record. The scheduler output is never keyed again (it carries no ``cache_salt`` and no
  multimodal features): a request without a record is neither loaded nor saved, and neither is
  one whose extras cannot be read (counted in ``unkeyed_requests``, one log line per kind).
* **Lookup** (:meth:`KVSchedulerSide.num_new_matched_tokens`): one batched presence query over
  the chunk keys gives the stored prefix, and the hit is cut to whole blocks below the last
  prompt token (vLLM must compute at least one token; whole chunks when a sliding-window group
  is a part). A lookup that fails or times out is a miss, counted. With several KV-cache groups
  a chunk counts only when every part is there: its record (all attention groups) and, for the
  hidden-state connector, each aux layer's hidden-state record (a load that failed there would
  recompute the whole request).
* **Load plan** (:meth:`after_alloc`): the blocks vLLM allocated for the hit, from the first
  block it does not already hold, become a :class:`BlockRun` for this step's metadata.
* **Save plan** (:meth:`build_meta`): every prompt chunk whose tokens are all computed by the
  end of this step and that was neither loaded nor saved before becomes a save run.

**Load or recompute** (:mod:`.kv_costs`): the stored prefix is located tier by tier
(:meth:`StorageManager.locate <lmcache_async.storage_manager.StorageManager.locate>`; off this
thread when a loop-side tier must be asked: the hook answers None, "ask again", meanwhile,
:mod:`.kv_lookup`) and only the prefix whose measured load time beats its recompute time is
offered (``load_policy``, ``max_load_s``, ``load_margin``; ``kv_transfer_params`` may override
the first two per request). An asynchronous load carries a deadline the worker enforces. A
request whose load failed or was abandoned (vLLM's ``update_connector_output`` shows its
blocks invalid or the request failed) is never offered a load again: vLLM's recompute finishes
it. Every decision is counted (``decision_<reason>``, tokens loaded and declined) and logged
at debug.

A hit held in memory the worker reads on its own thread — the CPU tier of this process, or the
node cache server's shared pool (:meth:`StorageManager.memory_prefix_len
<lmcache_async.storage_manager.StorageManager.memory_prefix_len>`) — is loaded synchronously
(``start_load_kv``, before the forward: memory copies). A hit that needs a device or the network
(disk, remote, NIXL) is loaded asynchronously: vLLM parks the request until the worker reports
the load finished, so no step waits on that I/O.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lmcache_async.engines.hidden_states import hs_entry_key
from lmcache_async.integration.vllm.kv.costs import CostBook, decide_load, load_deadline
from lmcache_async.integration.vllm.kv.groups import NULL_BLOCK_ID, GroupLayout, mask_window, window_first_block
from lmcache_async.integration.vllm.kv.lookup import LoadSettings, TierLookups
from lmcache_async.integration.vllm.kv.metadata import BlockRun, HSRun, KVStepMetadata
from lmcache_async.integration.vllm.kv.request_keys import UnreadableRequest, request_key_inputs
from lmcache_async.ratelog import RateLimitedLog
from lmcache_async.storage_manager import StorageManager
from lmcache_async.token_database import ChunkedTokenDatabase

logger = logging.getLogger(__name__)

__all__ = ["KVSchedulerSide"]


@dataclass
class _Req:
    hashes: list[int]
    """The chunk hashes of the prompt's whole chunks, derived from the request (extras in)."""
    prompt_len: int
    block_ids: list[int] = field(default_factory=list)
    saved_chunks: int = 0
    hs_block_ids: list[int] = field(default_factory=list)
    part_ids: list[list[int]] = field(default_factory=list)
    """Several KV-cache groups: the block ids of each record part after the primary one."""


@dataclass
class _Planned:
    """A load handed to the workers, until vLLM's output says how it went."""

    block_ids: frozenset[int]
    is_async: bool
    tiers: tuple[str, ...]
    steps_seen: int = 0


@dataclass(frozen=True)
class _Lookup:
    computed: int
    hit: int
    is_async: bool
    tiers: tuple[str | None, ...]
    """The tier of every chunk from chunk 0 (None: not held, or not loaded)."""
    deadline_s: float | None


DECISION_REASONS = ("memory", "cheaper", "unknown", "always", "slower", "unavailable", "max_load_s", "never", "miss")
"""Every ``reason`` of a load decision (counted as ``decision_<reason>``)."""

HOOK_TIMES_KEPT = 4096
"""How many of the lookup hook's latest call times :attr:`KVSchedulerSide.hook_times` keeps."""


def _group(block_ids: Any, index: int = 0) -> list[int] | None:
    """The block ids of KV-cache group ``index`` from vLLM's per-group tuple (a flat list is
    group 0's; None stays None, and so does a tuple without that group)."""
    if block_ids is None:
        return None
    if block_ids and isinstance(block_ids[0], (list, tuple)):
        return list(block_ids[index]) if index < len(block_ids) else None
    return list(block_ids) if index == 0 else None


class KVSchedulerSide:
    """Scheduler-side state; see the module docstring.

    ``manager`` is called for the manager to ask (it may change while the engine runs: a
    worker's store appears in this process after the scheduler's lookup-only one).
    ``kv_group`` is the index of the attention layers' KV-cache group in vLLM's per-group block
    ids; ``hs_group`` the index of the hidden-state group of ``extract_hidden_states`` (None:
    there is none), whose rows are saved and loaded with the KV (:class:`HSRun`).
    """

    def __init__(
        self,
        manager: Callable[[], StorageManager],
        token_database: ChunkedTokenDatabase,
        block_size: int,
        blocks_per_chunk: int,
        kv_group: int = 0,
        hs_group: int | None = None,
        *,
        costs: CostBook | None = None,
        settings: LoadSettings | None = None,
        chunk_bytes: int = 1 << 20,
        per_request_failures: bool = False,
        lookup_give_up_s: float = 5.0,
        groups: GroupLayout | None = None,
    ) -> None:
        self._manager = manager
        layout = groups if groups is not None else GroupLayout(attention=(kv_group,))
        self.other_parts: tuple[int, ...] = layout.attention[1:]
        """The KV-cache groups of the record's parts after the primary one (``kv_group``)."""
        self.part_retained: tuple[int | None, ...] = layout.retained
        """Per part (the primary first): the tokens its sliding window keeps (None: full
        attention)."""
        self.chunk_aligned = layout.windowed
        """A sliding-window part: hits end on chunk boundaries (a window part holds the blocks
        before its chunk's end, :func:`~.kv_groups.window_first_block`)."""
        self.disabled: str | None = ", ".join(layout.unsupported) or None
        """Groups the connector cannot restore: no load is offered and nothing is saved."""
        self.costs = costs if costs is not None else CostBook({})
        self.settings = settings if settings is not None else LoadSettings()
        self.chunk_bytes = chunk_bytes
        self.per_request_failures = per_request_failures
        """More than one KV-cache group: every load is asynchronous (vLLM takes per-request
        failures of asynchronous loads there, not block ids)."""
        self.lookups = TierLookups(manager, self.costs, lookup_give_up_s)
        self._planned: dict[str, _Planned] = {}
        self._refused: set[str] = set()
        self.hook_times: collections.deque[float] = collections.deque(maxlen=HOOK_TIMES_KEPT)
        """Seconds each :meth:`num_new_matched_tokens` call took (the latest ones)."""
        self.kv_group = layout.attention[0]
        self.hs_group = hs_group
        self.hs_layer_ids: tuple[int, ...] = ()
        """The aux layers whose hidden-state records are parts of every chunk (the hidden-state
        connector's; with several KV-cache groups a lookup asks for them beside the KV record)."""
        self._hs_loads: dict[str, HSRun] = {}
        self.db = token_database
        self.block_size = block_size
        self.blocks_per_chunk = blocks_per_chunk
        self.chunk_size = block_size * blocks_per_chunk
        self._reqs: dict[str, _Req] = {}
        self._lookups: dict[str, _Lookup] = {}
        self._loads: dict[str, tuple[BlockRun, bool]] = {}
        self._log = RateLimitedLog(logger)
        self.counters: dict[str, int] = dict.fromkeys(
            (
                "lookups",
                "hit_tokens",
                "lookup_errors",
                "loads_planned",
                "async_loads_planned",
                "saves_planned",
                "keyed_with_extras",
                "unkeyed_requests",
                "unkeyed_saves_skipped",
                "loads_failed",
                "loads_refused_after_failure",
                "tokens_declined",
                "bad_transfer_params",
                *(f"decision_{r}" for r in DECISION_REASONS),
            ),
            0,
        )
        self._unkeyed: set[str] = set()
        self.events: Any = None
        """The KV events' scheduler half (:class:`~.kv_event_reports.SchedulerEvents`) when
        vLLM publishes KV events, else None (nothing is described or tracked)."""

    # ---- keys ----
    def _keyed(self, request: Any) -> _Req | None:
        """The record of ``request`` (a vLLM ``Request``), keyed from it on first sight; None
        when its extras cannot be read (counted, one log line per kind: never a guess)."""
        req_id = str(request.request_id)
        r = self._reqs.get(req_id)
        if r is not None:
            return r
        if req_id in self._unkeyed:
            return None
        try:
            tokens, extras = request_key_inputs(request)
        except UnreadableRequest as exc:
            self._unkeyed.add(req_id)
            self.counters["unkeyed_requests"] += 1
            self._log.warning(
                "KV connector: request %s is neither loaded nor saved: its %s cannot be read (%s)",
                req_id,
                exc.kind,
                exc,
                key=f"unkeyed-{exc.kind}",
            )
            return None
        if extras is not None:
            self.counters["keyed_with_extras"] += 1
        r = _Req(self.db.chunk_hashes(tokens, extras), len(tokens), part_ids=[[] for _ in self.other_parts])
        self._reqs[req_id] = r
        if self.events is not None:
            self.events.track(req_id, request)
        return r

    # ---- lookup ----
    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """``(tokens beyond num_computed_tokens the workers will load, whether the load is
        asynchronous)`` for vLLM's ``request``: the prefix worth loading (see the module
        docstring). ``(None, False)`` while the lookup runs off this thread (vLLM asks again on
        a later step); ``(0, False)`` on a miss, a fault, a load not worth it, a request whose
        load failed before, or one whose key extras cannot be read. Scheduler thread; never
        waits on a loop-side tier; never raises for storage trouble."""
        t0 = time.perf_counter()
        try:
            return self._match(request, num_computed_tokens)
        finally:
            self.hook_times.append(time.perf_counter() - t0)

    def _match(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        req_id = str(request.request_id)
        self._lookups.pop(req_id, None)
        r = self._keyed(request)
        if r is None or self.disabled:
            return 0, False
        cap = (max(r.prompt_len - 1, 0) // self.block_size) * self.block_size
        if self.chunk_aligned:
            cap = cap // self.chunk_size * self.chunk_size
        if not r.hashes or cap <= num_computed_tokens:
            return 0, False
        if req_id in self._refused:  # its load failed or was abandoned: vLLM recomputes it
            self.counters["loads_refused_after_failure"] += 1
            return 0, False
        settings, bad = self.settings.for_request(getattr(request, "kv_transfer_params", None))
        if bad is not None:
            self.counters["bad_transfer_params"] += 1
            self._log.warning("KV connector: request %s: kv_transfer_params: %s (ignored)", req_id, bad, key="params")
        if settings.policy == "never":
            self.counters["decision_never"] += 1
            return 0, False
        n_chunks = min(len(r.hashes), -(-cap // self.chunk_size))
        try:
            sm = self._manager()
            keys = self.db.make_keys(r.hashes[:n_chunks])
            per = 1 + len(self.hs_layer_ids) if self.per_request_failures else 1
            if per > 1:  # every part of a chunk must be there: a failed load would recompute all
                keys = [part for k in keys for part in (k, *(hs_entry_key(k, layer) for layer in self.hs_layer_ids))]
            names = self.lookups.where(req_id, keys)
            if names is None:
                return None, False
            if per > 1:
                names = [names[i] if None not in names[i : i + per] else None for i in range(0, len(names), per)]
            self.counters["lookups"] += 1
            if self.events is not None:
                self.events.looked_up(r.hashes[:n_chunks], names, {t: s[1] for t, s in sm.tier_status().items()})
            found = 0
            while found < len(names) and names[found] is not None:
                found += 1
            hit = min(found * self.chunk_size, cap)
            if hit <= num_computed_tokens:
                return 0, False
            status = sm.tier_status()
        except Exception as exc:  # a tier down or slow is a miss; never raise into the step
            self.counters["lookup_errors"] += 1
            self._log.warning("KV connector: lookup failed (treated as a miss): %s", exc, key="lookup")
            return 0, False
        return self._decide(req_id, names, num_computed_tokens, hit, status, settings)

    def _decide(
        self,
        req_id: str,
        names: list[str | None],
        computed: int,
        hit: int,
        status: dict[str, tuple[bool, bool]],
        settings: LoadSettings,
    ) -> tuple[int, bool]:
        """Cut the stored prefix ``computed..hit`` to the part worth loading (counted, logged)."""
        cs = self.chunk_size
        first, needed = computed // cs, -(-hit // cs)
        tokens = [min((i + 1) * cs, hit) - max(i * cs, computed) for i in range(first, needed)]
        memory = {name for name, (reads_memory, _) in status.items() if reads_memory} | {"cpu"}

        def price(tier: str, nbytes: int, reads: int) -> float | None:
            if not status.get(tier, (False, True))[1]:
                return math.inf  # its breaker is open: failing or timing out lately
            return self.costs.read_time(tier, nbytes, reads)

        rate = self.costs.prefill_tokens_per_s
        d = decide_load(
            names[first:needed],
            tokens,
            self.chunk_bytes,
            price,
            rate,
            memory_tiers=memory,
            policy=settings.policy,
            max_load_s=settings.max_load_s,
            margin=settings.margin,
        )
        self.counters[f"decision_{d.reason}"] += 1
        end = min(hit, (first + d.chunks) * cs)
        self.counters["tokens_declined"] += hit - max(end, computed)
        logger.debug(
            "KV connector: request %s: %d of %d stored tokens loaded (%s): tiers %s, load %s s, recompute %s s, "
            "prefill %s tokens/s; declined (tier, load s, recompute s): %s",
            req_id,
            max(end - computed, 0),
            hit - computed,
            d.reason,
            sorted(set(d.tiers)),
            None if d.load_s is None else round(d.load_s, 4),
            None if d.recompute_s is None else round(d.recompute_s, 4),
            None if rate is None else round(rate),
            None if d.declined is None else (d.declined[0], round(d.declined[1], 4), round(d.declined[2], 4)),
        )
        if end <= computed:
            return 0, False
        is_async = self.per_request_failures or any(t not in memory for t in d.tiers)
        deadline = (
            load_deadline(d, factor=settings.deadline_factor, max_load_s=settings.max_load_s) if is_async else None
        )
        kept = tuple(names[: first + d.chunks]) + (None,) * (len(names) - first - d.chunks)
        self._lookups[req_id] = _Lookup(computed, end, is_async, kept, deadline)
        self.counters["hit_tokens"] += end - computed
        return end - computed, is_async

    def after_alloc(self, request: Any, block_ids: Any, num_external_tokens: int) -> None:
        """Key ``request`` if it is new, and plan the load of ``num_external_tokens`` into its
        blocks (all its blocks, in request order, as vLLM's ``KVCacheBlocks.get_block_ids()``)."""
        req_id = str(request.request_id)
        lookup = self._lookups.pop(req_id, None)
        r = self._keyed(request)
        if num_external_tokens <= 0 or lookup is None or r is None:
            return
        local, hit, is_async = lookup.computed, lookup.hit, lookup.is_async
        if local + num_external_tokens != hit:
            local = hit - num_external_tokens
        blocks = _group(block_ids, self.kv_group) or []
        first_block = local // self.block_size
        end_block = hit // self.block_size
        if end_block > len(blocks) or local % self.block_size:
            self._log.warning(
                "KV connector: request %s: %d blocks allocated for a load of blocks %d..%d; not loading",
                req_id,
                len(blocks),
                first_block,
                end_block,
                key="alloc",
            )
            return
        first_chunk = first_block // self.blocks_per_chunk
        last_chunk = (end_block - 1) // self.blocks_per_chunk
        tiers = tuple(t or "" for t in lookup.tiers[first_chunk : last_chunk + 1])
        parts = [(_group(block_ids, g) or [])[first_block:end_block] for g in self.other_parts]
        if any(len(p) != end_block - first_block for p in parts):
            self._log.warning(
                "KV connector: request %s: a KV-cache group lacks blocks; not loading", req_id, key="parts"
            )
            return
        run = BlockRun(
            req_id,
            first_block,
            tuple(blocks[first_block:end_block]),
            tuple(r.hashes[first_chunk : last_chunk + 1]),
            tiers if len(tiers) == last_chunk + 1 - first_chunk else (),
            lookup.deadline_s,
            tuple(tuple(p) for p in parts),
        )
        self._loads[req_id] = (run, is_async)
        self._planned[req_id] = _Planned(frozenset(run.block_ids), is_async, tuple(t for t in tiers if t))
        if self.hs_group is not None:
            hs_blocks = _group(block_ids, self.hs_group) or []
            self._hs_loads[req_id] = HSRun(
                req_id, tuple(r.hashes[: -(-hit // self.chunk_size)]), local, hit, tuple(hs_blocks)
            )
        r.saved_chunks = max(r.saved_chunks, hit // self.chunk_size)
        self.counters["async_loads_planned" if is_async else "loads_planned"] += 1

    # ---- per step ----
    def build_meta(self, scheduler_output: Any) -> KVStepMetadata:
        """This step's loads (planned by :meth:`after_alloc`) and saves; resets the load plan."""
        total = getattr(scheduler_output, "total_num_scheduled_tokens", None)
        meta = KVStepMetadata(idle=total == 0, num_tokens=int(total or 0))
        num_scheduled: dict[str, int] = getattr(scheduler_output, "num_scheduled_tokens", {}) or {}
        for new in getattr(scheduler_output, "scheduled_new_reqs", ()) or ():
            req_id = new.req_id
            r = self._reqs.get(req_id)
            if r is None:  # never keyed from its Request: saving under a guessed key is worse than not
                self.counters["unkeyed_saves_skipped"] += 1
                continue
            r.block_ids = _group(new.block_ids, self.kv_group) or []
            r.part_ids = [_group(new.block_ids, g) or [] for g in self.other_parts]
            if self.hs_group is not None:
                r.hs_block_ids = _group(new.block_ids, self.hs_group) or []
            self._plan_save(meta, req_id, r, int(new.num_computed_tokens) + int(num_scheduled.get(req_id, 0)))
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        if cached is not None:
            resumed = set(getattr(cached, "resumed_req_ids", ()) or ())
            for i, req_id in enumerate(cached.req_ids):
                known = self._reqs.get(req_id)
                if known is None:
                    continue
                new_ids = _group(cached.new_block_ids[i], self.kv_group)
                if new_ids is not None:
                    known.block_ids = new_ids if req_id in resumed else known.block_ids + new_ids
                for k, g in enumerate(self.other_parts):
                    more = _group(cached.new_block_ids[i], g)
                    if more is not None:
                        known.part_ids[k] = more if req_id in resumed else known.part_ids[k] + more
                if self.hs_group is not None:
                    new_hs = _group(cached.new_block_ids[i], self.hs_group)
                    if new_hs is not None:
                        known.hs_block_ids = new_hs if req_id in resumed else known.hs_block_ids + new_hs
                done = int(cached.num_computed_tokens[i]) + int(num_scheduled.get(req_id, 0))
                self._plan_save(meta, req_id, known, done)
        for run, is_async in self._loads.values():
            (meta.async_loads if is_async else meta.loads).append(run)
        meta.hs_loads.extend(self._hs_loads.values())
        self._loads.clear()
        self._hs_loads.clear()
        return meta

    def _plan_save(self, meta: KVStepMetadata, req_id: str, r: _Req, computed_after_step: int) -> None:
        if self.disabled:
            return
        ready = min(computed_after_step, r.prompt_len) // self.chunk_size
        ready = min(ready, len(r.hashes), *(len(b) // self.blocks_per_chunk for b in [r.block_ids, *r.part_ids]))
        if ready <= r.saved_chunks:
            return
        bpc = self.blocks_per_chunk
        first = r.saved_chunks
        parts, first = self._save_parts(r, first, ready)
        if first < ready:
            meta.saves.append(
                BlockRun(req_id, first * bpc, parts[0], tuple(r.hashes[first:ready]), group_block_ids=parts[1:])
            )
            if self.events is not None:
                self.events.planned(req_id, r.hashes, first, ready)
        if self.hs_group is not None:
            cs = self.chunk_size
            meta.hs_saves.append(HSRun(req_id, tuple(r.hashes[:ready]), first * cs, ready * cs, tuple(r.hs_block_ids)))
        r.saved_chunks = ready
        self.counters["saves_planned"] += 1

    def _save_parts(self, r: _Req, first: int, ready: int) -> tuple[tuple[tuple[int, ...], ...], int]:
        """Every part's block ids (the primary first) from the first chunk to save through chunk
        ``ready - 1`` (a sliding-window part: the blocks before its window at each chunk's end
        are null), and that first chunk: a chunk whose window holds a null block (vLLM had
        dropped it, e.g. behind a prefix-cache hit) is not saved, nor is any before it."""
        bpc, bs = self.blocks_per_chunk, self.block_size
        every = [r.block_ids, *r.part_ids]
        out: list[list[int]] = [[] for _ in every]
        start = first
        for c in range(first, ready):
            for k, retained in enumerate(self.part_retained):
                ids = every[k][c * bpc : (c + 1) * bpc]
                if retained is not None:
                    keep = window_first_block((c + 1) * self.chunk_size, retained, bs)
                    ids = list(mask_window(ids, c * bpc, keep))
                    if any(b == NULL_BLOCK_ID for j, b in enumerate(ids) if c * bpc + j >= keep):
                        start = c + 1
                out[k].extend(ids)
        skip = (start - first) * bpc
        return tuple(tuple(ids[skip:]) for ids in out), start

    def after_step(self, output: Any) -> None:
        """Learn from vLLM's ``KVConnectorOutput`` of a step how the planned loads went: a
        request whose load blocks came back invalid, or that vLLM lists in ``failed_recving``,
        failed (it is never offered a load again, and a tier it used that is failing now is
        priced unavailable); one in ``finished_recving`` (asynchronous) or still clean a step
        after its synchronous load succeeded. Scheduler thread."""
        if self.events is not None:
            self.events.apply(getattr(output, "kv_cache_events", None))
        invalid = set(getattr(output, "invalid_block_ids", None) or ())
        failed = set(getattr(output, "failed_recving", None) or ())
        finished = set(getattr(output, "finished_recving", None) or ())
        for req_id, plan in list(self._planned.items()):
            if req_id in failed or (invalid and not invalid.isdisjoint(plan.block_ids)):
                del self._planned[req_id]
                self._refused.add(req_id)
                self.counters["loads_failed"] += 1
                status = self._manager().tier_status()
                for tier in set(plan.tiers):
                    if not status.get(tier, (False, True))[1]:
                        self.costs.mark_unavailable(tier)
                logger.debug("KV connector: request %s: its load failed; it is recomputed", req_id)
            elif plan.is_async and req_id in finished:
                del self._planned[req_id]
            elif not plan.is_async:
                plan.steps_seen += 1
                if plan.steps_seen > 1:
                    del self._planned[req_id]

    def stats(self) -> dict[str, Any]:
        """The counters, the lookups' counters, the cost book's estimates and the hook's call
        time (p50/p99/max over its latest calls, seconds)."""
        out: dict[str, Any] = dict(self.counters)
        out.update(self.lookups.counters)
        out["costs"] = self.costs.snapshot()
        times = sorted(self.hook_times)
        if times:
            out["hook_s"] = {
                "calls": len(times),
                "p50": times[len(times) // 2],
                "p99": times[min(len(times) - 1, int(len(times) * 0.99))],
                "max": times[-1],
            }
        return out

    def close(self) -> None:
        """Stop the lookup thread."""
        self.lookups.close()

    def finished(self, req_id: str) -> None:
        """Forget a finished request (saves are synchronous: its blocks may be freed now)."""
        self._planned.pop(req_id, None)
        self._refused.discard(req_id)
        if self.events is not None:
            self.events.forget(req_id)
        self.lookups.forget(req_id)
        self._reqs.pop(req_id, None)
        self._unkeyed.discard(req_id)
        self._lookups.pop(req_id, None)
        self._loads.pop(req_id, None)
        self._hs_loads.pop(req_id, None)
