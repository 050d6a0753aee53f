"""The self-describing record format shared by the disk, fs://, remote and NIXL tiers.

Layout (little-endian; see ``docs/formats.md``)::

    offset size  field
    0      8     magic  b"\\x89LMCR\\r\\n\\x1a"
    8      2     format version (2 written; 1 read forever)
    10     2     flags (bit 0: payload stored in parts; bit 1: payload sealed)
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
    ...          version 2: sections, 8-byte aligned (:mod:`lmcache_async.records.sections`)
    ...          zero padding up to the header length

A version-2 header without sections is a version-1 header with another version number. A sealed
payload (flag bit 1, seal section) is stored as AES-256-GCM segments, each followed by its tag;
the payload length and checksum are those of the stored bytes, so integrity is checked before
anything is decrypted (:mod:`lmcache_async.encryption`).

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
from lmcache_async.records.sections import (
    Provenance,
    Seal,
    SectionError,
    decode_sections,
    encode_sections,
    seal_layout_matches,
)
from lmcache_async.token_database import HASH_SCHEME_ID

__all__ = [
    "FIXED",
    "FLAG_PARTS",
    "FLAG_SEALED",
    "HEADER_ALIGN",
    "MAGIC",
    "MAX_HEADER_LEN",
    "MAX_KEY_LEN",
    "MAX_PAYLOAD_LEN",
    "MAX_RANK",
    "PROBE_LEN",
    "READ_VERSIONS",
    "VERSION",
    "ForeignSeal",
    "RecordError",
    "RecordHeader",
    "decode_header",
    "encode_header",
    "header_length",
    "payload_checksum",
    "payload_checksum_parts",
    "peek_header_len",
    "verify_payload",
]

MAGIC = b"\x89LMCR\r\n\x1a"
VERSION = 2
READ_VERSIONS = frozenset({1, 2})
FLAG_PARTS = 1
FLAG_SEALED = 2
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


class ForeignSeal(RecordError):
    """A well-formed record this reader cannot open: sealed under another key, sealed while the
    reader has no key, or plain while the reader requires sealed records. A miss that is
    **kept** (another deployment's entry, or one written before a key rotation)."""


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
    version: int = VERSION
    seal: Seal | None = None
    """How the payload is sealed, None for a plain payload."""
    provenance: Provenance | None = None

    @property
    def total_len(self) -> int:
        """Header plus payload bytes (the file size of a single-part record)."""
        return self.header_len + self.payload_len

    @property
    def plain_len(self) -> int:
        """Bytes of the entry itself (shape x dtype): ``payload_len`` less the seal's tags."""
        if self.seal is None:
            return self.payload_len
        return self.payload_len - 16 * self.seal.segments


def header_length(key_len: int, rank: int, sections_len: int = 0) -> int:
    """Header length for a key of ``key_len`` bytes, a shape of ``rank`` dimensions and
    ``sections_len`` bytes of sections (0 for a plain record without provenance)."""
    raw = FIXED.size + 8 * rank + key_len
    if sections_len:
        raw = -(-raw // 8) * 8 + sections_len
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
    seal: Seal | None = None,
    provenance: Provenance | None = None,
) -> bytes:
    """The header bytes of a version-2 record (``ValueError`` for shapes/keys the format cannot
    hold). ``checksum`` is the xxh3-64 of the payload as stored (the ciphertext and tags when
    ``seal`` is given); ``seal`` None: a plain payload; ``provenance`` None: none recorded."""
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
    sections = encode_sections(seal, provenance)
    if seal is not None:
        n += 16 * seal.segments
    hlen = header_length(len(kb), len(shape), len(sections))
    if hlen > MAX_HEADER_LEN:
        raise ValueError(f"a header of {hlen} bytes is longer than {MAX_HEADER_LEN}")
    flags = (FLAG_PARTS if num_parts > 1 else 0) | (FLAG_SEALED if seal is not None else 0)
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
    if sections:
        off = -(-(off + len(kb)) // 8) * 8
        buf[off : off + len(sections)] = sections
    struct.pack_into("<Q", buf, 56, _xxh3(buf))
    return bytes(buf)


def peek_header_len(prefix: bytes | bytearray | memoryview) -> int:
    """Header length announced by the first 64 bytes; ``RecordError`` if they are not a record."""
    if len(prefix) < FIXED.size:
        raise RecordError("record shorter than its fixed header")
    magic, version, _f, hlen = struct.unpack_from("<8sHHI", prefix, 0)
    if magic != MAGIC:
        raise RecordError("bad magic")
    if version not in READ_VERSIONS:
        raise RecordError(f"unsupported record version {version}")
    if hlen < FIXED.size or hlen % HEADER_ALIGN or hlen > MAX_HEADER_LEN:
        raise RecordError(f"bad header length {hlen}")
    return int(hlen)


def decode_header(
    buf: bytes | bytearray | memoryview, expect_key: str | None = None, *, key_id: bytes | bool | None = False
) -> RecordHeader:
    """Decode and verify a header (``buf`` holds at least the whole header).

    Raises :class:`RecordError` for anything inconsistent, including a key that differs from
    ``expect_key`` (a hash collision or a foreign file). ``key_id``: the id of the reader's
    encryption key, None for a reader without one, False (default) to accept any record (tools
    that only inspect); a record whose seal does not match it raises :class:`ForeignSeal`.
    """
    hlen = peek_header_len(buf)
    if len(buf) < hlen:
        raise RecordError("record shorter than its header")
    (
        _magic,
        version,
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
    mfmt, dtype = _entry_type(scheme, fmt, dcode)
    shape = struct.unpack_from(f"<{rank}Q", buf, FIXED.size) if rank else ()
    n = dtype.itemsize
    for d in shape:
        n *= d
    koff = FIXED.size + 8 * rank
    seal = prov = None
    if version >= 2:
        try:
            seal, prov = decode_sections(memoryview(buf)[-(-(koff + klen) // 8) * 8 : hlen])
        except SectionError as exc:
            raise RecordError(str(exc)) from None
    _check_payload_layout(version, flags, seal, n, plen, nparts, psize)
    key = _checked_key(buf, koff, klen, expect_key)
    if key_id is not False and (seal.key_id if seal is not None else None) != key_id:
        raise ForeignSeal("record is sealed under another key" if seal is not None else "record is not sealed")
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
        version=version,
        seal=seal,
        provenance=prov,
    )


def _entry_type(scheme: int, fmt: int, dcode: int) -> tuple[MemoryFormat, torch.dtype]:
    """The memory format and dtype a header names; ``RecordError`` for an unknown chunk-hash
    scheme, format or dtype code."""
    if scheme != HASH_SCHEME_ID:
        raise RecordError(f"unknown chunk-hash scheme {scheme}")
    try:
        mfmt = MemoryFormat(fmt)
    except ValueError:
        raise RecordError(f"unknown memory format {fmt}") from None
    dtype = CODE_TO_DTYPE.get(dcode)
    if dtype is None:
        raise RecordError(f"unknown dtype code {dcode}")
    return mfmt, dtype


def _check_payload_layout(
    version: int, flags: int, seal: Seal | None, n: int, plen: int, nparts: int, psize: int
) -> None:
    """``RecordError`` unless the flags, the seal, the payload length (``n`` bytes of entry) and
    the part layout of a header agree."""
    if (seal is not None) != bool(flags & FLAG_SEALED):
        raise RecordError("seal flag and seal section disagree")
    if seal is not None:
        if not seal_layout_matches(seal, n, plen):
            raise RecordError("sealed payload length does not match shape, dtype and segments")
    elif n != plen:
        raise RecordError("payload length does not match shape and dtype")
    if plen > MAX_PAYLOAD_LEN:
        raise RecordError("payload is too long")
    known_flags = FLAG_PARTS | (FLAG_SEALED if version >= 2 else 0)
    if flags & ~known_flags:
        raise RecordError(f"unknown flags {flags:#x}")
    if flags & FLAG_PARTS:
        if nparts < 2 or psize <= 0 or -(-plen // psize) != nparts:
            raise RecordError("bad part layout")
    elif nparts != 1:
        raise RecordError("bad part count")


def _checked_key(buf: bytes | bytearray | memoryview, koff: int, klen: int, expect_key: str | None) -> str:
    """The header's key (``klen`` bytes at ``koff``); ``RecordError`` when it is not UTF-8 or
    differs from ``expect_key``."""
    try:
        key = bytes(buf[koff : koff + klen]).decode("utf-8")
    except UnicodeDecodeError:
        raise RecordError("key is not UTF-8") from None
    if expect_key is not None and key != expect_key:
        raise RecordError("record holds another key")
    return key


def verify_payload(header: RecordHeader, payload: bytes | bytearray | memoryview) -> None:
    """Raise :class:`RecordError` unless ``payload`` has the header's length and checksum."""
    if len(payload) != header.payload_len:
        raise RecordError("payload is truncated")
    if _xxh3(payload) != header.checksum:
        raise RecordError("payload checksum mismatch")
