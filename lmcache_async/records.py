"""The self-describing record format shared by the disk, fs://, remote and NIXL tiers.

Layout (little-endian; see ``docs/formats.md``)::

    offset size  field
    0      8     magic  b"\\x89LMCR\\r\\n\\x1a"
    8      2     format version (1)
    10     2     flags (bit 0: payload stored in parts)
    12     4     header length in bytes (multiple of 64; the payload starts here)
    16     8     payload length in bytes
    24     8     xxh3-64 of the payload
    32     2     chunk-hash scheme id
    34     2     memory format
    36     2     dtype code
    38     2     rank (number of dimensions)
    40     4     key length in bytes (UTF-8)
    44     4     number of parts (1 when not split)
    48     8     part size in bytes (0 when not split)
    56     8     xxh3-64 of the header with this field zeroed
    64     8*r   shape, one u64 per dimension
    ...    k     key string (UTF-8)
    ...          zero padding up to the header length

A reader trusts nothing it has not checked: magic, version, header checksum, key equality,
sizes against the shape, and finally the payload checksum.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xxhash

from lmcache_async.dtypes import CODE_TO_DTYPE, dtype_code
from lmcache_async.memory import MemoryFormat
from lmcache_async.token_database import HASH_SCHEME_ID

MAGIC = b"\x89LMCR\r\n\x1a"
VERSION = 1
FLAG_PARTS = 1
HEADER_ALIGN = 64
FIXED = struct.Struct("<8sHHIQQHHHHIIQQ")
assert FIXED.size == 64
MAX_RANK = 32
MAX_KEY_LEN = 64 * 1024
MAX_HEADER_LEN = 1 << 20
MAX_PAYLOAD_LEN = 1 << 44  # 16 TiB: a sanity bound against corrupt length fields
PROBE_LEN = 4096
"""Bytes a reader fetches first; headers of keys shorter than ~3.5 KiB fit in it."""

_xxh3 = xxhash.xxh3_64_intdigest


class RecordError(ValueError):
    """A record failed a check (it is treated as a corrupt entry: a miss, removed, counted)."""


def payload_checksum(data: bytes | bytearray | memoryview) -> int:
    """xxh3-64 of ``data``."""
    return _xxh3(data)


def payload_checksum_parts(parts: Sequence[memoryview]) -> int:
    """xxh3-64 of the concatenation of ``parts`` (the same value as :func:`payload_checksum` of
    the joined bytes, without joining them)."""
    if len(parts) == 1:
        return _xxh3(parts[0])
    h = xxhash.xxh3_64()
    for part in parts:
        h.update(part)
    return int(h.intdigest())


@dataclass(frozen=True)
class RecordHeader:
    """Decoded header of one record."""

    key: str
    fmt: MemoryFormat
    dtype: torch.dtype
    shape: tuple[int, ...]
    payload_len: int
    checksum: int
    header_len: int
    num_parts: int = 1
    part_size: int = 0
    hash_scheme: int = HASH_SCHEME_ID

    @property
    def total_len(self) -> int:
        """Header plus payload bytes (the file size of a single-part record)."""
        return self.header_len + self.payload_len


def header_length(key_len: int, rank: int) -> int:
    """Header length for a key of ``key_len`` bytes and a shape of ``rank`` dimensions."""
    raw = FIXED.size + 8 * rank + key_len
    return -(-raw // HEADER_ALIGN) * HEADER_ALIGN


def encode_header(
    key: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    fmt: MemoryFormat,
    checksum: int,
    *,
    num_parts: int = 1,
    part_size: int = 0,
) -> bytes:
    """The header bytes of a record (``ValueError`` for shapes/keys the format cannot hold)."""
    kb = key.encode("utf-8")
    if len(kb) > MAX_KEY_LEN:
        raise ValueError(f"key of {len(kb)} bytes is longer than {MAX_KEY_LEN}")
    if len(shape) > MAX_RANK:
        raise ValueError(f"rank {len(shape)} is above {MAX_RANK}")
    n = dtype.itemsize
    for d in shape:
        if d < 0:
            raise ValueError(f"shape must not hold negative sizes, got {shape!r}")
        n *= d
    hlen = header_length(len(kb), len(shape))
    flags = FLAG_PARTS if num_parts > 1 else 0
    buf = bytearray(hlen)
    FIXED.pack_into(
        buf,
        0,
        MAGIC,
        VERSION,
        flags,
        hlen,
        n,
        checksum,
        HASH_SCHEME_ID,
        int(fmt),
        dtype_code(dtype),
        len(shape),
        len(kb),
        num_parts,
        part_size,
        0,
    )
    off = FIXED.size
    if shape:
        struct.pack_into(f"<{len(shape)}Q", buf, off, *shape)
        off += 8 * len(shape)
    buf[off : off + len(kb)] = kb
    struct.pack_into("<Q", buf, 56, _xxh3(buf))
    return bytes(buf)


def peek_header_len(prefix: bytes | bytearray | memoryview) -> int:
    """Header length announced by the first 64 bytes; ``RecordError`` if they are not a record."""
    if len(prefix) < FIXED.size:
        raise RecordError("record shorter than its fixed header")
    magic, version, _f, hlen = struct.unpack_from("<8sHHI", prefix, 0)
    if magic != MAGIC:
        raise RecordError("bad magic")
    if version != VERSION:
        raise RecordError(f"unsupported record version {version}")
    if hlen < FIXED.size or hlen % HEADER_ALIGN or hlen > MAX_HEADER_LEN:
        raise RecordError(f"bad header length {hlen}")
    return int(hlen)


def decode_header(buf: bytes | bytearray | memoryview, expect_key: str | None = None) -> RecordHeader:
    """Decode and verify a header (``buf`` holds at least the whole header).

    Raises :class:`RecordError` for anything inconsistent, including a key that differs from
    ``expect_key`` (a hash collision or a foreign file).
    """
    hlen = peek_header_len(buf)
    if len(buf) < hlen:
        raise RecordError("record shorter than its header")
    (
        _magic,
        _v,
        flags,
        _h,
        plen,
        csum,
        scheme,
        fmt,
        dcode,
        rank,
        klen,
        nparts,
        psize,
        hsum,
    ) = FIXED.unpack_from(buf, 0)
    hb = bytearray(buf[:hlen])
    hb[56:64] = b"\x00" * 8
    if _xxh3(bytes(hb)) != hsum:
        raise RecordError("header checksum mismatch")
    if rank > MAX_RANK or klen > MAX_KEY_LEN or FIXED.size + 8 * rank + klen > hlen:
        raise RecordError("bad rank or key length")
    if scheme != HASH_SCHEME_ID:
        raise RecordError(f"unknown chunk-hash scheme {scheme}")
    try:
        mfmt = MemoryFormat(fmt)
    except ValueError:
        raise RecordError(f"unknown memory format {fmt}") from None
    dtype = CODE_TO_DTYPE.get(dcode)
    if dtype is None:
        raise RecordError(f"unknown dtype code {dcode}")
    shape = struct.unpack_from(f"<{rank}Q", buf, FIXED.size) if rank else ()
    n = dtype.itemsize
    for d in shape:
        n *= d
    if n != plen or plen > MAX_PAYLOAD_LEN:
        raise RecordError("payload length does not match shape and dtype")
    if flags & ~FLAG_PARTS:
        raise RecordError(f"unknown flags {flags:#x}")
    if flags & FLAG_PARTS:
        if nparts < 2 or psize <= 0 or -(-plen // psize) != nparts:
            raise RecordError("bad part layout")
    elif nparts != 1:
        raise RecordError("bad part count")
    koff = FIXED.size + 8 * rank
    try:
        key = bytes(buf[koff : koff + klen]).decode("utf-8")
    except UnicodeDecodeError:
        raise RecordError("key is not UTF-8") from None
    if expect_key is not None and key != expect_key:
        raise RecordError("record holds another key")
    return RecordHeader(
        key=key,
        fmt=mfmt,
        dtype=dtype,
        shape=tuple(shape),
        payload_len=plen,
        checksum=csum,
        header_len=hlen,
        num_parts=nparts,
        part_size=psize,
        hash_scheme=scheme,
    )


def verify_payload(header: RecordHeader, payload: bytes | bytearray | memoryview) -> None:
    """Raise :class:`RecordError` unless ``payload`` has the header's length and checksum."""
    if len(payload) != header.payload_len:
        raise RecordError("payload is truncated")
    if _xxh3(payload) != header.checksum:
        raise RecordError("payload checksum mismatch")
