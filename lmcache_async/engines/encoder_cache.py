"""The encoder cache (EC): multimodal encoder outputs keyed by the item's ``mm_hash``.

One entry is one tensor of any rank, dtype and shape (usually ``[num_tokens, hidden]``),
stored as :attr:`MemoryFormat.EC_TD` in the engine's own :class:`StorageManager` (its own pool,
its own loop thread, independent of the KV cache so neither evicts the other).

Keys are rank- and KV-independent: ``CacheEngineKey(model_name, world_size=1, worker_id=0,
chunk_hash=stable_u64_from_str(mm_hash), dtype=encoder_dtype)``. Every tensor-parallel rank
computes the same encoder output, so all ranks share one entry; changing the KV dtype never
changes an EC key. ``encoder_dtype`` is only the key's dtype field: an entry keeps the dtype
and shape of the tensor that was put.

Threads: every operation is written once, as an ``a``-prefixed coroutine awaitable from any
event loop; CPU-tier hits and puts that fit are answered on the caller's thread without a hop
(a hop only for lower-tier work), and awaited, a copy of at least
:data:`~lmcache_async.engines._offload.OFF_LOOP_COPY_BYTES` runs on the engine copy executor so
it does not freeze the caller's loop. The blocking method of the same name without the ``a``
(any thread except the manager's loop thread) is that coroutine stepped on the calling thread
by the manager's :class:`~lmcache_async.sync_bridge.SyncBridge`
(:func:`~lmcache_async.engines._twins.blocking_twin`): no loop, every copy inline, the same
results and errors. ``close``/``aclose`` stay a pair (the manager's own close is one).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any

import torch

from lmcache_async.config import LMCacheEngineConfig
from lmcache_async.dtypes import dtype_name, parse_dtype
from lmcache_async.engines import _offload
from lmcache_async.engines._devices import check_device
from lmcache_async.engines._offload import should_offload, yield_to_loop
from lmcache_async.engines._opening import EngineOpening
from lmcache_async.engines._result_memory import ResultBuffers
from lmcache_async.engines._twins import blocking_twin
from lmcache_async.keys import CacheEngineKey, stable_u64_from_str
from lmcache_async.memory import MemoryFormat, MemoryObj
from lmcache_async.metadata import NEUTRAL_METADATA, LMCacheEngineMetadata
from lmcache_async.storage_manager import StorageManager
from lmcache_async.sync_bridge import SyncBridge
from lmcache_async.tensor_checks import check_storable_tensor

__all__ = ["EC_KEY_WORKER_ID", "EC_KEY_WORLD_SIZE", "ECCacheEngine", "ec_cache_key"]

logger = logging.getLogger(__name__)

EC_KEY_WORLD_SIZE = 1
"""Sentinel ``world_size`` of every EC key (encoder outputs are identical on every TP rank)."""
EC_KEY_WORKER_ID = 0
"""Sentinel ``worker_id`` of every EC key."""

_KEY_CACHE_MAX = 1 << 16


def _check_mm_hash(mm_hash: object) -> str:
    if not isinstance(mm_hash, str):
        raise TypeError(f"mm_hash must be a str, got {type(mm_hash).__name__}")
    if not mm_hash:
        raise ValueError("mm_hash must be a non-empty str")
    return mm_hash


def _mm_hash_u64(mm_hash: str) -> int:
    """``stable_u64_from_str(mm_hash)``; ``ValueError`` naming ``mm_hash`` when it is not
    valid Unicode text (a lone surrogate has no UTF-8 form, so it has no hash)."""
    try:
        return stable_u64_from_str(mm_hash)
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"mm_hash must be valid Unicode text encodable as UTF-8, got {mm_hash!r} "
            f"({exc.reason} at position {exc.start})"
        ) from None


def ec_cache_key(model_name: str, mm_hash: str, encoder_dtype: torch.dtype) -> CacheEngineKey:
    """The EC key of ``mm_hash`` (rank sentinels, ``stable_u64_from_str`` hash, encoder dtype).

    ``TypeError`` for a non-str ``mm_hash``; ``ValueError`` naming it when it is empty or not
    encodable as UTF-8 (a lone surrogate)."""
    return CacheEngineKey(
        model_name,
        EC_KEY_WORLD_SIZE,
        EC_KEY_WORKER_ID,
        _mm_hash_u64(_check_mm_hash(mm_hash)),
        encoder_dtype,
    )


class ECCacheEngine:
    """Encoder-output cache over its own :class:`StorageManager`; see the module docstring.

    ``config`` is used as given (the EC overlay and EC defaults are applied by
    :func:`~lmcache_async.config.load_ec_engine_config`, which the vLLM connector calls).
    ``metadata`` supplies the model name (its ``world_size``/``worker_id``/``kv_dtype`` do not
    enter EC keys); ``encoder_dtype`` (a ``torch.dtype`` or a name such as ``"bfloat16"``) is
    the dtype field of every key.

    Return values have one meaning each: ``put`` is False only under transient pool pressure,
    ``get`` is None only on a miss (storage trouble and timeouts are misses, counted in
    :meth:`stats`). Caller mistakes raise ``TypeError``/``ValueError``; any call after
    :meth:`close` raises :class:`~lmcache_async.errors.ManagerClosedError`.
    """

    @classmethod
    def open(
        cls,
        config: LMCacheEngineConfig,
        metadata: LMCacheEngineMetadata | None,
        encoder_dtype: torch.dtype | str,
    ) -> EngineOpening[ECCacheEngine]:
        """Build the engine without blocking the caller's event loop: ``ec = await
        ECCacheEngine.open(config, meta, dtype)``, or ``async with ECCacheEngine.open(...) as
        ec:`` (closed on exit). The constructor runs on a worker thread; arguments and errors as
        for the constructor; a cancelled open leaves nothing running."""
        return EngineOpening(lambda: cls(config, metadata, encoder_dtype))

    def __init__(
        self,
        config: LMCacheEngineConfig,
        metadata: LMCacheEngineMetadata | None,
        encoder_dtype: torch.dtype | str,
    ) -> None:
        if not isinstance(config, LMCacheEngineConfig):
            raise TypeError(f"config must be an LMCacheEngineConfig, got {type(config).__name__}")
        if metadata is None:
            metadata = NEUTRAL_METADATA
        if not isinstance(metadata, LMCacheEngineMetadata):
            raise TypeError(f"metadata must be an LMCacheEngineMetadata, got {type(metadata).__name__}")
        if not isinstance(encoder_dtype, (torch.dtype, str)):
            raise TypeError(f"encoder_dtype must be a torch.dtype or a dtype name, got {type(encoder_dtype).__name__}")
        try:
            dtype = parse_dtype(encoder_dtype)
            dtype_name(dtype)
        except ValueError as exc:
            raise ValueError(f"encoder_dtype: {exc}") from None
        self.config = config
        self.metadata = metadata
        self.encoder_dtype = dtype
        self.model_name = metadata.model_name
        # The manager sees one logical rank, so a backend that namespaces by rank or KV dtype
        # still lets every TP rank (and every KV setting) share the same EC entries.
        sm_meta = dataclasses.replace(
            metadata,
            world_size=EC_KEY_WORLD_SIZE,
            worker_id=EC_KEY_WORKER_ID,
            kv_dtype=dtype,
            kv_shape=None,
        )
        self._sm = StorageManager(config, sm_meta, name="ec")
        # CPU results of large entries reuse the memory of results the caller dropped (fresh
        # memory costs a page fault per 4 KiB), holding at most as many bytes as the CPU tier.
        pool = self._sm.pool
        self._results = ResultBuffers(pool.capacity if pool is not None else 0)
        self._keys: dict[str, CacheEngineKey] = {}
        self._dtype_name = dtype_name(self.encoder_dtype)
        self._lock = threading.Lock()
        self._puts = 0
        self._puts_existing = 0
        self._puts_rejected = 0
        self._hits = 0
        self._misses = 0
        self._timeouts = 0
        logger.info(
            "encoder cache ready: tiers=%s model=%s dtype=%s",
            self._sm.tier_names,
            self.model_name,
            dtype,
        )

    # ---- keys ----
    def key(self, mm_hash: str) -> CacheEngineKey:
        """The cache key of ``mm_hash`` (memoised). ``TypeError`` for a non-str hash;
        ``ValueError`` naming ``mm_hash`` when it is empty or not encodable as UTF-8."""
        if type(mm_hash) is str:
            k = self._keys.get(mm_hash)
            if k is not None:
                return k
            if not mm_hash:
                raise ValueError("mm_hash must be a non-empty str")
            k = CacheEngineKey._trusted(  # fields validated once in __init__
                self.model_name,
                EC_KEY_WORLD_SIZE,
                EC_KEY_WORKER_ID,
                _mm_hash_u64(mm_hash),
                self.encoder_dtype,
                self._dtype_name,
            )
        else:
            k = ec_cache_key(self.model_name, mm_hash, self.encoder_dtype)  # raises TypeError
        keys = self._keys
        if len(keys) >= _KEY_CACHE_MAX:
            keys.clear()
        keys[mm_hash] = k
        return k

    @property
    def storage_manager(self) -> StorageManager:
        """The engine's own manager (for flushing, stats and tools)."""
        return self._sm

    @property
    def closed(self) -> bool:
        """True once :meth:`close` started."""
        return self._sm.closed

    @property
    def bridge(self) -> SyncBridge:
        """The manager's bridge: it steps every blocking method's coroutine on the calling
        thread (and refuses the manager's loop thread)."""
        return self._sm.bridge

    # ---- put ----
    def _count_put(self, stored: bool, existed: bool) -> None:
        with self._lock:
            if existed:
                self._puts_existing += 1
            elif stored:
                self._puts += 1
            else:
                self._puts_rejected += 1

    def _put_prologue(self, mm_hash: str, tensor: object) -> tuple[CacheEngineKey, torch.Tensor]:
        key = self._keys.get(mm_hash) if type(mm_hash) is str else None
        if key is None:
            key = self.key(mm_hash)
        tensor = check_storable_tensor(tensor, "tensor")
        # The copy must never join an autograd graph (the pool buffer would).
        return key, tensor.detach() if tensor.requires_grad else tensor

    async def aput(self, mm_hash: str, tensor: torch.Tensor) -> bool:
        """Store ``tensor`` (any device and shape; any dtype and rank the records store) under ``mm_hash``.

        One ``copy_`` into the pool (device→host included); the caller keeps ``tensor``, the
        cache does not. An ``mm_hash`` the CPU tier holds (or is still writing down) is not
        copied again (returns True); one only a lower tier claims is stored again, so a damaged
        record there never turns a True into a lost entry.
        Returns False only when the pool cannot take the entry right now (nothing evictable):
        it never waits. ``TypeError`` naming ``tensor`` for anything the cache cannot store (a
        non-tensor; a quantized, sparse, nested or meta tensor) and for a non-str hash.

        The copy runs on the caller's thread; awaited, one of at least
        :data:`~lmcache_async.engines._offload.OFF_LOOP_COPY_BYTES` runs on the engine copy
        executor instead (a caller cancelled meanwhile leaves the put to finish).
        """
        await yield_to_loop()
        key, src = self._put_prologue(mm_hash, tensor)
        sm = self._sm
        if sm.holds_locally(key):  # content-addressed: never copied twice
            self._count_put(True, True)
            return True
        if should_offload(src.numel() * src.element_size()):
            # On the copy executor: the manager's put answers there (it never waits for lower tiers).
            ok = await _offload.run_off_loop(lambda: sm.put_sync(key, src, MemoryFormat.EC_TD))
        else:
            ok = await sm.put(key, src, MemoryFormat.EC_TD)
        self._count_put(ok, False)
        return ok

    put = blocking_twin(aput)

    async def _present(self, key: CacheEngineKey) -> bool:
        """Whether some tier holds ``key``; a timeout is counted and answers False."""
        try:
            return await self._sm.contains(key)
        except TimeoutError:
            self._count_timeout()
            return False

    def _count_timeout(self) -> None:
        with self._lock:
            self._timeouts += 1

    # ---- get ----
    def _copy_out(self, obj: MemoryObj | None, device: torch.device) -> torch.Tensor | None:
        """A fresh tensor on ``device`` with the entry's values; releases ``obj`` on every path."""
        if obj is None:
            with self._lock:
                self._misses += 1
            return None
        try:
            src = obj.tensor
            # One copy into memory the caller owns (pool -> device directly). Both copies are
            # synchronous, so the pool block can be released as soon as they return.
            out = self._results.copy_of(src) if device.type == "cpu" else src.to(device=device, copy=True)
        finally:
            obj.ref_count_down()
        with self._lock:
            self._hits += 1
        return out

    async def aget(self, mm_hash: str, device: str | torch.device = "cpu") -> torch.Tensor | None:
        """The entry as a new tensor on ``device`` (its own dtype and shape), or None on a miss.

        The result never aliases a pool buffer and is the caller's alone: keep it as long as you
        like; later puts, evictions, deletes and gets never change it. A CPU result of at least
        :data:`~lmcache_async.engines._result_memory.MIN_RECYCLED_BYTES` may live in memory of
        an earlier result the caller dropped (no reference to it, its views or its storage
        left), so its storage is not resizable. An entry that left
        the CPU tier but lives in a lower tier (disk, remote, NIXL) is read from there (and
        promoted). Storage trouble and timeouts are misses. ``device`` is checked before the
        lookup: one this machine cannot hold a tensor on (``cuda:0`` without CUDA, ``meta``)
        raises ``ValueError`` naming ``device`` on a hit and on a miss alike. Awaited, a copy of
        at least :data:`~lmcache_async.engines._offload.OFF_LOOP_COPY_BYTES` runs on the engine
        copy executor (a caller cancelled meanwhile holds no pool reference).
        """
        await yield_to_loop()
        key = self.key(mm_hash)
        dev = check_device(device)
        try:
            obj = await self._sm.get(key)
        except TimeoutError:
            self._count_timeout()
            obj = None
        # _copy_out releases obj on every path, also when this caller is cancelled meanwhile.
        if obj is not None and should_offload(obj.tensor.numel() * obj.tensor.element_size()):
            return await _offload.run_off_loop(lambda: self._copy_out(obj, dev))
        return self._copy_out(obj, dev)

    get = blocking_twin(aget)

    # ---- contains / delete ----
    async def acontains(self, mm_hash: str) -> bool:
        """True when some tier holds ``mm_hash`` (a CPU hit answers in about a microsecond, on
        the caller's thread; a tier that fails or times out counts as absent)."""
        await yield_to_loop()
        key = self._keys.get(mm_hash) if type(mm_hash) is str else None
        return await self._present(self.key(mm_hash) if key is None else key)

    contains = blocking_twin(acontains)

    async def adelete(self, mm_hash: str) -> bool:
        """Remove ``mm_hash`` from every tier; True when some tier held it (a timeout is counted
        and answers False). Tensors returned by :meth:`get` are unaffected."""
        await yield_to_loop()
        key = self.key(mm_hash)
        try:
            return await self._sm.remove(key)
        except TimeoutError:
            self._count_timeout()
            return False

    delete = blocking_twin(adelete)

    # ---- flush / close / stats ----
    async def aflush(self, timeout: float | None = None) -> None:  # noqa: ASYNC109 - the blocking form's bound too
        """Wait until every lower-tier write queued so far finished (or failed); no-op without
        lower tiers. ``timeout`` bounds the wait (seconds; default ``blocking_timeout_secs``):
        ``TimeoutError`` when it passes (the writes go on)."""
        await yield_to_loop()
        await self._sm.flush(timeout)

    flush = blocking_twin(aflush)

    def close(self) -> None:
        """Flush pending writes (bounded), close the tiers, stop the loop. Idempotent.

        Tensors returned by :meth:`get` stay valid (they never alias the pool); the engine
        lets go of the result memory it kept for reuse.
        """
        self._sm.close_sync()
        self._results.clear()

    async def aclose(self) -> None:
        """Async twin of :meth:`close`, awaitable from any event loop."""
        await self._sm.close()
        self._results.clear()

    def stats(self) -> dict[str, Any]:
        """Engine counters plus the manager's per-tier stats under ``"storage"``;
        ``result_memory_bytes`` is the memory kept for CPU results (handed out or free for
        reuse, at most the CPU tier's capacity)."""
        with self._lock:
            engine = {
                "puts": self._puts,
                "puts_existing": self._puts_existing,
                "puts_rejected": self._puts_rejected,
                "hits": self._hits,
                "misses": self._misses,
                "timeouts": self._timeouts,
            }
        engine["result_memory_bytes"] = self._results.held_bytes
        return {
            "model_name": self.model_name,
            "encoder_dtype": dtype_name(self.encoder_dtype),
            **engine,
            "storage": self._sm.stats(),
        }

    def __enter__(self) -> ECCacheEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> ECCacheEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return (
            f"ECCacheEngine(model={self.model_name!r}, "
            f"encoder_dtype={dtype_name(self.encoder_dtype)}, "
            f"tiers={self._sm.tier_names}, closed={self.closed})"
        )
