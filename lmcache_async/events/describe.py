"""Telling the node server what its entries hold in vLLM's terms (``DESCRIBE``, protocol v4).

An engine that stores a chunk in the node server knows which vLLM blocks it holds; the server,
which only sees bytes, learns it from a ``DESCRIBE`` sent after the commit
(:data:`lmcache_async.server.protocol.Op.DESCRIBE`). The provenance travels as a record's section
list (``docs/formats.md`` §1.2, type 2, token ids inline: routers hash them), plus what vLLM
publishes beside the hashes (the LoRA name, the blocks' extra keys).

* :func:`chunk_of` / :func:`provenance_of`: a :class:`~lmcache_async.events.chunks.Chunk` from and
  to a :class:`~lmcache_async.records.sections.Provenance` (hashes of 8 bytes are vLLM's int
  hashes, big-endian; other widths its ``BlockHash`` bytes);
* :func:`encode_describe` / :func:`decode_describe`: the request body;
* :class:`DescribeClient`: one connection of its own to a server's namespace that sends them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import msgspec

from lmcache_async.events.chunks import Chunk
from lmcache_async.records.sections import Provenance, SectionError, decode_sections, encode_sections
from lmcache_async.server.connection import Connection, connect, exchange
from lmcache_async.server.protocol import MAX_BATCH, Mode, Op, ProtocolError, Reader, Writer

__all__ = ["DescribeClient", "chunk_of", "decode_describe", "encode_describe", "provenance_of"]

_BLOB_MAX = 0xFFFF
_INT_WIDTH = 8
_extras_decoder = msgspec.msgpack.Decoder(list[list[Any] | None])


def _hash_bytes(h: Any) -> bytes:
    return h.to_bytes(_INT_WIDTH, "big") if isinstance(h, int) else bytes(h)


def _hash_value(b: bytes) -> Any:
    return int.from_bytes(b, "big") if len(b) == _INT_WIDTH else b


def provenance_of(chunk: Chunk) -> Provenance:
    """The provenance section of ``chunk`` (token ids inline)."""
    parent = None if chunk.parent_hash is None else _hash_bytes(chunk.parent_hash)
    hashes = tuple(_hash_bytes(h) for h in chunk.block_hashes)
    return Provenance(chunk.block_size, hashes, parent, tuple(chunk.token_ids))


def chunk_of(prov: Provenance, lora_name: str | None = None, extra_keys: Sequence[Any] | None = None) -> Chunk:
    """The chunk a provenance describes; ``ValueError`` when it cannot be advertised (no token
    ids, only their digest: routers hash the ids; or token ids that do not fill the blocks)."""
    if prov.token_ids is None:
        raise ValueError("the provenance carries a token digest, not the token ids")
    parent = None if prov.parent_hash is None else _hash_value(prov.parent_hash)
    extras = None if extra_keys is None else tuple(None if e is None else tuple(e) for e in extra_keys)
    if extras is not None and len(extras) != len(prov.block_hashes):
        raise ValueError("extra_keys must have one entry per block")
    return Chunk(
        tuple(_hash_value(h) for h in prov.block_hashes), parent, tuple(prov.token_ids), prov.block_size,
        lora_name, extras,
    )  # fmt: skip


def encode_describe(items: Sequence[tuple[bytes, Chunk]]) -> bytes:
    """The ``DESCRIBE`` request body for ``(key, chunk)`` pairs; ``ValueError`` when a field is
    too long for the wire (a chunk of more than ~16,000 tokens)."""
    if len(items) > MAX_BATCH:
        raise ValueError(f"at most {MAX_BATCH} entries per DESCRIBE")
    w = Writer().u16(len(items))
    for key, chunk in items:
        sections = encode_sections(None, provenance_of(chunk))
        lora = (chunk.lora_name or "").encode()
        extras = b"" if chunk.extra_keys is None else msgspec.msgpack.encode(list(chunk.extra_keys))
        if max(len(sections), len(lora), len(extras)) > _BLOB_MAX:
            raise ValueError("a chunk's description is too long for one DESCRIBE")
        w.blob(key).blob(sections).blob(lora).blob(extras)
    return w.body()


def decode_describe(r: Reader) -> list[tuple[bytes, Chunk | None]]:
    """The entries of a ``DESCRIBE`` body: (key, chunk), the chunk None when it cannot be
    advertised (no token ids, inconsistent extras). :class:`ProtocolError` for malformed bytes."""
    out: list[tuple[bytes, Chunk | None]] = []
    for _ in range(r.count()):
        key = r.blob()
        sections, lora, extras = r.blob(_BLOB_MAX), r.blob(_BLOB_MAX), r.blob(_BLOB_MAX)
        try:
            _seal, prov = decode_sections(memoryview(sections))
            extra_keys = _extras_decoder.decode(extras) if extras else None
            lora_name = lora.decode() if lora else None
        except (SectionError, msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
            raise ProtocolError(f"bad DESCRIBE entry: {exc}") from None
        if prov is None:
            raise ProtocolError("DESCRIBE entry without a provenance section")
        try:
            out.append((key, chunk_of(prov, lora_name, extra_keys)))
        except ValueError:
            out.append((key, None))
    r.done()
    return out


class DescribeClient:
    """A connection of its own to namespace ``namespace`` of the server on ``path``, sending
    ``DESCRIBE``. Blocking calls bounded by ``timeout_s``; not thread-safe; ``close`` when done."""

    def __init__(self, path: str, namespace: str, *, token: str | None = None, timeout_s: float = 5.0) -> None:
        self.timeout_s = timeout_s
        self._conn: Connection = connect(path, namespace, token, Mode.CLIENT, time.monotonic() + timeout_s)

    def describe(self, items: Sequence[tuple[bytes, Chunk]]) -> list[bool]:
        """Describe committed entries; per entry whether the server recorded it."""
        out: list[bool] = []
        for i in range(0, len(items), MAX_BATCH):
            part = items[i : i + MAX_BATCH]
            v = exchange(self._conn, Op.DESCRIBE, encode_describe(part), time.monotonic() + self.timeout_s)
            r = Reader(bytes(v))
            if r.u16() != len(part):
                raise ProtocolError("DESCRIBE answer has the wrong count")
            out.extend(r.u8() == 1 for _ in part)
            r.done()
        return out

    def close(self) -> None:
        self._conn.close()
        self._conn.mapping = None  # the pool's mapping goes with its last reference
