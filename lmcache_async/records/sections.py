"""Header sections of version-2 records: the encryption seal and the vLLM provenance.

A version-2 header may carry sections after the key string (``docs/formats.md`` §1.2). Each
section starts 8-byte aligned::

    u16 type   u16 flags (bit 0: critical)   u32 body length   body   zero padding to 8

A type of 0 (the header's zero padding) ends the list. A reader skips a section whose type it
does not know unless the critical bit is set; then it rejects the record (it cannot use the
payload without understanding that section). Types (never renumbered, only appended):

* ``1`` **seal** (critical): the payload is AES-256-GCM ciphertext (:class:`Seal`);
* ``2`` **provenance** (not critical): what the entry holds in vLLM's terms (:class:`Provenance`),
  so a tier can say which blocks it evicted without reading the payload.

Pure functions over bytes; any thread.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "ALGO_AES256_GCM",
    "KEY_ID_LEN",
    "NONCE_LEN",
    "SEAL_SECTION_LEN",
    "SECTION_PROVENANCE",
    "SECTION_SEAL",
    "TAG_LEN",
    "Provenance",
    "Seal",
    "SectionError",
    "decode_sections",
    "encode_sections",
    "seal_layout_matches",
    "sealed_length",
    "segment_sizes",
]

SECTION_SEAL = 1
SECTION_PROVENANCE = 2
_CRITICAL = 1
_SECTION = struct.Struct("<HHI")
ALGO_AES256_GCM = 1
KEY_ID_LEN = 16
NONCE_LEN = 12
TAG_LEN = 16
_SEAL = struct.Struct(f"<{KEY_ID_LEN}sHHIQ{NONCE_LEN}s4x")
assert _SEAL.size == 48
SEAL_SECTION_LEN = _SECTION.size + _SEAL.size
"""Bytes the seal section adds to a header's section list."""
_PROV = struct.Struct("<IIHHII")
assert _PROV.size == 20
_PROV_PARENT = 1
_PROV_TOKENS_INLINE = 2
_PROV_EXTRAS = 4
_DIGEST = 32
MAX_SEGMENTS = 1 << 24


class SectionError(ValueError):
    """A header section is malformed (the record is rejected)."""


def _align8(n: int) -> int:
    return -(-n // 8) * 8


@dataclass(frozen=True)
class Seal:
    """How a sealed (encrypted) payload is laid out.

    The plaintext is cut into ``segments`` segments of ``segment_size`` bytes (the last one may
    be shorter; one segment of the whole payload when ``segment_size`` is 0). Segment ``i`` is
    stored as its AES-256-GCM ciphertext followed by its 16-byte tag, under the nonce
    ``nonce`` with the last 4 bytes XORed with ``i`` (little-endian), so a segment read alone
    (a ranged GET, one Redis part) is checked alone. ``key_id`` names the key (16 bytes,
    derived from it; :mod:`lmcache_async.encryption`); ``nonce`` is random per record.
    """

    key_id: bytes
    nonce: bytes
    segment_size: int
    segments: int
    algorithm: int = ALGO_AES256_GCM

    def __post_init__(self) -> None:
        if len(self.key_id) != KEY_ID_LEN:
            raise ValueError(f"key_id must be {KEY_ID_LEN} bytes")
        if len(self.nonce) != NONCE_LEN:
            raise ValueError(f"nonce must be {NONCE_LEN} bytes")
        if not 1 <= self.segments <= MAX_SEGMENTS or self.segment_size < 0:
            raise ValueError("bad segment layout")

    def segment_nonce(self, index: int) -> bytes:
        """The nonce of segment ``index``."""
        tail = int.from_bytes(self.nonce[8:], "little") ^ index
        return self.nonce[:8] + tail.to_bytes(4, "little")

    def plain_bounds(self, index: int, plain_len: int) -> tuple[int, int]:
        """``(start, end)`` of segment ``index`` in the plaintext."""
        if self.segments == 1:
            return 0, plain_len
        start = index * self.segment_size
        return start, min(plain_len, start + self.segment_size)

    def stored_bounds(self, index: int, plain_len: int) -> tuple[int, int]:
        """``(start, end)`` of segment ``index`` (ciphertext and tag) in the stored payload."""
        start, end = self.plain_bounds(index, plain_len)
        return start + index * TAG_LEN, end + (index + 1) * TAG_LEN


def sealed_length(plain_len: int, segment_size: int) -> tuple[int, int]:
    """``(segments, stored length)`` of a payload of ``plain_len`` bytes sealed in segments of
    ``segment_size`` bytes (0: one segment)."""
    segments = 1 if segment_size <= 0 or plain_len <= segment_size else -(-plain_len // segment_size)
    return segments, plain_len + segments * TAG_LEN


@dataclass(frozen=True)
class Provenance:
    """What a KV entry holds in vLLM's terms (written by engines that know it; optional).

    ``block_hashes``: the hashes of the vLLM blocks the chunk covers, in order, each
    ``hash_width`` bytes (vLLM's ``BlockHash`` bytes, or an int hash as 8 bytes big-endian);
    ``parent_hash``: the hash of the block before the first one (None for the first block of a
    prompt); ``block_size``: tokens per vLLM block. ``token_ids`` (the chunk's token ids, u32)
    or ``token_digest`` (SHA-256 of them as u32 little-endian) — a sealed record never carries
    the ids, only the digest. ``extras_digest``: SHA-256 of the chunk's extras encoding
    (formats §5), None without extras.
    """

    block_size: int
    block_hashes: tuple[bytes, ...]
    parent_hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None
    token_digest: bytes | None = None
    token_count: int = 0
    extras_digest: bytes | None = None

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {self.block_size!r}")
        widths = {len(h) for h in self.block_hashes}
        if self.parent_hash is not None:
            widths.add(len(self.parent_hash))
        if len(widths) > 1 or not widths <= set(range(1, 65)):
            raise ValueError("block_hashes and parent_hash must be 1-64 bytes, all of one width")
        if (self.token_ids is None) == (self.token_digest is None):
            raise ValueError("give exactly one of token_ids and token_digest")
        if self.token_digest is not None and len(self.token_digest) != _DIGEST:
            raise ValueError("token_digest must be 32 bytes")
        if self.extras_digest is not None and len(self.extras_digest) != _DIGEST:
            raise ValueError("extras_digest must be 32 bytes")
        if self.token_ids is not None and any(not 0 <= t < 1 << 32 for t in self.token_ids):
            raise ValueError("token_ids must be u32 values")

    @property
    def hash_width(self) -> int:
        if self.block_hashes:
            return len(self.block_hashes[0])
        return len(self.parent_hash) if self.parent_hash is not None else 0

    @property
    def tokens(self) -> int:
        """Tokens the chunk holds."""
        return len(self.token_ids) if self.token_ids is not None else self.token_count


def _encode_provenance(p: Provenance) -> bytes:
    flags = (_PROV_PARENT if p.parent_hash is not None else 0) | (_PROV_EXTRAS if p.extras_digest else 0)
    if p.token_ids is not None:
        flags |= _PROV_TOKENS_INLINE
    out = bytearray(_PROV.pack(p.block_size, len(p.block_hashes), p.hash_width, flags, p.tokens, 0))
    if p.parent_hash is not None:
        out += p.parent_hash
    for h in p.block_hashes:
        out += h
    if p.token_ids is not None:
        out += struct.pack(f"<{len(p.token_ids)}I", *p.token_ids)
    else:
        assert p.token_digest is not None
        out += p.token_digest
    if p.extras_digest is not None:
        out += p.extras_digest
    return bytes(out)


def _decode_provenance(body: memoryview) -> Provenance:
    if len(body) < _PROV.size:
        raise SectionError("provenance section is short")
    bsize, nblocks, width, flags, ntok, _r = _PROV.unpack_from(body, 0)
    if flags & ~(_PROV_PARENT | _PROV_TOKENS_INLINE | _PROV_EXTRAS):
        raise SectionError(f"unknown provenance flags {flags:#x}")
    need = _PROV.size + width * (nblocks + (1 if flags & _PROV_PARENT else 0))
    need += 4 * ntok if flags & _PROV_TOKENS_INLINE else _DIGEST
    need += _DIGEST if flags & _PROV_EXTRAS else 0
    if len(body) != need:
        raise SectionError("provenance section has a bad length")
    off = _PROV.size
    parent = None
    if flags & _PROV_PARENT:
        parent, off = bytes(body[off : off + width]), off + width
    hashes = tuple(bytes(body[off + i * width : off + (i + 1) * width]) for i in range(nblocks))
    off += width * nblocks
    ids: tuple[int, ...] | None = None
    digest = None
    if flags & _PROV_TOKENS_INLINE:
        ids, off = struct.unpack_from(f"<{ntok}I", body, off), off + 4 * ntok
    else:
        digest, off = bytes(body[off : off + _DIGEST]), off + _DIGEST
    extras = bytes(body[off : off + _DIGEST]) if flags & _PROV_EXTRAS else None
    try:
        return Provenance(bsize, hashes, parent, ids, digest, 0 if ids is not None else ntok, extras)
    except ValueError as exc:
        raise SectionError(f"provenance section: {exc}") from None


def encode_sections(seal: Seal | None, provenance: Provenance | None) -> bytes:
    """The section list of a header (empty when neither is given), 8-byte aligned."""
    out = bytearray()
    items: list[tuple[int, int, bytes]] = []
    if seal is not None:
        body = _SEAL.pack(seal.key_id, seal.algorithm, 0, seal.segments, seal.segment_size, seal.nonce)
        items.append((SECTION_SEAL, _CRITICAL, body))
    if provenance is not None:
        if seal is not None and provenance.token_ids is not None:
            raise ValueError("a sealed record carries the token digest, never the token ids")
        items.append((SECTION_PROVENANCE, 0, _encode_provenance(provenance)))
    for kind, flags, body in items:
        out += _SECTION.pack(kind, flags, len(body)) + body
        out += b"\x00" * (_align8(len(out)) - len(out))
    return bytes(out)


def decode_sections(buf: memoryview) -> tuple[Seal | None, Provenance | None]:
    """Parse a section list (``buf``: from the first section to the header's end)."""
    seal: Seal | None = None
    prov: Provenance | None = None
    off = 0
    seen: set[int] = set()
    while off + _SECTION.size <= len(buf):
        kind, flags, blen = _SECTION.unpack_from(buf, off)
        if kind == 0:
            if any(buf[off:]):
                raise SectionError("bytes after the last section")
            break
        body = buf[off + _SECTION.size : off + _SECTION.size + blen]
        if len(body) != blen:
            raise SectionError("section runs past the header")
        if kind in seen:
            raise SectionError(f"section {kind} appears twice")
        seen.add(kind)
        if flags & ~_CRITICAL:
            raise SectionError(f"unknown section flags {flags:#x}")
        if kind == SECTION_SEAL:
            if blen != _SEAL.size:
                raise SectionError("seal section has a bad length")
            key_id, algo, _r, segs, ssize, nonce = _SEAL.unpack_from(body, 0)
            if algo != ALGO_AES256_GCM:
                raise SectionError(f"unknown cipher {algo}")
            try:
                seal = Seal(key_id, nonce, ssize, segs, algo)
            except ValueError as exc:
                raise SectionError(f"seal section: {exc}") from None
        elif kind == SECTION_PROVENANCE:
            prov = _decode_provenance(body)
        elif flags & _CRITICAL:
            raise SectionError(f"unknown critical section {kind}")
        off = _align8(off + _SECTION.size + blen)
    else:
        if off < len(buf) and any(buf[off:]):
            raise SectionError("bytes after the last section")
    return seal, prov


def seal_layout_matches(seal: Seal, plain_len: int, stored_len: int) -> bool:
    """True when ``seal``'s segments cover ``plain_len`` bytes stored as ``stored_len``."""
    if seal.segments == 1:
        return seal.segment_size == 0 and stored_len == plain_len + TAG_LEN
    if seal.segment_size <= 0 or -(-plain_len // seal.segment_size) != seal.segments:
        return False
    return stored_len == plain_len + seal.segments * TAG_LEN


def segment_sizes(seal: Seal, plain_len: int) -> Sequence[int]:
    """Plaintext bytes of each segment."""
    return [e - s for s, e in (seal.plain_bounds(i, plain_len) for i in range(seal.segments))]
