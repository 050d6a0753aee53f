"""The hidden-state store: per-token activations cached beside the KV chunks they belong to.

A downstream stage (a "talker") that consumes an upstream stage's ("thinker's") hidden states
cannot rebuild them from KV. This store keeps them, chunked exactly like the KV cache:

* **Keys.** Chunk keys come from the KV engine's token database, so HS chunk ``i`` has the same
  :class:`CacheEngineKey` as KV chunk ``i``. One entry per ``(chunk, layer_idx)`` lives in the
  store's own manager under :func:`hs_entry_key` — the KV key plus the tag
  ``lmcache.tag.hs_layer`` (string form ``...@hs_layer%<layer>``), so it can never collide with a
  KV entry even in a shared tier.
* **Memory.** Its own CPU pool of ``max_hidden_state_cpu_size`` GiB (a separate
  :class:`StorageManager` named ``hs`` without lower tiers): hidden states live in CPU memory
  only. Pressure on it evicts hidden states only (its LRU), never KV.
* **Coupled eviction, lazily.** A retrieve asks the KV manager (any tier) whether the KV of the
  hit chunks is still there and stops at the first chunk where KV or HS is missing. An HS entry
  whose KV is *definitely* gone is dropped; a tier that failed to answer means "unknown":
  the prefix stops there and nothing is dropped.

Thread-safe: worker threads may store while others retrieve. Every operation is written once,
as an ``a``-prefixed coroutine over the managers' coroutines, awaitable from any loop: the HS
manager has no lower tiers, so its answers never leave the caller's thread; only a KV presence
question a lower tier must answer crosses to the KV manager's loop (one batch). Awaited, a copy
of at least :data:`~lmcache_async.engines._offload.OFF_LOOP_COPY_BYTES` runs on the engine copy
executor, so the caller's loop is not frozen by it. The blocking method of the same name without
the ``a`` is that coroutine stepped on the calling thread by :attr:`HiddenStateStore.bridge`
(:func:`~lmcache_async.engines._twins.blocking_twin`): no loop, every copy inline, the same
results and errors.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Any

import torch

from lmcache_async.config import LMCacheEngineConfig
from lmcache_async.engines import _offload
from lmcache_async.engines._chunks import ChunkPlan, copy_in, copy_out, plan_of, release_all, wait_copies
from lmcache_async.engines._hs_parts import StoreJob, check_layer, check_out, cut_hits, well_shaped
from lmcache_async.engines._offload import should_offload, yield_to_loop
from lmcache_async.engines._twins import blocking_twin
from lmcache_async.errors import LoopThreadCallError, ManagerClosedError
from lmcache_async.key_extras import KeyExtras
from lmcache_async.keys import TAG_PREFIX, CacheEngineKey
from lmcache_async.memory import MemoryFormat, MemoryObj
from lmcache_async.metadata import LMCacheEngineMetadata
from lmcache_async.ratelog import RateLimitedLog
from lmcache_async.storage_manager import StorageManager
from lmcache_async.sync_bridge import SyncBridge
from lmcache_async.tensor_checks import check_storable_tensor
from lmcache_async.tiers import Presence
from lmcache_async.token_database import ChunkedTokenDatabase

__all__ = ["HS_LAYER_TAG", "HiddenStateStore", "hs_entry_key"]

logger = logging.getLogger(__name__)

_HS_LAYER = "hs_layer"
HS_LAYER_TAG = TAG_PREFIX + _HS_LAYER
"""``request_configs`` key of the tag that turns a KV chunk key into an HS entry key."""

_STORAGE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def hs_entry_key(kv_key: CacheEngineKey, layer_idx: int) -> CacheEngineKey:
    """The key under which layer ``layer_idx`` of the KV chunk ``kv_key`` is stored.

    It is ``kv_key`` with the tag ``hs_layer=<layer_idx>`` added (string form
    ``<kv key>@hs_layer%<layer_idx>``); KV keys never carry that tag, so the two never collide.
    """
    return kv_key.with_tag(_HS_LAYER, str(layer_idx))


class HiddenStateStore:
    """Per-chunk hidden-state cache on its own CPU pool; see the module docstring.

    ``config`` supplies ``chunk_size``, ``save_unfull_chunk``, ``max_hidden_state_cpu_size``
    (GiB, must be > 0: ``ValueError`` naming the key otherwise), ``hidden_state_layers`` (an
    optional allowlist) and ``hidden_state_storage_dtype``. ``token_database`` must be the KV
    engine's (built from ``config``/``metadata`` when omitted) and ``kv_storage_manager`` the
    KV engine's manager; without one, KV presence is not checked (HS-only prefixes).

    :class:`~lmcache_async.engines.kv.LMCacheEngine` builds one as ``engine.hidden_state_store``
    when ``enable_hidden_state_cache`` is true. ``token_database`` and ``kv_storage_manager`` are
    keyword-only: LMCache's ``HiddenStateStore(config, token_database)`` raises ``TypeError``
    naming ``metadata``, the second positional argument.
    """

    def __init__(
        self,
        config: LMCacheEngineConfig,
        metadata: LMCacheEngineMetadata | None = None,
        *,
        token_database: ChunkedTokenDatabase | None = None,
        kv_storage_manager: StorageManager | None = None,
    ) -> None:
        if not isinstance(config, LMCacheEngineConfig):
            raise TypeError(f"config must be an LMCacheEngineConfig, got {type(config).__name__}")
        if isinstance(metadata, ChunkedTokenDatabase):
            raise TypeError(
                "metadata (the second positional argument) must be an LMCacheEngineMetadata or None, "
                "got a ChunkedTokenDatabase; pass the KV engine's token database by keyword: "
                "HiddenStateStore(config, metadata, token_database=...)"
            )
        if metadata is not None and not isinstance(metadata, LMCacheEngineMetadata):
            raise TypeError(
                "metadata (the second positional argument) must be an LMCacheEngineMetadata or None, "
                f"got {type(metadata).__name__}"
            )
        size = config.max_hidden_state_cpu_size
        if not size > 0:
            raise ValueError(
                f"max_hidden_state_cpu_size must be > 0 when the hidden-state cache is enabled "
                f"(enable_hidden_state_cache), got {size!r}"
            )
        if token_database is None:
            token_database = ChunkedTokenDatabase(config.chunk_size, config.save_unfull_chunk, metadata)
        elif not isinstance(token_database, ChunkedTokenDatabase):
            raise TypeError(f"token_database must be a ChunkedTokenDatabase, got {type(token_database).__name__}")
        if kv_storage_manager is not None and not isinstance(kv_storage_manager, StorageManager):
            raise TypeError(f"kv_storage_manager must be a StorageManager, got {type(kv_storage_manager).__name__}")
        self.token_database = token_database
        self.kv_storage_manager = kv_storage_manager
        self.storage_dtype: torch.dtype = _STORAGE_DTYPES[config.hidden_state_storage_dtype]
        layers = config.hidden_state_layers
        self.layer_allowlist: frozenset[int] | None = None if layers is None else frozenset(layers)
        # The HS pool is CPU memory whatever the KV tiers are: force the CPU tier on and keep
        # the metrics server (if any) with the KV manager.
        hs_config = config.clone()
        hs_config.local_cpu = True
        hs_config.metrics_port = None
        self.storage_manager = StorageManager(
            hs_config,
            metadata if metadata is not None else token_database.metadata,
            name="hs",
            cpu_size_gib=size,
            cpu_size_key="max_hidden_state_cpu_size",
            lower_tiers=False,
        )
        self._lock = threading.Lock()
        self._timeout_log = RateLimitedLog(logger)
        self._known_layers: set[int] = set()
        self._closed = False
        self._counts: dict[str, int] = dict.fromkeys(
            (
                "stores",
                "chunks_stored",
                "chunks_already_present",
                "stores_truncated",
                "filtered_by_allowlist",
                "retrieves",
                "retrieve_hits",
                "hit_tokens",
                "orphans_dropped",
                "kv_unknown",
            ),
            0,
        )

    # ---- helpers ------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ManagerClosedError("HiddenStateStore is closed")

    def _count(self, **deltas: int) -> None:
        with self._lock:
            c = self._counts
            for k, v in deltas.items():
                c[k] += v

    @property
    def bridge(self) -> SyncBridge:
        """The bridge that steps every blocking method's coroutine on the calling thread: the KV
        manager's when there is one (every hop of an operation here is a KV presence question:
        the HS manager has no lower tiers), else the HS manager's."""
        kv = self.kv_storage_manager
        return (kv if kv is not None else self.storage_manager).bridge

    async def _kv_prefix(self, plan: ChunkPlan, m: int) -> int:
        """How many of the first ``m`` chunks still have KV; drops the HS entries of the first
        chunk whose KV is definitely gone (never on "unknown"). A CPU-tier answer stays on the
        caller's thread; a lower-tier question is one hop to the KV manager's loop, bounded by
        its ``blocking_timeout_secs`` (a timeout: "unknown", no prefix)."""
        kv = self.kv_storage_manager
        if kv is None or m == 0:
            return m
        keys = plan.keys
        try:
            n = await kv.prefix_len(keys[:m])
        except TimeoutError:
            return self._kv_timed_out()
        if n < m:
            presence = await kv.presence(keys[n])  # a timeout answers UNKNOWN
            # PRESENT means a racing store just wrote it: still this call's prefix boundary.
            if presence is Presence.ABSENT:
                if await self._drop_layers(keys[n]):
                    self._count(orphans_dropped=1)
            elif presence is Presence.UNKNOWN:
                self._count(kv_unknown=1)
        return n

    def _kv_timed_out(self) -> int:
        self._count(kv_unknown=1)
        self._timeout_log.warning("hidden-state store: the KV manager did not answer in time; no prefix")
        return 0

    # ---- store --------------------------------------------------------------------------------
    def _plan_store(
        self, token_ids: Any, hidden_states: torch.Tensor, layer_idx: int, token_offset: int, extras: KeyExtras | None
    ) -> StoreJob | None:
        """Checks and plans a store on the caller's thread; None when the layer is filtered."""
        self._check_open()
        layer_idx = check_layer(layer_idx)
        hidden_states = check_storable_tensor(hidden_states, "hidden_states")
        if hidden_states.dim() != 2:
            raise ValueError(
                f"hidden_states must be 2-D [num_tokens, hidden_dim], got shape {tuple(hidden_states.shape)}"
            )
        if not hidden_states.dtype.is_floating_point:
            raise TypeError(f"hidden_states must be a floating-point tensor, got {hidden_states.dtype}")
        if not isinstance(token_offset, int) or isinstance(token_offset, bool):
            raise TypeError(f"token_offset must be an int, got {type(token_offset).__name__}")
        plan = self._plan(token_ids, extras)
        n_tokens = plan.n_tokens
        if not 0 <= token_offset <= n_tokens:
            raise ValueError(f"token_offset must be in [0, len(token_ids)={n_tokens}], got {token_offset}")
        rows = hidden_states.shape[0]
        if rows != n_tokens - token_offset:
            raise ValueError(
                f"hidden_states has {rows} rows; expected len(token_ids) - token_offset = "
                f"{n_tokens} - {token_offset} = {n_tokens - token_offset}"
            )
        if self.layer_allowlist is not None and layer_idx not in self.layer_allowlist:
            self._count(filtered_by_allowlist=1)
            return None
        with self._lock:
            self._known_layers.add(layer_idx)
        first = -(-token_offset // plan.chunk_size)
        hkeys = [hs_entry_key(k, layer_idx) for k in plan.keys]
        return StoreJob(plan, layer_idx, hidden_states.detach(), token_offset, first, hkeys)

    def _write(self, job: StoreJob, found: list[MemoryObj | None]) -> int:
        """Copy the chunks of ``job`` that ``found`` (this store's manager's answer for every
        entry key, each a reference or None) lacks into the pool and index them; returns the
        chunks written.

        Blocking; any thread but the HS manager's loop thread. Releases every reference in
        ``found`` and every one it takes, on every path (an abandoned off-loop job leaks nothing).
        """
        sm = self.storage_manager
        plan, src, first, hkeys = job.plan, job.src, job.first, job.hkeys
        hidden = src.shape[1]
        held: list[MemoryObj] = []  # references keeping this call's chunks unevictable
        new: list[MemoryObj] = []
        new_keys: list[CacheEngineKey] = []
        order: list[CacheEngineKey] = list(hkeys[:first])
        in_flight = False
        truncated = False
        existing_count = 0
        stored = 0
        try:
            # This prompt's chunks before the offset stay held too: this call's allocations must
            # not evict them (that would leave a hole in front of the chunks it stores).
            for i in range(first, len(plan)):
                old = found[i]
                if old is not None:
                    held.append(old)
                    found[i] = None
                    order.append(hkeys[i])
                    existing_count += 1
                    continue
                start, end = plan.start(i), plan.end(i)
                obj = sm.allocate((end - start, hidden), self.storage_dtype, MemoryFormat.HS_TD)
                if obj is None:
                    truncated = True
                    break
                held.append(obj)
                off = job.token_offset
                in_flight |= copy_in(obj.tensor, src[start - off : end - off])
                new.append(obj)
                new_keys.append(hkeys[i])
                order.append(hkeys[i])
            if in_flight:
                wait_copies(src)
            if new:
                sm.batched_put_sync(new_keys, new)
                # The manager took its own reference when it indexed a block.
                stored = sum(1 for obj in new if obj.get_ref_count() > 1)
            # Newest-first touches make the prefix (also the part before token_offset) the most
            # recently used: under pressure a prompt loses its suffix before its prefix.
            sm.touch(order[::-1])
        finally:
            release_all(held)
            release_all(found)
        self._count(
            stores=1,
            chunks_stored=stored,
            chunks_already_present=existing_count,
            stores_truncated=int(truncated),
        )
        if truncated:
            logger.debug(
                "hidden-state pool full: stored %d of %d chunks of layer %d",
                stored + existing_count,
                len(plan) - first,
                job.layer_idx,
            )
        return stored

    async def astore_hidden_states(
        self,
        token_ids: Any,
        hidden_states: torch.Tensor,
        layer_idx: int = 0,
        token_offset: int = 0,
        *,
        extras: KeyExtras | None = None,
    ) -> int:
        """Store ``hidden_states`` for ``token_ids`` under the KV chunk keys; returns the number
        of chunks this call wrote.

        ``token_ids`` is the full prefix (1-D ints); ``hidden_states`` is 2-D
        ``[len(token_ids) - token_offset, hidden_dim]`` (any device and floating dtype), row ``r``
        belonging to token ``token_offset + r``; it is copied, never kept. Only whole chunks that
        start at or after ``token_offset`` are stored (a chunk straddling the offset is skipped);
        a chunk already stored for this layer is not copied again (and not counted). A
        ``layer_idx`` outside ``hidden_state_layers`` stores nothing and returns 0.

        When the pool cannot hold every chunk, older hidden-state entries are evicted (never the
        chunks this call stores or already found for this prompt) and the longest prefix of the
        chunks that fits is stored. Raises ``TypeError``/``ValueError`` for bad arguments
        (``TypeError`` naming ``hidden_states`` for a non-tensor and for a quantized, sparse,
        nested or meta tensor). Answered on the caller's thread (the HS pool has no lower tiers:
        no hop); awaited, a copy of at least
        :data:`~lmcache_async.engines._offload.OFF_LOOP_COPY_BYTES` runs on the engine copy
        executor, and a caller cancelled meanwhile leaves the store to finish, holding nothing.

        ``extras`` (:class:`~lmcache_async.key_extras.KeyExtras`) enter the chunk keys exactly as
        for the KV records: hidden states are found again only under equal extras. ``token_ids``
        may also be a :class:`~lmcache_async.engines._chunks.ChunkPlan` whose keys were derived
        already (then ``extras`` must be None).
        """
        await yield_to_loop()
        job = self._plan_store(token_ids, hidden_states, layer_idx, token_offset, extras)
        if job is None:
            return 0
        sm = self.storage_manager
        found = await sm.batched_get(job.hkeys)
        # Awaited on the HS manager's loop thread, _write's put (a blocking call) must leave it.
        if should_offload(job.nbytes, force=sm.loop_thread.in_loop_thread()):
            return await _offload.run_off_loop(lambda: self._write(job, found))
        return self._write(job, found)

    store_hidden_states = blocking_twin(astore_hidden_states)

    # ---- retrieve -------------------------------------------------------------------------------
    def _fill(
        self, plan: ChunkPlan, hits: list[MemoryObj], hkeys: list[CacheEngineKey], out: torch.Tensor | None
    ) -> torch.Tensor:
        """Copy the ``hits`` (a non-empty prefix) into a fresh tensor or ``out``; touch them.

        Blocking; any thread. Releases every reference in ``hits`` on every path."""
        try:
            n = len(hits)
            total = plan.tokens_in(n)
            hidden = hits[0].shape[1]
            if out is None:
                dest = torch.empty((total, hidden), dtype=torch.float32)
            else:
                if out.shape[0] < total or out.shape[1] != hidden:
                    raise ValueError(
                        f"out has shape {tuple(out.shape)}; expected at least {total} rows and "
                        f"{hidden} columns for this prefix"
                    )
                dest = out[:total]
            in_flight = False
            for i, obj in enumerate(hits):
                in_flight |= copy_out(dest[plan.start(i) : plan.end(i)], obj.tensor)
            if in_flight:
                wait_copies(dest)
            self.storage_manager.touch(hkeys[:n][::-1])
        finally:
            release_all(hits)
        self._count(retrieves=1, retrieve_hits=1, hit_tokens=total)
        return dest

    async def aretrieve_hidden_states(
        self, token_ids: Any, layer_idx: int = 0, out: torch.Tensor | None = None, *, extras: KeyExtras | None = None
    ) -> torch.Tensor | None:
        """The cached hidden states of the longest prefix of ``token_ids`` whose chunks have
        both KV (any tier) and HS for ``layer_idx``, as float32 ``[n_tokens, hidden_dim]``; None
        when the first chunk already misses.

        Without ``out`` the result is a fresh contiguous CPU tensor the caller owns. With ``out``
        (a float32 tensor with at least ``n_tokens`` rows and ``hidden_dim`` columns, on any
        device) the rows are copied into it and the filled view ``out[:n_tokens]`` is returned;
        ``out`` is untouched on a miss. The hit chunks are touched so a prefix outlives its
        suffix under pressure. The caller never holds pool memory. ``extras`` and ``token_ids``
        as in :meth:`store_hidden_states`.

        Answered on the caller's thread when the KV manager's CPU tier decides KV presence (no
        hop); otherwise one batched hop to the KV manager's loop. Awaited, a copy of at least
        :data:`~lmcache_async.engines._offload.OFF_LOOP_COPY_BYTES` runs on the engine copy
        executor; a caller cancelled at any point leaves no pool reference held (with ``out``,
        a copy already running still fills it)."""
        await yield_to_loop()
        self._check_open()
        layer_idx = check_layer(layer_idx)
        check_out(out)
        plan = self._plan(token_ids, extras)
        sm = self.storage_manager
        hkeys = [hs_entry_key(k, layer_idx) for k in plan.keys]
        m = await sm.prefix_len(hkeys)
        hits = well_shaped(plan, await sm.batched_get(hkeys[:m]) if m else [])
        try:
            n = await self._kv_prefix(plan, len(hits))
        except BaseException:  # cancelled while the KV manager answered: nothing stays held
            release_all(hits)
            raise
        hits = cut_hits(hits, n)
        if not hits:
            self._count(retrieves=1)
            return None
        if should_offload(plan.tokens_in(len(hits)) * hits[0].shape[1] * 4):
            return await _offload.run_off_loop(lambda: self._fill(plan, hits, hkeys, out))
        return self._fill(plan, hits, hkeys, out)

    retrieve_hidden_states = blocking_twin(aretrieve_hidden_states)

    async def acoverage(
        self, token_ids: Any, layer_idxs: Iterable[int] = (0,), *, extras: KeyExtras | None = None
    ) -> int:
        """Tokens of the longest prefix of ``token_ids`` whose chunks have KV and HS for every
        layer in ``layer_idxs`` (same rules as retrieve, orphans dropped the same way; nothing
        is copied or touched). For schedulers that must know how far hidden states reach. HS
        presence is answered on the caller's thread; KV presence as in
        :meth:`retrieve_hidden_states`."""
        await yield_to_loop()
        plan, layers = self._coverage_args(token_ids, layer_idxs, extras)
        return plan.tokens_in(await self._kv_prefix(plan, self._hs_prefix(plan, layers)))

    coverage = blocking_twin(acoverage)

    def _hs_prefix(self, plan: ChunkPlan, layers: list[int]) -> int:
        """Chunks of the prefix that have HS for every layer; on the caller's thread (the HS
        manager has no lower tiers: its ``contains_sync`` never hops)."""
        sm = self.storage_manager
        m = 0
        for kv_key in plan.keys:
            if not all(sm.contains_sync(hs_entry_key(kv_key, li)) for li in layers):
                break
            m += 1
        return m

    def _plan(self, token_ids: Any, extras: KeyExtras | None) -> ChunkPlan:
        """:func:`~lmcache_async.engines._chunks.plan_of` over this store's token database."""
        return plan_of(self.token_database, token_ids, extras)

    def _coverage_args(
        self, token_ids: Any, layer_idxs: Iterable[int], extras: KeyExtras | None
    ) -> tuple[ChunkPlan, list[int]]:
        self._check_open()
        layers = [check_layer(li, "layer_idxs entries") for li in layer_idxs]
        if not layers:
            raise ValueError("layer_idxs must name at least one layer")
        return self._plan(token_ids, extras), layers

    # ---- per-key -------------------------------------------------------------------------------
    async def ahas_chunk(self, key: CacheEngineKey, layer_idx: int = 0) -> bool:
        """True when hidden states of ``layer_idx`` are stored for the KV chunk key ``key``
        (HS only: KV presence is not checked). Answered on the caller's thread (no hop)."""
        await yield_to_loop()
        self._check_open()
        if type(key) is not CacheEngineKey:
            raise TypeError(f"key must be a CacheEngineKey, got {type(key).__name__}")
        return await self.storage_manager.contains(hs_entry_key(key, check_layer(layer_idx)))

    has_chunk = blocking_twin(ahas_chunk)

    async def adrop_key(self, key: CacheEngineKey) -> bool:
        """Drop every layer stored for the KV chunk key ``key``; True when something was dropped.
        Answered on the caller's thread (the HS manager has no lower tiers: no hop)."""
        await yield_to_loop()
        return await self._drop_layers(key)

    drop_key = blocking_twin(adrop_key)

    async def _drop_layers(self, key: CacheEngineKey) -> bool:
        """:meth:`adrop_key` without its turn of the loop (also a step of :meth:`_kv_prefix`)."""
        sm = self.storage_manager
        removed = False
        for hkey in self._layer_keys(key):
            removed = await sm.remove(hkey) or removed
        return removed

    def _layer_keys(self, key: CacheEngineKey) -> list[CacheEngineKey]:
        self._check_open()
        if type(key) is not CacheEngineKey:
            raise TypeError(f"key must be a CacheEngineKey, got {type(key).__name__}")
        with self._lock:
            layers = sorted(self._known_layers)
        return [hs_entry_key(key, li) for li in layers]

    # ---- lifecycle / stats ---------------------------------------------------------------------
    async def aclear(self) -> None:
        """Drop every hidden-state entry (the pool returns to zero bytes in use); no hop."""
        await yield_to_loop()
        self._check_open()
        await self.storage_manager.clear()

    clear = blocking_twin(aclear)

    def stats(self) -> dict[str, Any]:
        """Counters (stores, chunks stored, truncated stores, retrieves, hit tokens, orphans
        dropped, KV answers that were unknown), the layers seen, and the pool/tier figures."""
        with self._lock:
            out: dict[str, Any] = dict(self._counts)
            out["layers"] = sorted(self._known_layers)
        sm_stats = self.storage_manager.stats()
        cpu = sm_stats["tiers"].get("cpu", {})
        out.update(
            entries=cpu.get("entries", 0),
            bytes=cpu.get("bytes", 0),
            evictions=cpu.get("evictions", 0),
            pool=sm_stats["pool"],
            storage_dtype=str(self.storage_dtype).removeprefix("torch."),
            layer_allowlist=None if self.layer_allowlist is None else sorted(self.layer_allowlist),
        )
        return out

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._closed

    def close(self) -> None:
        """Free every entry and the pool; idempotent. The KV manager is not closed.

        On this store's manager's loop thread it raises :class:`LoopThreadCallError` before
        anything is closed: the store stays open, and closable from another thread."""
        if self._closed:
            return
        sm = self.storage_manager
        if not sm.closed and sm.loop_thread.in_loop_thread():
            raise LoopThreadCallError(
                f"HiddenStateStore.close() on the loop thread of StorageManager {sm.name!r} "
                "(it would deadlock); call it from another thread"
            )
        self._closed = True
        self.storage_manager.close_sync()

    def __enter__(self) -> HiddenStateStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- close (a pair: see close) --------------------------------------------------------------
    async def aclose(self) -> None:
        """Coroutine twin of :meth:`close` over the manager's async close (awaitable from any
        loop, also the manager's own loop thread). Idempotent; the KV manager is not closed.

        Kept beside :meth:`close`, not derived from it: the manager's ``close_sync`` (stop and
        join its loop thread) is no coroutine a bridge could step, so the manager keeps that pair
        itself; both forms here only compose it."""
        if self._closed:
            return
        self._closed = True
        await self.storage_manager.close()

    def __repr__(self) -> str:
        return (
            f"HiddenStateStore(pool={self.storage_manager.pool.capacity if self.storage_manager.pool else 0}"
            f" bytes, dtype={self.storage_dtype}, closed={self._closed})"
        )
