"""The record header as the Mooncake tier stores it: padded to a length known from the key.

An object holds one record (:mod:`lmcache_async.records`): the header, zero-padded to
:func:`header_room` bytes, then the payload. The padding makes the payload offset depend on the
key alone, so a reader fetches header and payload as two ranges of one get session without
reading the header first to learn where the payload starts. The header's length field and its
checksum cover the padding, as the record format allows. A sealed record's header carries the
seal section, so its room is larger (:func:`header_room` with ``sealed=True``); a reader reads
:func:`read_room` bytes, the larger of the two, so it can tell a sealed record from a plain one
whichever kind it writes itself.
"""

from __future__ import annotations

import struct

import xxhash

from lmcache_async.memory import MemoryObj
from lmcache_async.records import MAX_RANK, encode_header, header_length
from lmcache_async.records.sections import SEAL_SECTION_LEN, Seal

__all__ = ["header_room", "padded_header", "read_room", "write_header"]

_LEN_AT = 12  # the header-length field (u32) of the fixed part
_SUM_AT = 56  # the header checksum (u64), computed with the field zeroed
_ZERO8 = bytes(8)


def header_room(key: str, *, sealed: bool = False) -> int:
    """Bytes the header of ``key``'s record occupies in its object: the longest header any
    shape can need (rank 32) for this key, with the seal section when ``sealed``, so a reader
    knows it from the key alone."""
    return header_length(len(key.encode("utf-8")), MAX_RANK, SEAL_SECTION_LEN if sealed else 0)


def read_room(key: str) -> int:
    """Bytes a reader fetches for the header of ``key``'s record: enough for a sealed or a
    plain one (an object shorter than that is read whole instead)."""
    return header_room(key, sealed=True)


def write_header(dst: memoryview, obj: MemoryObj, key: str, checksum: int, seal: Seal | None = None) -> int:
    """Write ``obj``'s record header for ``key`` (payload checksum ``checksum``: of the payload
    as stored, the ciphertext and tag when ``seal`` is given), padded to :func:`header_room`
    bytes, into the start of ``dst``; the number of bytes written.

    ``dst`` is a writable byte view of at least that many bytes (``ValueError`` otherwise, and
    for shapes or keys the record format cannot hold); bytes after them are left alone."""
    hb = encode_header(key, tuple(obj.shape), obj.dtype, obj.fmt, checksum, seal=seal)
    room = header_room(key, sealed=seal is not None)
    if len(dst) < room:
        raise ValueError(f"dst holds {len(dst)} bytes; the header of this key needs {room}")
    n = len(hb)
    dst[:n] = hb
    if n < room:
        dst[n:room] = bytes(room - n)
        struct.pack_into("<I", dst, _LEN_AT, room)
        dst[_SUM_AT : _SUM_AT + 8] = _ZERO8
        struct.pack_into("<Q", dst, _SUM_AT, xxhash.xxh3_64_intdigest(dst[:room]))
    return room


def padded_header(obj: MemoryObj, key: str, checksum: int) -> bytes:
    """``obj``'s record header for ``key`` as :func:`write_header` writes it, as bytes."""
    buf = bytearray(header_room(key))
    write_header(memoryview(buf), obj, key, checksum)
    return bytes(buf)
