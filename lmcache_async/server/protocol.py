"""The node cache server's wire protocol: a compact little-endian binary encoding (``struct``).

No payload byte crosses the socket: payloads live in the namespace's shared-memory pool and
messages carry offsets into it. Nothing here is pickled.

Handshake (on the raw socket, before any stream wrapping)::

    client -> HELLO   magic "LMCS", version u16, mode u8, ns_len u16, tok_len u16, ns, token
    server -> WELCOME magic "LMCS", version u16, status u8, generation u64, pool_bytes u64,
                      data_offset u32, align u32, max_leases u32, max_grants u32, lease_ttl_ms u32
                      (+ the namespace pool's memfd as SCM_RIGHTS when status is OK and mode CLIENT)

Every later message is a frame ``body_len u32, op u8, seq u32`` followed by the body. Requests
that expect an answer get a frame with the same ``op`` and ``seq``; ``RELEASE``, ``UNGRANT``,
``UNHOLD`` and ``TOUCH`` are never answered. Decoders raise :class:`ProtocolError` for anything
malformed; the server closes that connection.

Leases belong to the connection that took them. A **hold** (``HOLD``) belongs to the namespace:
it pins a committed entry's block and metadata under a random token until ``UNHOLD`` (from any
client of the namespace) or its TTL, so a process other than the one that promised the entry
can still read it (``GET_HELD``) after the key was removed or evicted.

``CLEAR`` answers the names of the
server's tiers it could not clear completely (none: every tier of the namespace is clear).

``READ`` answers where entries lie without leasing them: a reader that copies checks the pool's
version table afterwards (:mod:`lmcache_async.server.shm`) and repeats a mismatched key with
``GET``, so a copy-out is one round trip and no release. A client may keep the locations it was
told and copy from them again with no round trip while their versions hold; it reports such
reads later with one unanswered ``TOUCH``, so the server's recency order and hit counts follow.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lmcache_async.dtypes import CODE_TO_DTYPE, DTYPE_TO_CODE
from lmcache_async.memory import MemoryFormat

__all__ = [
    "FRAME",
    "HELLO",
    "LIST_PAGE_BYTES",
    "MAGIC",
    "MAX_BATCH",
    "MAX_BODY",
    "MAX_HOLD_TTL_S",
    "MAX_KEY_BYTES",
    "MAX_LIST_PAGE",
    "MAX_NDIM",
    "NO_OFFSET",
    "REFUSALS",
    "VERSION",
    "WELCOME",
    "EntryMeta",
    "Mode",
    "Op",
    "ProtocolError",
    "Reader",
    "Status",
    "Writer",
    "decode_meta",
    "encode_keys",
    "encode_meta",
]

MAGIC = b"LMCS"
VERSION = 4
"""Version 4 added ``DESCRIBE``."""
#: Largest frame body either side accepts (a batch of keys and metadata, never payload).
MAX_BODY = 4 << 20
#: Most keys (or grants, or leases) in one request.
MAX_BATCH = 4096
#: Longest key string in bytes (UTF-8).
MAX_KEY_BYTES = 8192
MAX_NDIM = 8
MAX_NAMESPACE_BYTES = 256
MAX_TOKEN_BYTES = 256
#: Offset value meaning "no block" in a grant answer.
NO_OFFSET = (1 << 64) - 1

HELLO = struct.Struct("<4sHBHH")
WELCOME = struct.Struct("<4sHBQQIIIII")
FRAME = struct.Struct("<IBI")


class ProtocolError(ValueError):
    """A message that does not follow the protocol (sizes, counts, codes, offsets)."""


class Mode(enum.IntEnum):
    """What a connection is for."""

    CLIENT = 0
    """A cache client of one namespace: receives the namespace pool's memfd."""
    STATUS = 1
    """Only ``STATS`` (no namespace, no pool)."""


class Status(enum.IntEnum):
    """Handshake outcome."""

    OK = 0
    BAD_VERSION = 1
    BAD_TOKEN = 2
    """The peer's uid/gid may join, but its token is not the one wanted."""
    BAD_NAMESPACE = 3
    FULL = 4
    """The server holds its cap of connections (``cache_server_max_connections``)."""
    NO_POOL = 5
    """The namespace's pool could not be created (the server's log says why)."""
    TOO_MANY_NAMESPACES = 6
    """The server holds its cap of namespaces in use (``cache_server_max_namespaces``)."""
    NOT_ALLOWED = 7
    """The peer's uid/gid may not join the namespace (or open a status connection), whatever its
    token (``cache_server_namespaces``; unbound namespaces admit the server's user and root)."""


#: What a refused client is told, by status.
REFUSALS = {
    Status.BAD_VERSION: "the server speaks another protocol version",
    Status.BAD_TOKEN: "wrong or missing token (cache_server_token, or the namespace's own token)",
    Status.BAD_NAMESPACE: "bad namespace name",
    Status.FULL: "the server holds its cap of connections (cache_server_max_connections)",
    Status.NO_POOL: "the server could not create this namespace's pool (its log says why)",
    Status.TOO_MANY_NAMESPACES: "the server holds its cap of namespaces in use (cache_server_max_namespaces)",
    Status.NOT_ALLOWED: "this user may not join the namespace (its uid/gid binding in cache_server_namespaces)",
}


class Op(enum.IntEnum):
    """Operation codes of request and answer frames."""

    CONTAINS = 1
    GET = 2
    RELEASE = 3
    GRANT = 4
    COMMIT = 5
    UNGRANT = 6
    REMOVE = 7
    CLEAR = 8
    STATS = 9
    PING = 10
    HOLD = 11
    UNHOLD = 12
    GET_HELD = 13
    READ = 14
    """Where each entry lies, without a lease: per key a miss (0) or ``2, version u64, offset
    u64, metadata``; the reader copies, then checks the pool's version table against
    ``version`` (:mod:`lmcache_async.server.shm`) and asks again with ``GET`` on a mismatch."""
    TOUCH = 15
    """Keys a reader copied from locations it already knew (never answered): each present one
    becomes the youngest entry and counts as a hit."""
    LIST = 16
    """A page of the namespace's entries in key order (an operator's tool; recency untouched):
    request ``after`` (blob: the last key of the previous page, empty for the first), ``prefix``
    (blob: only keys starting with it), ``limit`` u16; answer a u16 count, per entry its key
    (blob), metadata, block size u64 and pinned flag u8 (leased or held), then ``more`` u8."""
    DESCRIBE = 17
    """What committed entries hold in vLLM's terms, for the server's KV events: request a u16
    count, per entry its key (blob), its provenance as a record's section list (blob, u16 length;
    ``docs/formats.md`` §1.2), the LoRA name (blob, empty: none) and vLLM's extra keys of its
    blocks (blob, msgpack, empty: none); answer a u16 count and per entry u8 1 (recorded) or 0 (no
    such entry, a provenance it cannot advertise, or the server publishes no events)."""


#: Ops the server answers with a frame of the same op and seq.
ANSWERED = frozenset(op for op in Op if op not in (Op.RELEASE, Op.UNGRANT, Op.UNHOLD, Op.TOUCH))
#: Most entries in one LIST page, and the body bytes after which a page ends early.
MAX_LIST_PAGE = 1000
LIST_PAGE_BYTES = 1 << 20
#: Longest TTL a hold may ask for; longer requests are cut to it.
MAX_HOLD_TTL_S = 3600.0
#: Commit outcomes.
COMMIT_FAILED, COMMIT_STORED, COMMIT_PRESENT = 0, 1, 2

_U8 = struct.Struct("<B")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_META_HEAD = struct.Struct("<QBBB")  # nbytes, fmt, dtype code, ndim
_FMT_VALUES = frozenset(int(f) for f in MemoryFormat)


@dataclass(frozen=True, slots=True)
class EntryMeta:
    """What a reader needs to type the bytes of an entry: payload size, format, dtype, shape."""

    nbytes: int
    fmt: MemoryFormat
    dtype: torch.dtype
    shape: tuple[int, ...]

    @staticmethod
    def of(shape: Sequence[int], dtype: torch.dtype, fmt: MemoryFormat) -> EntryMeta:
        """Metadata for an entry of ``shape``/``dtype``; ``ValueError`` for a dtype records cannot carry."""
        try:
            ck = (tuple(shape), dtype, fmt)
            cached = _OF_CACHE.get(ck)
        except TypeError:  # an unhashable shape: no caching
            ck, cached = None, None
        if cached is not None:
            return cached
        meta = EntryMeta._of(shape, dtype, fmt)
        if ck is not None:
            if len(_OF_CACHE) >= _META_CACHE_MAX:
                _OF_CACHE.clear()
            _OF_CACHE[ck] = meta
        return meta

    @staticmethod
    def _of(shape: Sequence[int], dtype: torch.dtype, fmt: MemoryFormat) -> EntryMeta:
        if dtype not in DTYPE_TO_CODE:
            raise ValueError(f"dtype {dtype!r} cannot be stored in the cache server")
        shp = tuple(int(d) for d in shape)
        if len(shp) > MAX_NDIM:
            raise ValueError(f"shape {shp} has more than {MAX_NDIM} dimensions")
        n = dtype.itemsize
        for d in shp:
            n *= d
        return EntryMeta(n, MemoryFormat(fmt), dtype, shp)


#: Decoded metadata by its wire bytes (decoding is a pure function of them); bounded.
_META_CACHE: dict[bytes, EntryMeta] = {}
_META_CACHE_MAX = 1024
#: Encoded metadata by record, and records by (shape, dtype, format): both bounded.
_ENC_CACHE: dict[EntryMeta, bytes] = {}
_OF_CACHE: dict[tuple[tuple[int, ...], torch.dtype, MemoryFormat], EntryMeta] = {}


def encode_meta(m: EntryMeta) -> bytes:
    """The wire bytes of ``m`` (what :meth:`Writer.meta` writes)."""
    b = _ENC_CACHE.get(m)
    if b is None:
        b = _META_HEAD.pack(m.nbytes, int(m.fmt), DTYPE_TO_CODE[m.dtype], len(m.shape)) + b"".join(
            _U64.pack(d) for d in m.shape
        )
        if len(_ENC_CACHE) >= _META_CACHE_MAX:
            _ENC_CACHE.clear()
        _ENC_CACHE[m] = b
    return b


def decode_meta(buf: bytes | bytearray | memoryview, pos: int) -> tuple[EntryMeta, int]:
    """The entry metadata at ``pos`` of ``buf`` and the position after it; :class:`ProtocolError`
    unless it is well formed (known format and dtype, ndim bound, nbytes = prod(shape) * itemsize).

    Decoded records are kept in a small cache keyed by their bytes, so the metadata of entries
    read again and again is checked once.
    """
    end = pos + _META_HEAD.size
    if end > len(buf):
        raise ProtocolError("message truncated")
    nbytes, fmt, code, ndim = _META_HEAD.unpack_from(buf, pos)
    if ndim > MAX_NDIM:
        raise ProtocolError(f"ndim {ndim} exceeds {MAX_NDIM}")
    stop = end + 8 * ndim
    if stop > len(buf):
        raise ProtocolError("message truncated")
    raw = bytes(buf[pos:stop])
    meta = _META_CACHE.get(raw)
    if meta is not None:
        return meta, stop
    if fmt not in _FMT_VALUES:
        raise ProtocolError(f"unknown memory format {fmt}")
    dtype = CODE_TO_DTYPE.get(code)
    if dtype is None:
        raise ProtocolError(f"unknown dtype code {code}")
    shape = struct.unpack_from(f"<{ndim}Q", buf, end)
    n = dtype.itemsize
    for d in shape:
        n *= d
        if n > (1 << 62):
            raise ProtocolError("shape too large")
    if n != nbytes:
        raise ProtocolError(f"nbytes {nbytes} does not match shape {shape} of {dtype}")
    meta = EntryMeta(nbytes, MemoryFormat(fmt), dtype, tuple(shape))
    if len(_META_CACHE) >= _META_CACHE_MAX:
        _META_CACHE.clear()
    _META_CACHE[raw] = meta
    return meta, stop


def encode_keys(keys: Sequence[bytes], head: bytes = b"") -> bytes:
    """``head``, then a u16 count and each key as a blob (what :meth:`Writer.keys` writes)."""
    parts = [head, _U16.pack(len(keys))]
    for k in keys:
        parts.append(_U16.pack(len(k)))
        parts.append(k)
    return b"".join(parts)


class Writer:
    """Builds one frame body; :meth:`frame` prefixes the header."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = bytearray()

    def u8(self, v: int) -> Writer:
        self._buf += _U8.pack(v)
        return self

    def u16(self, v: int) -> Writer:
        self._buf += _U16.pack(v)
        return self

    def u32(self, v: int) -> Writer:
        self._buf += _U32.pack(v)
        return self

    def u64(self, v: int) -> Writer:
        self._buf += _U64.pack(v)
        return self

    def blob(self, b: bytes) -> Writer:
        """A u16 length then the bytes."""
        self._buf += _U16.pack(len(b))
        self._buf += b
        return self

    def keys(self, keys: Sequence[bytes]) -> Writer:
        """A u16 count then each key as a blob."""
        self.u16(len(keys))
        for k in keys:
            self.blob(k)
        return self

    def meta(self, m: EntryMeta) -> Writer:
        self._buf += encode_meta(m)
        return self

    def body(self) -> bytes:
        return bytes(self._buf)

    def frame(self, op: int, seq: int) -> bytes:
        """Header plus body, ready to send."""
        return FRAME.pack(len(self._buf), op, seq) + self._buf


class Reader:
    """Decodes one frame body; every read checks bounds and raises :class:`ProtocolError`."""

    __slots__ = ("_buf", "_pos")

    def __init__(self, buf: bytes | bytearray | memoryview, pos: int = 0) -> None:
        """A reader of ``buf`` from ``pos`` on (``bytes`` are read as they are; a fast path
        hands a whole frame with ``pos`` at its body)."""
        self._buf = buf if type(buf) is bytes else memoryview(buf)
        self._pos = pos

    def _take(self, st: struct.Struct) -> int:
        pos = self._pos
        end = pos + st.size
        if end > len(self._buf):
            raise ProtocolError("message truncated")
        self._pos = end
        v: int = st.unpack_from(self._buf, pos)[0]
        return v

    def u8(self) -> int:
        return self._take(_U8)

    def u16(self) -> int:
        return self._take(_U16)

    def u32(self) -> int:
        return self._take(_U32)

    def u64(self) -> int:
        return self._take(_U64)

    def blob(self, limit: int = MAX_KEY_BYTES) -> bytes:
        n = self.u16()
        if n > limit:
            raise ProtocolError(f"field of {n} bytes exceeds {limit}")
        end = self._pos + n
        if end > len(self._buf):
            raise ProtocolError("message truncated")
        b = bytes(self._buf[self._pos : end])
        self._pos = end
        return b

    def count(self, limit: int = MAX_BATCH) -> int:
        n = self.u16()
        if n > limit:
            raise ProtocolError(f"batch of {n} exceeds {limit}")
        return n

    def keys(self) -> list[bytes]:
        """A u16 count (at most :data:`MAX_BATCH`) then each key as a blob (at most
        :data:`MAX_KEY_BYTES` bytes)."""
        buf = self._buf
        n = self.count()
        pos = self._pos
        size = len(buf)
        out: list[bytes] = []
        for _ in range(n):
            if pos + 2 > size:
                raise ProtocolError("message truncated")
            k = buf[pos] | (buf[pos + 1] << 8)
            if k > MAX_KEY_BYTES:
                raise ProtocolError(f"field of {k} bytes exceeds {MAX_KEY_BYTES}")
            pos += 2
            end = pos + k
            if end > size:
                raise ProtocolError("message truncated")
            out.append(bytes(buf[pos:end]))
            pos = end
        self._pos = pos
        return out

    def meta(self) -> EntryMeta:
        """Entry metadata, checked: known format and dtype, ndim bound, nbytes = prod(shape) * itemsize."""
        meta, self._pos = decode_meta(self._buf, self._pos)
        return meta

    def rest(self) -> bytes:
        """Every byte not read yet (consumed)."""
        b = bytes(self._buf[self._pos :])
        self._pos = len(self._buf)
        return b

    def done(self) -> None:
        """Raise unless the whole body was consumed."""
        if self._pos != len(self._buf):
            raise ProtocolError(f"{len(self._buf) - self._pos} trailing bytes")
