"""Chunking token ids into prefix-chained cache keys.

Chunk hash (normative, stable across processes and releases, scheme id
:data:`HASH_SCHEME_ID`): ``h_0 = 0``; ``h_i`` is the first 8 bytes, big-endian, of SHA-256 over
``h_{i-1}`` as 8 big-endian bytes followed by the chunk's token ids as int64 little-endian.
A chunk with key extras (:class:`~lmcache_async.key_extras.KeyExtras`: images, a LoRA adapter,
``cache_salt``, prompt embeddings) appends its 32-byte extras digest and the 4 bytes ``LMX1``
to that input; a chunk without extras hashes exactly as above.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterator, Sequence
from hashlib import sha256
from typing import Any

import torch

from lmcache_async.dtypes import dtype_name
from lmcache_async.key_extras import HASH_SUFFIX, KeyExtras, extras_or_none
from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import address_view
from lmcache_async.metadata import NEUTRAL_METADATA, LMCacheEngineMetadata

__all__ = [
    "HASH_SCHEME_ID",
    "ChunkedTokenDatabase",
    "chain_hashes",
    "num_masked_prefix",
    "tokens_to_int64_bytes",
]

HASH_SCHEME_ID = 1
"""Id of the chunk-hash scheme above; records carry it so a future scheme never misreads them."""

_INT64_MIN = -(1 << 63)
_INT64_MAX = (1 << 63) - 1
_BIG_ENDIAN_HOST = sys.byteorder == "big"


def tokens_to_int64_bytes(token_ids: Any) -> bytes:
    """Token ids (list/tuple of ints, 1-D integer tensor, or array with ``tolist``) as int64 LE.

    Raises ``TypeError`` for anything else and ``ValueError`` for ids outside int64 or a
    tensor that is not 1-D.
    """
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dim() != 1:
            raise ValueError(f"token_ids must be 1-D, got shape {tuple(token_ids.shape)}")
        if token_ids.dtype.is_floating_point or token_ids.dtype.is_complex or token_ids.dtype == torch.bool:
            raise TypeError(f"token_ids must hold integers, got dtype {token_ids.dtype}")
        t = token_ids.detach().to(device="cpu", dtype=torch.int64).contiguous()
        n = t.numel() * 8
        data = bytes(address_view(t.data_ptr(), n)) if n else b""  # one copy, no per-item work
        if _BIG_ENDIAN_HOST:  # pragma: no cover - little-endian hosts only in CI
            a = array("q", data)
            a.byteswap()
            return a.tobytes()
        return data
    if isinstance(token_ids, (list, tuple)):
        seq: Sequence[Any] = token_ids
    elif hasattr(token_ids, "tolist") and hasattr(token_ids, "ndim"):
        if token_ids.ndim != 1:
            raise ValueError(f"token_ids must be 1-D, got ndim {token_ids.ndim}")
        seq = token_ids.tolist()
    else:
        raise TypeError(
            f"token_ids must be a list/tuple of ints, a 1-D tensor or array, got {type(token_ids).__name__}"
        )
    try:
        a = array("q", seq)
    except TypeError:
        raise TypeError("token_ids must contain only ints") from None
    except OverflowError:
        raise ValueError("token_ids contain a value outside the int64 range") from None
    if _BIG_ENDIAN_HOST:  # pragma: no cover
        a.byteswap()
    return a.tobytes()


def chain_hashes(data: bytes, chunk_size: int, include_partial: bool, extras: KeyExtras | None = None) -> list[int]:
    """Chained chunk hashes of int64-LE token bytes (see module docstring), with ``extras``
    mixed into the chunks they belong to (None or empty: the plain token hashes)."""
    step = chunk_size * 8
    n = len(data)
    end = n if include_partial else n - n % step
    digests = None if extras is None or extras.empty else extras.chunk_digests(n // 8, chunk_size, include_partial)
    out: list[int] = []
    prev = b"\x00" * 8
    mv = memoryview(data)
    for i, off in enumerate(range(0, end, step)):
        h = sha256(prev)
        h.update(mv[off : off + step])
        if digests is not None and (d := digests[i]) is not None:
            h.update(d)
            h.update(HASH_SUFFIX)
        prev = h.digest()[:8]
        out.append(int.from_bytes(prev, "big"))
    return out


class ChunkedTokenDatabase:
    """Turns token ids into ``(start, end, key)`` triples, one per chunk.

    Keys carry the metadata's model name, world size, worker id and KV dtype (a neutral
    identity when ``metadata`` is None). With ``save_unfull_chunk=False`` a trailing partial
    chunk is dropped. Thread-safe (stateless after construction).
    """

    def __init__(
        self,
        chunk_size: int = 256,
        save_unfull_chunk: bool = False,
        metadata: LMCacheEngineMetadata | None = None,
    ) -> None:
        if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0:
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
        self.chunk_size = chunk_size
        self.save_unfull_chunk = bool(save_unfull_chunk)
        self.metadata = metadata if metadata is not None else NEUTRAL_METADATA
        m = self.metadata
        self._key_prefix = (m.model_name, m.world_size, m.worker_id, m.kv_dtype)
        self._dname = dtype_name(m.kv_dtype)

    def make_key(self, chunk_hash: int, request_configs: dict[str, Any] | None = None) -> CacheEngineKey:
        """The key this database gives a chunk whose chained hash is ``chunk_hash``."""
        model, world, worker, dtype = self._key_prefix
        if request_configs is None and type(chunk_hash) is int and 0 <= chunk_hash < 1 << 64:
            return CacheEngineKey._trusted(model, world, worker, chunk_hash, dtype, self._dname)
        return CacheEngineKey(model, world, worker, chunk_hash, dtype, request_configs)

    def make_keys(self, hashes: list[int]) -> list[CacheEngineKey]:
        """Keys of chained hashes as produced by :meth:`chunk_hashes` (no tags)."""
        model, world, worker, dtype = self._key_prefix
        trusted = CacheEngineKey._trusted
        dname = self._dname
        return [trusted(model, world, worker, h, dtype, dname) for h in hashes]

    def chunk_hashes(self, token_ids: Any, extras: KeyExtras | None = None) -> list[int]:
        """The chained hash of every chunk (the partial tail only with ``save_unfull_chunk``),
        with ``extras`` mixed in (``TypeError`` naming ``extras`` for anything but a
        :class:`~lmcache_async.key_extras.KeyExtras` or None)."""
        return chain_hashes(
            tokens_to_int64_bytes(token_ids), self.chunk_size, self.save_unfull_chunk, extras_or_none(extras)
        )

    def keys(
        self, token_ids: Any, request_configs: dict[str, Any] | None = None, extras: KeyExtras | None = None
    ) -> list[CacheEngineKey]:
        """Keys of every chunk, in order."""
        model, world, worker, dtype = self._key_prefix
        return [
            CacheEngineKey(model, world, worker, h, dtype, request_configs)
            for h in self.chunk_hashes(token_ids, extras)
        ]

    def process_tokens(
        self,
        token_ids: Any,
        mask: Any = None,
        request_configs: dict[str, Any] | None = None,
        extras: KeyExtras | None = None,
    ) -> Iterator[tuple[int, int, CacheEngineKey]]:
        """Yield ``(start, end, key)`` per chunk.

        ``mask`` (optional, bool sequence/tensor of the same length) marks with leading False
        the tokens that are already cached: their chunks are not yielded. The number of
        leading False entries must be a multiple of ``chunk_size`` and the rest all True,
        else ``ValueError``. ``extras`` enter the keys as in :meth:`chunk_hashes`.
        """
        data = tokens_to_int64_bytes(token_ids)
        n_tokens = len(data) // 8
        skip = 0 if mask is None else num_masked_prefix(mask, n_tokens, self.chunk_size)
        hashes = chain_hashes(data, self.chunk_size, self.save_unfull_chunk, extras_or_none(extras))
        model, world, worker, dtype = self._key_prefix
        cs = self.chunk_size
        for i, h in enumerate(hashes):
            start = i * cs
            if start < skip:
                continue
            yield start, min(start + cs, n_tokens), CacheEngineKey(model, world, worker, h, dtype, request_configs)


def num_masked_prefix(mask: Any, n_tokens: int, chunk_size: int) -> int:
    """Number of leading False entries of ``mask``; validates LMCache's mask rules."""
    if isinstance(mask, torch.Tensor):
        if mask.dim() != 1:
            raise ValueError(f"mask must be 1-D, got shape {tuple(mask.shape)}")
        m = mask.detach().to("cpu", torch.bool)
        if m.numel() != n_tokens:
            raise ValueError(f"mask has {m.numel()} entries, expected {n_tokens} (one per token)")
        n_true = int(m.sum())
        skip = n_tokens - n_true
        if n_true and not bool(m[skip:].all()):
            raise ValueError("mask must be False for a prefix and True for the rest")
    else:
        vals = [bool(v) for v in mask]
        if len(vals) != n_tokens:
            raise ValueError(f"mask has {len(vals)} entries, expected {n_tokens} (one per token)")
        skip = next((i for i, v in enumerate(vals) if v), n_tokens)
        if not all(vals[skip:]):
            raise ValueError("mask must be False for a prefix and True for the rest")
    if skip % chunk_size:
        raise ValueError(
            f"the masked (already cached) prefix must be a multiple of chunk_size={chunk_size}, got {skip}"
        )
    return skip
