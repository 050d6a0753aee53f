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
  prompt token (vLLM must compute at least one token). A lookup that fails or times out is a
  miss, counted.
* **Load plan** (:meth:`after_alloc`): the blocks vLLM allocated for the hit, from the first
  block it does not already hold, become a :class:`BlockRun` for this step's metadata.
* **Save plan** (:meth:`build_meta`): every prompt chunk whose tokens are all computed by the
  end of this step and that was neither loaded nor saved before becomes a save run.

A hit held in memory the worker reads on its own thread — the CPU tier of this process, or the
node cache server's shared pool (:meth:`StorageManager.memory_prefix_len
<lmcache_async.storage_manager.StorageManager.memory_prefix_len>`) — is loaded synchronously
(``start_load_kv``, before the forward: memory copies). A hit that needs a device or the network
(disk, remote, NIXL) is loaded asynchronously: vLLM parks the request until the worker reports
the load finished, so no step waits on that I/O.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lmcache_async.integration.vllm.kv_metadata import BlockRun, HSRun, KVStepMetadata
from lmcache_async.integration.vllm.kv_request_keys import UnreadableRequest, request_key_inputs
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
    ) -> None:
        self._manager = manager
        self.kv_group = kv_group
        self.hs_group = hs_group
        self._hs_loads: dict[str, HSRun] = {}
        self.db = token_database
        self.block_size = block_size
        self.blocks_per_chunk = blocks_per_chunk
        self.chunk_size = block_size * blocks_per_chunk
        self._reqs: dict[str, _Req] = {}
        self._lookups: dict[str, tuple[int, int, bool]] = {}
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
            ),
            0,
        )
        self._unkeyed: set[str] = set()

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
        r = _Req(self.db.chunk_hashes(tokens, extras), len(tokens))
        self._reqs[req_id] = r
        return r

    # ---- lookup ----
    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """``(tokens beyond num_computed_tokens the workers can load, whether the load is
        asynchronous)`` for vLLM's ``request``; ``(0, False)`` on a miss, a fault or a request
        whose key extras cannot be read."""
        req_id = str(request.request_id)
        self._lookups.pop(req_id, None)
        r = self._keyed(request)
        if r is None:
            return 0, False
        cap = (max(r.prompt_len - 1, 0) // self.block_size) * self.block_size
        if not r.hashes or cap <= num_computed_tokens:
            return 0, False
        n_chunks = min(len(r.hashes), -(-cap // self.chunk_size))
        self.counters["lookups"] += 1
        try:
            sm = self._manager()
            keys = self.db.make_keys(r.hashes[:n_chunks])
            found = sm.batched_contains_sync(keys)
            hit = min(found * self.chunk_size, cap)
            if hit <= num_computed_tokens:
                return 0, False
            needed = -(-hit // self.chunk_size)
            first = num_computed_tokens // self.chunk_size
            is_async = first + sm.memory_prefix_len(keys[first:needed]) < needed
        except Exception as exc:  # a tier down or slow is a miss; never raise into the step
            self.counters["lookup_errors"] += 1
            self._log.warning("KV connector: lookup failed (treated as a miss): %s", exc, key="lookup")
            return 0, False
        self._lookups[req_id] = (num_computed_tokens, hit, is_async)
        self.counters["hit_tokens"] += hit - num_computed_tokens
        return hit - num_computed_tokens, is_async

    def after_alloc(self, request: Any, block_ids: Any, num_external_tokens: int) -> None:
        """Key ``request`` if it is new, and plan the load of ``num_external_tokens`` into its
        blocks (all its blocks, in request order, as vLLM's ``KVCacheBlocks.get_block_ids()``)."""
        req_id = str(request.request_id)
        lookup = self._lookups.pop(req_id, None)
        r = self._keyed(request)
        if num_external_tokens <= 0 or lookup is None or r is None:
            return
        local, hit, is_async = lookup
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
        run = BlockRun(
            req_id, first_block, tuple(blocks[first_block:end_block]), tuple(r.hashes[first_chunk : last_chunk + 1])
        )
        self._loads[req_id] = (run, is_async)
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
        meta = KVStepMetadata(idle=getattr(scheduler_output, "total_num_scheduled_tokens", None) == 0)
        num_scheduled: dict[str, int] = getattr(scheduler_output, "num_scheduled_tokens", {}) or {}
        for new in getattr(scheduler_output, "scheduled_new_reqs", ()) or ():
            req_id = new.req_id
            r = self._reqs.get(req_id)
            if r is None:  # never keyed from its Request: saving under a guessed key is worse than not
                self.counters["unkeyed_saves_skipped"] += 1
                continue
            r.block_ids = _group(new.block_ids, self.kv_group) or []
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
        ready = min(computed_after_step, r.prompt_len) // self.chunk_size
        ready = min(ready, len(r.hashes), len(r.block_ids) // self.blocks_per_chunk)
        if ready <= r.saved_chunks:
            return
        bpc = self.blocks_per_chunk
        first = r.saved_chunks
        meta.saves.append(
            BlockRun(req_id, first * bpc, tuple(r.block_ids[first * bpc : ready * bpc]), tuple(r.hashes[first:ready]))
        )
        if self.hs_group is not None:
            cs = self.chunk_size
            meta.hs_saves.append(HSRun(req_id, tuple(r.hashes[:ready]), first * cs, ready * cs, tuple(r.hs_block_ids)))
        r.saved_chunks = ready
        self.counters["saves_planned"] += 1

    def finished(self, req_id: str) -> None:
        """Forget a finished request (saves are synchronous: its blocks may be freed now)."""
        self._reqs.pop(req_id, None)
        self._unkeyed.discard(req_id)
        self._lookups.pop(req_id, None)
        self._loads.pop(req_id, None)
        self._hs_loads.pop(req_id, None)
