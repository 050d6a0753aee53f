"""vLLM's KV event types and wire format, mirrored field for field (vLLM 0.32,
``vllm/distributed/kv_events.py``), so vLLM's own ``KVEventBatch`` decoder and every router that
reads vLLM's events read ours.

A message on the PUB socket is the multipart ``[topic, seq, payload]``: ``seq`` an unsigned
64-bit big-endian sequence number, ``payload`` a msgpack ``KVEventBatch`` (an array
``[ts, events]``, or ``[ts, events, data_parallel_rank]``; each event a map tagged
``"type": "BlockStored" | "BlockRemoved" | "AllBlocksCleared"``). Replay (vLLM's protocol): a
subscriber sends the first sequence number it wants as 8 bytes big-endian to the ROUTER socket
(``[b"", seq]`` from a DEALER or REQ) and gets ``[b"", topic, seq, payload]`` for every buffered
batch from there, then the end marker ``[b"", b"", END_SEQ, b""]``. Our publishers also answer
:data:`SNAPSHOT_REQUEST` in place of a sequence number (see :mod:`lmcache_async.events.publisher`).

Vocabulary: ``medium`` is vLLM's (``"CPU"`` for memory tiers, ``"STORAGE"`` for every other
tier); the tier itself is in ``ownership`` as ``"lmcache_async:<tier>"``.

Pure data and codecs; any thread. Needs ``msgspec`` (the ``events`` extra).
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "END_SEQ",
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MEDIUM_STORAGE",
    "MEMORY_TIERS",
    "SNAPSHOT_REQUEST",
    "AllBlocksCleared",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "Event",
    "KVCacheEvent",
    "KVEventBatch",
    "decode_batch",
    "encode_batch",
    "int_block_hash",
    "medium_of",
    "ownership_of",
    "seq_bytes",
]

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
#: Tiers whose entries live in memory: advertised with medium ``CPU`` (the others ``STORAGE``).
MEMORY_TIERS = frozenset({"cpu", "server"})
#: The end-of-replay marker's sequence field (vLLM's ``END_SEQ``: -1 as 8 signed bytes).
END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: What a subscriber sends to the replay socket, in place of a sequence number, to ask for a
#: snapshot (8 bytes, like a sequence number: a vLLM publisher reads it as one past its buffer
#: and answers only the end marker).
SNAPSHOT_REQUEST = b"SNAPSHOT"

#: vLLM's ``ExternalBlockHash``: the block hash bytes, or an int (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``).
BlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM's ``EventBatch``: a timestamp and events (an array on the wire)."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the KV cache events (a map tagged with the class name on the wire)."""


class BlockStored(KVCacheEvent):
    """Blocks became loadable: ``block_hashes`` in order, the hash of the block before the first
    (``parent_block_hash``; None at a prompt's start), their ``token_ids``, ``block_size``."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks can no longer be loaded from ``medium`` (the tier in ``ownership``)."""

    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """Everything this stream advertised is gone (never sent on an engine's stream: it carries no
    medium and would wipe the router's view of the engine's own blocks)."""


#: Any of the events a batch carries.
Event = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(EventBatch):
    """vLLM's ``KVEventBatch``."""

    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    """The msgpack payload of ``batch``."""
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """``payload`` decoded and type-checked; ``msgspec.DecodeError``/``ValidationError`` otherwise."""
    return _decoder.decode(payload)


def seq_bytes(seq: int) -> bytes:
    """A sequence number as it travels (8 bytes big-endian, unsigned)."""
    return seq.to_bytes(8, "big")


def medium_of(tier: str) -> str:
    """vLLM's medium for one of our tiers: ``CPU`` for memory tiers, ``STORAGE`` for the others."""
    return MEDIUM_CPU if tier in MEMORY_TIERS else MEDIUM_STORAGE


def ownership_of(tier: str) -> str:
    """The ``ownership`` field naming one of our tiers (``lmcache_async:disk``)."""
    return f"lmcache_async:{tier}"


def int_block_hash(h: BlockHash) -> int:
    """A block hash as the 64-bit int routers index (vLLM's ``maybe_convert_block_hash``: the
    big-endian value of the bytes, low 64 bits)."""
    if isinstance(h, int):
        return h & ((1 << 64) - 1)
    return int.from_bytes(h, "big") & ((1 << 64) - 1)
