"""Helpers shared by the KV engine and the hidden-state store: chunk keys and copies.

Keys are exactly those of :meth:`ChunkedTokenDatabase.process_tokens` (same normative chain
hash, same identity fields). Building a key costs a good fraction of hashing its chunk, so each
token database gets a bounded map chunk hash -> key of recently seen chunks (all fields but the
hash are fixed per database): looking up a prompt whose chunks were stored or looked up before
costs a dict probe per chunk instead.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from lmcache_async.key_extras import KeyExtras, extras_or_none
from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import MemoryObj
from lmcache_async.token_database import ChunkedTokenDatabase, chain_hashes, tokens_to_int64_bytes

KEY_CACHE_SIZE = 1 << 16
"""Keys remembered per token database (~250 bytes each; 16 Mi tokens at chunk_size 256)."""


class KeyCache:
    """Bounded chunk hash -> key map of one token database; thread-safe, oldest dropped first."""

    def __init__(self, db: ChunkedTokenDatabase, capacity: int = KEY_CACHE_SIZE) -> None:
        self._make = db.make_keys
        self._map: dict[int, CacheEngineKey] = {}
        self._lock = threading.Lock()
        self.capacity = capacity

    def keys(self, hashes: Sequence[int]) -> list[CacheEngineKey]:
        """The key of every chunk hash, in order."""
        get = self._map.get
        out = [get(h) for h in hashes]
        missing = [i for i, k in enumerate(out) if k is None]
        if missing:
            fresh = list(zip((hashes[i] for i in missing), self._make([hashes[i] for i in missing]), strict=True))
            with self._lock:
                m = self._map
                for i, (h, k) in zip(missing, fresh, strict=True):
                    out[i] = m.setdefault(h, k)
                if len(m) > self.capacity:
                    for h in list(itertools.islice(m, len(m) - self.capacity * 3 // 4)):
                        del m[h]
        return out  # type: ignore[return-value]

    def clear(self) -> None:
        """Forget every remembered key (for benchmarks of the cold path)."""
        with self._lock:
            self._map.clear()

    def __len__(self) -> int:
        return len(self._map)


_key_caches: weakref.WeakKeyDictionary[ChunkedTokenDatabase, KeyCache] = weakref.WeakKeyDictionary()
_key_caches_lock = threading.Lock()


def key_cache(db: ChunkedTokenDatabase) -> KeyCache:
    """The key cache of ``db`` (shared by every engine and store using that database)."""
    kc = _key_caches.get(db)
    if kc is None:
        with _key_caches_lock:
            kc = _key_caches.get(db)
            if kc is None:
                kc = _key_caches[db] = KeyCache(db)
    return kc


class ChunkPlan:
    """The chunks of one prompt: ``n_tokens``, the chunk ``keys`` in order and their spans.

    Chunk ``i`` covers tokens ``[i * chunk_size, min((i + 1) * chunk_size, n_tokens))``; with
    ``save_unfull_chunk`` false the trailing partial chunk is not part of the plan. ``extras``
    (:class:`~lmcache_async.key_extras.KeyExtras` or None; ``TypeError`` naming it otherwise)
    enter the chunk keys as in :meth:`ChunkedTokenDatabase.chunk_hashes`.
    """

    __slots__ = ("chunk_size", "keys", "n_tokens")

    def __init__(self, db: ChunkedTokenDatabase, token_ids: Any, extras: KeyExtras | None = None) -> None:
        data = tokens_to_int64_bytes(token_ids)
        self.n_tokens = len(data) // 8
        self.chunk_size = db.chunk_size
        hashes = chain_hashes(data, db.chunk_size, db.save_unfull_chunk, extras_or_none(extras))
        self.keys: list[CacheEngineKey] = key_cache(db).keys(hashes)

    @classmethod
    def of_hashes(cls, db: ChunkedTokenDatabase, hashes: Sequence[int], n_tokens: int) -> ChunkPlan:
        """The plan of a prompt of ``n_tokens`` whose chunk hashes were derived already (by a
        scheduler that read the request's extras): ``hashes[i]`` is chunk ``i``'s. ``ValueError``
        when there are more hashes than chunks of ``n_tokens``."""
        cs = db.chunk_size
        most = -(-n_tokens // cs) if db.save_unfull_chunk else n_tokens // cs
        if len(hashes) > most:
            raise ValueError(f"{len(hashes)} chunk hashes for a prompt of {n_tokens} tokens (chunk_size {cs})")
        plan = cls.__new__(cls)
        plan.n_tokens = n_tokens
        plan.chunk_size = cs
        plan.keys = key_cache(db).keys(list(hashes))
        return plan

    def head(self, n_chunks: int) -> ChunkPlan:
        """The plan of this prompt's first ``n_chunks`` chunks (same keys, fewer tokens)."""
        n_chunks = max(0, min(n_chunks, len(self.keys)))
        plan = ChunkPlan.__new__(ChunkPlan)
        plan.chunk_size = self.chunk_size
        plan.keys = self.keys[:n_chunks]
        plan.n_tokens = self.tokens_in(n_chunks)
        return plan

    def __len__(self) -> int:
        return len(self.keys)

    def start(self, i: int) -> int:
        """First token of chunk ``i``."""
        return i * self.chunk_size

    def end(self, i: int) -> int:
        """One past the last token of chunk ``i``."""
        return min((i + 1) * self.chunk_size, self.n_tokens)

    def tokens_in(self, n_chunks: int) -> int:
        """Tokens covered by the first ``n_chunks`` chunks."""
        return self.end(n_chunks - 1) if n_chunks > 0 else 0


def plan_of(db: ChunkedTokenDatabase, token_ids: Any, extras: KeyExtras | None = None) -> ChunkPlan:
    """The chunk plan of ``token_ids`` under ``extras``; a :class:`ChunkPlan` given as
    ``token_ids`` is returned as it is (``ValueError`` when ``extras`` come with it: its keys
    hold them already)."""
    if isinstance(token_ids, ChunkPlan):
        if extras is not None:
            raise ValueError("extras must be None when token_ids is a ChunkPlan (its keys hold them)")
        return token_ids
    return ChunkPlan(db, token_ids, extras)


def release_all(objs: Sequence[MemoryObj | None]) -> None:
    """Give back one reference of each object (``None`` entries are skipped)."""
    for o in objs:
        if o is not None:
            o.ref_count_down()


def copy_in(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Copy ``src`` (any device, dtype, strides) into the pool view ``dst`` in one copy.

    A CUDA source lands in (pinned) host memory asynchronously; the return value says so, and
    the caller must call :func:`wait_copies` on the source before anyone reads ``dst``.
    """
    asynchronous = src.device.type == "cuda" and dst.is_pinned()
    dst.copy_(src, non_blocking=asynchronous)
    return asynchronous


def copy_out(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Copy the pool view ``src`` into ``dst`` (any device); True when it was left in flight on
    a CUDA stream (call :func:`wait_copies` on ``dst`` before releasing ``src``)."""
    asynchronous = dst.device.type == "cuda" and src.is_pinned()
    dst.copy_(src, non_blocking=asynchronous)
    return asynchronous


def wait_copies(t: torch.Tensor) -> None:
    """Wait for copies enqueued on the current CUDA stream of ``t``'s device."""
    if t.device.type == "cuda":
        torch.cuda.current_stream(t.device).synchronize()
