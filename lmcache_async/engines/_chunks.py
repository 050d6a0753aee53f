"""Helpers shared by the KV engine and the hidden-state store: chunk keys and copies.

Keys are exactly those of :meth:`ChunkedTokenDatabase.process_tokens` (same normative chain
hash, same identity fields). Token tensors are turned into int64 bytes through one zero-copy
view instead of the database's generic path, because an engine hashes every prompt on its hot
path (131,072 tokens: ~30 µs here instead of milliseconds).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch

from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import MemoryObj, address_view
from lmcache_async.token_database import ChunkedTokenDatabase, chain_hashes, tokens_to_int64_bytes

_LITTLE_ENDIAN = sys.byteorder == "little"


def token_bytes(token_ids: Any) -> bytes:
    """Token ids as int64 little-endian bytes (the input of the chunk hash).

    Accepts what :func:`~lmcache_async.token_database.tokens_to_int64_bytes` accepts and raises
    the same ``TypeError``/``ValueError`` for anything else.
    """
    if isinstance(token_ids, torch.Tensor) and _LITTLE_ENDIAN:
        if token_ids.dim() != 1:
            raise ValueError(f"token_ids must be 1-D, got shape {tuple(token_ids.shape)}")
        dt = token_ids.dtype
        if dt.is_floating_point or dt.is_complex or dt == torch.bool:
            raise TypeError(f"token_ids must hold integers, got dtype {dt}")
        t = token_ids.detach().to(device="cpu", dtype=torch.int64).contiguous()
        n = t.numel() * 8
        return bytes(address_view(t.data_ptr(), n)) if n else b""
    return tokens_to_int64_bytes(token_ids)


class ChunkPlan:
    """The chunks of one prompt: ``n_tokens``, the chunk ``keys`` in order and their spans.

    Chunk ``i`` covers tokens ``[i * chunk_size, min((i + 1) * chunk_size, n_tokens))``; with
    ``save_unfull_chunk`` false the trailing partial chunk is not part of the plan.
    """

    __slots__ = ("chunk_size", "keys", "n_tokens")

    def __init__(self, db: ChunkedTokenDatabase, token_ids: Any) -> None:
        data = token_bytes(token_ids)
        self.n_tokens = len(data) // 8
        self.chunk_size = db.chunk_size
        make = db.make_key
        self.keys: list[CacheEngineKey] = [
            make(h) for h in chain_hashes(data, db.chunk_size, db.save_unfull_chunk)
        ]

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
