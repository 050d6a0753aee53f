"""Records as the remote tier stores them: one record per entry, payload inline or in parts.

A single-part record is ``header || payload`` (:mod:`lmcache_async.records`); sealed, the
payload is the ciphertext and tag of each segment, a segment per part. A multi-part
record is ``header || manifest`` where the header has the parts flag, the part count and size,
and the manifest is the 16-character token that names this write's parts (so two writers of
one key never mix their parts, and a reader checks the payload checksum over all of them).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING

import xxhash

from lmcache_async.memory import MemoryObj
from lmcache_async.records import RecordError, RecordHeader, decode_header, encode_header
from lmcache_async.records.sections import TAG_LEN
from lmcache_async.tiers import Allocate

if TYPE_CHECKING:
    from lmcache_async.encryption import RecordCipher

from .naming import EntryName

__all__ = [
    "MANIFEST_LEN",
    "AllocationFailed",
    "ForeignRecord",
    "Outgoing",
    "copy_single",
    "parse_head",
    "prepare",
]

MANIFEST_LEN = 16
_HEX = frozenset(b"0123456789abcdef")


class ForeignRecord(RecordError):
    """The record is valid but holds another key (a digest collision): a miss, kept in place."""


class AllocationFailed(RuntimeError):
    """The read buffer could not be allocated."""


@dataclass(frozen=True)
class Outgoing:
    """What a put sends: the record head, and the payload whole or in parts."""

    head: bytes
    """Header (single part) or header plus manifest (parts)."""
    payload: memoryview
    parts: tuple[memoryview, ...]
    """Empty for a single-part record."""
    token: str | None


def prepare(name: EntryName, obj: MemoryObj, part_size: int, cipher: RecordCipher | None = None) -> Outgoing:
    """Header and payload views of ``obj`` (zero copy), split when above ``part_size``.

    With ``cipher``, the payload is sealed into a new buffer first, in segments of
    ``part_size`` bytes with their tags, so that every stored part is one segment, checked and
    opened alone."""
    if cipher is not None:
        shape = tuple(obj.shape)
        seal, stored = cipher.seal(name.key, shape, obj.dtype, obj.fmt, obj.byte_view(), max(1, part_size - TAG_LEN))
        checksum = xxhash.xxh3_64_intdigest(stored)
        n = stored.nbytes
        if seal.segments == 1:
            return Outgoing(encode_header(name.key, shape, obj.dtype, obj.fmt, checksum, seal=seal), stored, (), None)
        token = secrets.token_hex(MANIFEST_LEN // 2)
        head = encode_header(
            name.key, shape, obj.dtype, obj.fmt, checksum, num_parts=seal.segments, part_size=part_size, seal=seal
        ) + token.encode("ascii")
        parts = tuple(stored[i * part_size : (i + 1) * part_size] for i in range(seal.segments))
        return Outgoing(head, stored, parts, token)
    payload = obj.byte_view()
    checksum = xxhash.xxh3_64_intdigest(payload)
    n = len(payload)
    if n <= part_size:
        head = encode_header(name.key, obj.shape, obj.dtype, obj.fmt, checksum)
        return Outgoing(head, payload, (), None)
    count = -(-n // part_size)
    token = secrets.token_hex(MANIFEST_LEN // 2)
    head = encode_header(
        name.key, obj.shape, obj.dtype, obj.fmt, checksum, num_parts=count, part_size=part_size
    ) + token.encode("ascii")
    parts = tuple(payload[i * part_size : (i + 1) * part_size] for i in range(count))
    return Outgoing(head, payload, parts, token)


def parse_head(
    value: bytes | memoryview, name: EntryName, key_id: bytes | None = None
) -> tuple[RecordHeader, str | None]:
    """Decode and check a stored record head; ``(header, token or None)``.

    Raises :class:`ForeignRecord` for a valid record of another key,
    :class:`~lmcache_async.records.ForeignSeal` for one the reader's key (id ``key_id``, None
    for none) cannot open, and :class:`~lmcache_async.records.RecordError` for anything
    malformed, including a length that does not match the header.
    """
    hdr = decode_header(value, key_id=key_id)
    if hdr.key != name.key:
        raise ForeignRecord("record holds another key")
    if hdr.num_parts == 1:
        if len(value) != hdr.header_len + hdr.payload_len:
            raise RecordError("record length does not match its header")
        return hdr, None
    if len(value) != hdr.header_len + MANIFEST_LEN:
        raise RecordError("multi-part record head has a bad length")
    token = bytes(value[hdr.header_len :])
    if not set(token) <= _HEX:
        raise RecordError("multi-part record has a malformed manifest")
    return hdr, token.decode("ascii")


def allocate(hdr: RecordHeader, alloc: Allocate) -> MemoryObj:
    """A buffer for ``hdr``'s payload (``AllocationFailed`` when none is available)."""
    obj = alloc(hdr.shape, hdr.dtype, hdr.fmt)
    if obj is None:
        raise AllocationFailed("no buffer for a remote read")
    if obj.nbytes != hdr.plain_len:  # pragma: no cover - an allocator that ignores the shape
        obj.ref_count_down()
        raise AllocationFailed("read buffer has the wrong size")
    return obj


def copy_single(value: bytes, hdr: RecordHeader, alloc: Allocate, cipher: RecordCipher | None = None) -> MemoryObj:
    """Verify a single-part record's payload and copy it into a buffer from ``alloc`` (opened
    with ``cipher`` when sealed; RecordError when a tag fails)."""
    payload = memoryview(value)[hdr.header_len :]
    if xxhash.xxh3_64_intdigest(payload) != hdr.checksum:
        raise RecordError("payload checksum mismatch")
    obj = allocate(hdr, alloc)
    try:
        if hdr.seal is not None:
            if cipher is None:
                raise RecordError("record is sealed")
            cipher.open_into(hdr, payload, obj.byte_view())
        else:
            obj.byte_view()[:] = payload
    except BaseException:
        obj.ref_count_down()
        raise
    return obj
