"""The KV engine: a framework-neutral tensor API over a tiered StorageManager.

``store(token_ids, kv)`` cuts ``kv`` (``[2, num_layers, num_tokens, hidden]``, any device and
dtype) into chunks of ``chunk_size`` tokens, keyed by the prefix-chained chunk hashes of the
shared :class:`ChunkedTokenDatabase`, and copies each chunk once into a block of the CPU pool
(device→host in that one copy) that the manager then indexes without a second copy; lower
tiers (disk, remote, NIXL) are written through in the background. ``retrieve`` returns the
longest cached prefix as one tensor, ``lookup`` its length in tokens over all tiers.

When ``enable_hidden_state_cache`` is set, ``engine.hidden_state_store`` is a
:class:`~lmcache_async.engines.hidden_states.HiddenStateStore` sharing this engine's token
database and asking this engine's manager whether KV is still present.

Thread-safe. Every operation is written once, as an ``a``-prefixed coroutine over the
manager's coroutines, awaitable from any loop: what the CPU tier answers is answered on the
caller's thread (no hop); only lower-tier work crosses to the manager's loop, one batch per
call; a copy of at least :data:`~lmcache_async.engines._offload.OFF_LOOP_COPY_BYTES` runs on
the engine copy executor so the caller's loop is not frozen by it. The blocking method of the
same name without the ``a`` is that coroutine stepped on the calling thread by the KV
manager's :class:`~lmcache_async.sync_bridge.SyncBridge`
(:func:`~lmcache_async.engines._twins.blocking_twin`): no loop, every copy inline, the same
results and errors.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from lmcache_async.config import LMCacheEngineConfig
from lmcache_async.engines import _offload
from lmcache_async.engines._chunks import ChunkPlan, copy_in, copy_out, release_all, wait_copies
from lmcache_async.engines._devices import CPU, check_device
from lmcache_async.engines._offload import should_offload, yield_to_loop
from lmcache_async.engines._opening import EngineOpening
from lmcache_async.engines._twins import blocking_twin
from lmcache_async.engines.hidden_states import HiddenStateStore
from lmcache_async.errors import LoopThreadCallError, ManagerClosedError
from lmcache_async.key_extras import KeyExtras
from lmcache_async.memory import MemoryFormat, MemoryObj
from lmcache_async.metadata import NEUTRAL_METADATA, LMCacheEngineMetadata
from lmcache_async.ratelog import RateLimitedLog
from lmcache_async.storage_manager import StorageManager
from lmcache_async.sync_bridge import SyncBridge
from lmcache_async.tensor_checks import check_storable_tensor
from lmcache_async.token_database import ChunkedTokenDatabase, num_masked_prefix

__all__ = ["LMCacheEngine"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _StoreJob:
    """A checked store: the prompt's chunks, the source, the first chunk to write, its bytes."""

    plan: ChunkPlan
    src: torch.Tensor
    base: int  # the token of row 0 of ``src``
    cached: int  # chunks already held locally (skipped)
    nbytes: int  # bytes the chunks from ``cached`` on copy


class LMCacheEngine:
    """KV cache engine; see the module docstring.

    Attributes: ``config``, ``metadata``, ``token_database`` (shared with the hidden-state
    store), ``storage_manager`` (named ``kv``), ``hidden_state_store`` (None unless
    ``enable_hidden_state_cache``). Raises ``ValueError`` naming ``max_hidden_state_cpu_size``
    when the hidden-state cache is enabled with a pool size <= 0.
    """

    @classmethod
    def open(
        cls, config: LMCacheEngineConfig, metadata: LMCacheEngineMetadata | None = None
    ) -> EngineOpening[LMCacheEngine]:
        """Build the engine without blocking the caller's event loop: ``engine = await
        LMCacheEngine.open(config, meta)``, or ``async with LMCacheEngine.open(...) as engine:``
        (closed on exit). The constructor runs on a worker thread; arguments and errors as for
        the constructor; a cancelled open leaves nothing running."""
        return EngineOpening(lambda: cls(config, metadata))

    def __init__(self, config: LMCacheEngineConfig, metadata: LMCacheEngineMetadata | None = None) -> None:
        if not isinstance(config, LMCacheEngineConfig):
            raise TypeError(f"config must be an LMCacheEngineConfig, got {type(config).__name__}")
        if metadata is not None and not isinstance(metadata, LMCacheEngineMetadata):
            raise TypeError(f"metadata must be an LMCacheEngineMetadata, got {type(metadata).__name__}")
        if config.enable_hidden_state_cache and not config.max_hidden_state_cpu_size > 0:
            raise ValueError(
                "max_hidden_state_cpu_size must be > 0 when enable_hidden_state_cache is true, got "
                f"{config.max_hidden_state_cpu_size!r}"
            )
        self.config = config
        self.metadata = metadata if metadata is not None else NEUTRAL_METADATA
        self.token_database = ChunkedTokenDatabase(config.chunk_size, config.save_unfull_chunk, self.metadata)
        self._closed = False
        self.timeouts = 0
        self._timeout_log = RateLimitedLog(logger)
        self.storage_manager = StorageManager(config, self.metadata, name="kv")
        self.hidden_state_store: HiddenStateStore | None = None
        if config.enable_hidden_state_cache:
            try:
                self.hidden_state_store = HiddenStateStore(
                    config,
                    self.metadata,
                    token_database=self.token_database,
                    kv_storage_manager=self.storage_manager,
                )
            except BaseException:
                self.storage_manager.close_sync()
                raise

    # ---- helpers --------------------------------------------------------------------------------
    @property
    def bridge(self) -> SyncBridge:
        """The KV manager's bridge: it steps every blocking method's coroutine on the calling
        thread (and refuses the manager's loop thread)."""
        return self.storage_manager.bridge

    def _check_open(self) -> None:
        if self._closed:
            raise ManagerClosedError("LMCacheEngine is closed")

    @staticmethod
    def _check_kv(kv: object) -> torch.Tensor:
        kv = check_storable_tensor(kv, "kv")
        if kv.dim() != 4 or kv.shape[0] != 2:
            raise ValueError(f"kv must have shape [2, num_layers, num_tokens, hidden], got {tuple(kv.shape)}")
        return kv

    # ---- store --------------------------------------------------------------------------------
    def _plan_store(self, token_ids: Any, kv: torch.Tensor, mask: Any, extras: KeyExtras | None) -> _StoreJob | None:
        """Checks and plans a store on the caller's thread; None when there is nothing to write.

        Looks up (without a hop: the CPU tier and the queued write-through only) the prefix
        already held and touches it, so this call's own allocations never evict it."""
        self._check_open()
        kv = self._check_kv(kv)
        plan = ChunkPlan(self.token_database, token_ids, extras)
        n_tokens = plan.n_tokens
        skip = 0 if mask is None else num_masked_prefix(mask, n_tokens, plan.chunk_size)
        rows = kv.shape[2]
        if rows == n_tokens:
            base = 0
        elif rows == n_tokens - skip:
            base = skip
        else:
            raise ValueError(
                f"kv has {rows} tokens on axis 2; expected len(token_ids) = {n_tokens}"
                + (f" or the {n_tokens - skip} unmasked tokens" if skip else "")
            )
        first = skip // plan.chunk_size
        keys = plan.keys[first:]
        if not keys:
            return None
        sm = self.storage_manager
        # Only what a local tier holds is skipped: a lower tier's "present" is unverified until
        # read, and trusting it would drop a chunk whose record there is damaged.
        cached = first + sm.local_prefix_len(keys)
        # Keep the already cached prefix (masked or found) from this call's own evictions.
        sm.touch(plan.keys[:cached][::-1])
        if cached >= len(plan):
            return None
        src = kv.detach()
        per_token = src[:, :, :1].numel() * src.element_size()
        return _StoreJob(plan, src, base, cached, per_token * (plan.n_tokens - plan.start(cached)))

    def _write(self, job: _StoreJob) -> int:
        """Copy the job's chunks into the pool and index them; returns the chunks written.

        Blocking; any thread but the KV manager's loop thread. Every pool reference taken here
        is released here, on every path (so an abandoned off-loop job leaks nothing)."""
        sm = self.storage_manager
        plan, src, base = job.plan, job.src, job.base
        if "cpu" not in sm.tier_names:  # no CPU pool: the manager stages and writes through
            keys = plan.keys[job.cached :]
            views = [src[:, :, plan.start(i) - base : plan.end(i) - base] for i in range(job.cached, len(plan))]
            return sum(sm.batched_put_sync(keys, views, MemoryFormat.KV_2LTD))
        layers, hidden = src.shape[1], src.shape[3]
        held: list[MemoryObj] = []
        in_flight = False
        stored = 0
        try:
            for i in range(job.cached, len(plan)):
                start, end = plan.start(i), plan.end(i)
                obj = sm.allocate((2, layers, end - start, hidden), src.dtype, MemoryFormat.KV_2LTD)
                if obj is None:
                    logger.debug("KV pool full: stored chunks up to token %d of %d", start, plan.n_tokens)
                    break
                held.append(obj)
                in_flight |= copy_in(obj.tensor, src[:, :, start - base : end - base])
            if in_flight:
                wait_copies(src)
            if held:
                sm.batched_put_sync(plan.keys[job.cached : job.cached + len(held)], held)
                # The manager took its own reference when it indexed a block.
                stored = sum(1 for obj in held if obj.get_ref_count() > 1)
            # Newest-first touches keep a prompt's prefix the most recently used: under
            # pressure a prompt loses its suffix before its prefix.
            sm.touch(plan.keys[: job.cached + len(held)][::-1])
        finally:
            release_all(held)
        return stored

    async def astore(
        self, token_ids: Any, kv: torch.Tensor, *, mask: Any = None, extras: KeyExtras | None = None
    ) -> int:
        """Store the KV of ``token_ids``; returns the number of chunks this call wrote.

        ``kv`` is ``[2, num_layers, num_tokens, hidden]`` on any device and of any dtype, its
        token axis covering either all of ``token_ids`` or only the tokens after the masked
        prefix. ``mask`` (optional, one bool per token) marks with leading False the tokens that
        are already cached: their chunks are skipped. The masked prefix must be a multiple of
        ``chunk_size`` and the rest all True (``ValueError`` otherwise). With
        ``save_unfull_chunk`` false a trailing partial chunk is not stored. ``TypeError`` naming
        ``kv`` for anything the cache cannot store (a non-tensor; a quantized, sparse, nested or
        meta tensor). The caller keeps ``kv``: it is copied, never kept.

        The prefix the CPU tier already holds (or is still writing down) is skipped and not
        counted; a chunk only a lower tier claims is stored again, and that tier keeps its record
        when it is intact (entries are content-addressed). When the CPU pool cannot take a
        chunk even after evicting what nobody holds, the chunks before it are kept and the rest
        is skipped (never evicting a chunk this call wrote). Answered on the caller's thread
        (no hop); lower tiers are written through in the background (never waited for).
        Awaited, a copy of at least :data:`~lmcache_async.engines._offload.OFF_LOOP_COPY_BYTES`
        runs on the engine copy executor instead, so the caller's loop keeps serving; a caller
        cancelled meanwhile leaves the store to finish (it holds no pool reference afterwards).

        ``extras`` (:class:`~lmcache_async.key_extras.KeyExtras`: images, LoRA adapter,
        ``cache_salt``, prompt embeddings) enter the chunk keys: a later :meth:`retrieve` or
        :meth:`lookup` finds these chunks only under equal extras. ``TypeError`` naming
        ``extras`` for anything but a ``KeyExtras`` or None.
        """
        await yield_to_loop()
        job = self._plan_store(token_ids, kv, mask, extras)
        if job is None:
            return 0
        # Awaited on the manager's loop thread, _write's put (a blocking call) must leave it.
        if should_offload(job.nbytes, force=self.storage_manager.loop_thread.in_loop_thread()):
            return await _offload.run_off_loop(lambda: self._write(job))
        return self._write(job)

    store = blocking_twin(astore)

    # ---- retrieve / lookup ---------------------------------------------------------------------
    def _assemble(
        self, plan: ChunkPlan, objs: list[MemoryObj | None], dev: torch.device
    ) -> tuple[int, torch.Tensor | None]:
        """The prefix of well-shaped chunks of ``objs`` copied into one fresh tensor on ``dev``.

        Blocking; any thread. Releases every reference in ``objs`` on every path."""
        try:
            first = objs[0] if objs else None
            if first is None or len(first.shape) != 4:
                return 0, None
            _, layers, _, hidden = first.shape
            dtype = first.dtype
            hit = 0
            for i, obj in enumerate(objs):
                if obj is None or obj.dtype != dtype or obj.shape != (2, layers, plan.end(i) - plan.start(i), hidden):
                    break
                hit += 1
            if hit == 0:
                return 0, None
            total = plan.tokens_in(hit)
            out = torch.empty((2, layers, total, hidden), dtype=dtype, device=dev)
            in_flight = False
            for i in range(hit):
                obj = objs[i]
                assert obj is not None
                in_flight |= copy_out(out[:, :, plan.start(i) : plan.end(i)], obj.tensor)
            if in_flight:
                wait_copies(out)
            self.storage_manager.touch(plan.keys[:hit][::-1])
        finally:
            release_all(objs)
        return total, out

    async def aretrieve(
        self, token_ids: Any, *, device: str | torch.device | None = None, extras: KeyExtras | None = None
    ) -> tuple[int, torch.Tensor | None]:
        """``(num_hit_tokens, kv_prefix)``: the KV of the longest cached prefix of ``token_ids``
        as one tensor ``[2, num_layers, num_hit_tokens, hidden]`` (the stored dtype; on ``device``,
        CPU by default), or ``(0, None)`` when the first chunk misses.

        Chunks are searched in every tier (lower-tier hits are promoted into the CPU tier) and
        touched so the prefix outlives its suffix under pressure. The result is a fresh tensor
        the caller owns; it never aliases pool memory. ``device`` is checked before anything is
        looked up: one this machine cannot hold a tensor on raises ``ValueError`` naming
        ``device`` on a hit and on a miss alike. Storage trouble and ``blocking_timeout_secs``
        passing are misses (counted in ``timeouts``). ``extras`` as in :meth:`store`: only
        chunks stored under equal extras are found.

        A prefix the CPU tier holds is answered on the caller's thread (no hop); only chunks a
        lower tier must be asked about cross to the manager's loop, in one batch. Awaited, a
        result of at least :data:`~lmcache_async.engines._offload.OFF_LOOP_COPY_BYTES` is
        assembled on the engine copy executor; a caller cancelled at any point leaves no pool
        reference held."""
        await yield_to_loop()
        self._check_open()
        dev = CPU if device is None else check_device(device)
        plan = ChunkPlan(self.token_database, token_ids, extras)
        if not len(plan):
            return 0, None
        sm = self.storage_manager
        try:  # each hop is bounded by blocking_timeout_secs; the manager releases what it got
            n = await sm.prefix_len(plan.keys)
            if n == 0:
                return 0, None
            objs = await sm.batched_get(plan.keys[:n])
        except TimeoutError:
            self._timed_out("retrieve")
            return 0, None
        if should_offload(sum(o.tensor.numel() * o.tensor.element_size() for o in objs if o is not None)):
            return await _offload.run_off_loop(lambda: self._assemble(plan, objs, dev))
        return self._assemble(plan, objs, dev)

    retrieve = blocking_twin(aretrieve)

    async def alookup(self, token_ids: Any, *, extras: KeyExtras | None = None) -> int:
        """Length in tokens of the longest prefix of ``token_ids`` whose chunks are present in
        some tier (nothing is read or touched), under ``extras`` as in :meth:`store`. Answered
        on the caller's thread when the CPU tier (or the lower tiers' non-blocking answers)
        decide it, else one batched hop; a timeout is a miss (0, counted in ``timeouts``)."""
        await yield_to_loop()
        self._check_open()
        plan = ChunkPlan(self.token_database, token_ids, extras)
        if not len(plan):
            return 0
        try:
            return plan.tokens_in(await self.storage_manager.prefix_len(plan.keys))
        except TimeoutError:  # the hop is bounded by blocking_timeout_secs
            self._timed_out("lookup")
            return 0

    lookup = blocking_twin(alookup)

    def _timed_out(self, what: str) -> None:
        """Count and log a lower-tier answer that did not come within ``blocking_timeout_secs``
        (the operation ``what`` answers it as a miss)."""
        self.timeouts += 1
        self._timeout_log.warning("KV %s: storage did not answer within blocking_timeout_secs; treated as a miss", what)

    # ---- lifecycle / stats ---------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """The KV manager's figures and, when enabled, the hidden-state store's."""
        hs = self.hidden_state_store
        return {
            "timeouts": self.timeouts,
            "kv": self.storage_manager.stats(),
            "hidden_states": None if hs is None or hs.closed else hs.stats(),
        }

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._closed

    def close(self) -> None:
        """Close the hidden-state store and the KV manager (pending lower-tier writes are
        flushed, bounded). Idempotent; later calls raise :class:`ManagerClosedError`.

        On the loop thread of either manager it raises :class:`LoopThreadCallError` before
        anything is closed: the engine stays open, and closable from another thread."""
        if self._closed:
            return
        hs = self.hidden_state_store
        for sm in (self.storage_manager, None if hs is None else hs.storage_manager):
            if sm is not None and not sm.closed and sm.loop_thread.in_loop_thread():
                raise LoopThreadCallError(
                    f"LMCacheEngine.close() on the loop thread of StorageManager {sm.name!r} "
                    "(it would deadlock); call it from another thread"
                )
        self._closed = True
        try:
            if self.hidden_state_store is not None:
                self.hidden_state_store.close()
        finally:
            self.storage_manager.close_sync()

    def __enter__(self) -> LMCacheEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> LMCacheEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Coroutine twin of :meth:`close` over the managers' own async close (awaitable from
        any loop, also a manager's own loop thread). Idempotent.

        Kept beside :meth:`close`, not derived from it: the manager's ``close_sync`` (stop and
        join its loop thread) is no coroutine a bridge could step, so the manager keeps that pair
        itself; both forms here only compose it."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.hidden_state_store is not None:
                await self.hidden_state_store.aclose()
        finally:
            await self.storage_manager.close()

    def __repr__(self) -> str:
        return (
            f"LMCacheEngine(model={self.metadata.model_name!r}, chunk_size={self.config.chunk_size}, "
            f"tiers={self.storage_manager.tier_names}, hidden_states={self.hidden_state_store is not None}, "
            f"closed={self._closed})"
        )
