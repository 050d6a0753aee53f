"""Encryption at rest: records sealed with AES-256-GCM under a key from a file.

* **Key file** (``encryption_key_file``): 32 random bytes written as 64 hex digits and a newline
  (:func:`write_key_file`, ``lmcache-async keygen FILE``), a regular file readable by its owner
  only (mode 0600 or stricter; anything else is refused with a ``ValueError`` naming the key).
* **Key id**: the first 16 bytes of BLAKE2b(key, person ``lmcache-async-k1``), stored in every
  sealed header; it names the key without revealing it. A record under another key id is
  foreign (:class:`~lmcache_async.records.ForeignSeal`: a miss, kept).
* **Sealing** (:meth:`RecordCipher.seal`): a random 96-bit nonce per record; the payload is cut
  into segments (one, or the tier's part size for tiers that read parts alone); segment ``i``
  is encrypted under the nonce with its last 32 bits XORed with ``i`` and stored as ciphertext
  then tag. The associated data binds each segment to the record's key string, shape, dtype,
  format, hash scheme, its index and the segment count, so no segment can be moved to another
  entry or place unnoticed. A tag that fails under the matching key is damage
  (:class:`~lmcache_async.records.RecordError`: a miss, removed).

Any thread; the cipher holds no mutable state. Large payloads should be sealed off the event
loop (the AES work releases the GIL).
"""

from __future__ import annotations

import hashlib
import os
import stat
import struct
from pathlib import Path
from typing import Any

import torch

from lmcache_async.dtypes import dtype_code
from lmcache_async.errors import BackendUnavailableError
from lmcache_async.memory import MemoryFormat
from lmcache_async.records import RecordError, RecordHeader
from lmcache_async.records.sections import KEY_ID_LEN, NONCE_LEN, Seal, sealed_length
from lmcache_async.token_database import HASH_SCHEME_ID

__all__ = ["KEY_LEN", "RecordCipher", "cipher_for", "key_id_of", "load_cipher", "new_buffer", "write_key_file"]

KEY_LEN = 32
_PERSON = b"lmcache-async-k1"
_AAD = struct.Struct("<8sHHHHIIQ")
_AAD_MAGIC = b"LMCRseal"

try:  # numpy hands out buffers without zeroing them; without it, a bytearray does
    import numpy as _np
except ImportError:  # pragma: no cover - torch installs usually bring numpy
    _np = None  # type: ignore[assignment]


def key_id_of(key: bytes) -> bytes:
    """The 16-byte id of ``key`` (stored in sealed headers)."""
    return hashlib.blake2b(key, digest_size=KEY_ID_LEN, person=_PERSON).digest()


def _aad(key: str, shape: tuple[int, ...], dtype: torch.dtype, fmt: MemoryFormat, index: int, count: int,
         plain_len: int) -> bytes:  # fmt: skip
    head = _AAD.pack(_AAD_MAGIC, HASH_SCHEME_ID, int(fmt), dtype_code(dtype), len(shape), index, count, plain_len)
    return head + struct.pack(f"<{len(shape)}Q", *shape) + key.encode("utf-8")


def new_buffer(n: int) -> memoryview:
    """A writable buffer of ``n`` bytes the caller owns, not zeroed first where numpy allows
    (it is overwritten at once; zeroing would cost a pass over it)."""
    if _np is not None:
        arr: Any = _np.empty(n, dtype=_np.uint8)  # the view keeps the array alive
        return memoryview(arr).cast("B")
    return memoryview(bytearray(n))


class RecordCipher:
    """Seals and opens record payloads under one AES-256 key (see the module docstring)."""

    def __init__(self, key: bytes) -> None:
        if not isinstance(key, bytes) or len(key) != KEY_LEN:
            raise ValueError(f"key must be {KEY_LEN} bytes")
        try:
            from cryptography.exceptions import InvalidTag
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        except ImportError as exc:
            raise BackendUnavailableError(
                f"encryption_key_file needs the cryptography package ({exc}); install lmcache-async[encryption]"
            ) from None
        self._invalid_tag = InvalidTag
        self._aead = AESGCM(key)
        self.key_id = key_id_of(key)
        """The key's id (16 bytes)."""

    def __repr__(self) -> str:
        return f"RecordCipher(key_id={self.key_id.hex()})"

    def seal(
        self,
        key: str,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        fmt: MemoryFormat,
        plain: memoryview,
        segment_size: int = 0,
        reserve: int = 0,
    ) -> tuple[Seal, memoryview]:
        """Encrypt ``plain`` (the entry's bytes) for a record of ``key``: the seal for its header
        and a new buffer the caller owns holding ``reserve`` bytes (left unset, e.g. for the
        header) and then the stored payload (segments of ciphertext and tag).
        ``segment_size``: plaintext bytes per segment (0: one segment)."""
        if segment_size < 0 or reserve < 0:
            raise ValueError("segment_size and reserve must be >= 0")
        _segments, stored_len = sealed_length(plain.nbytes, segment_size)
        out = new_buffer(reserve + stored_len)
        return self.seal_into(key, shape, dtype, fmt, plain, out[reserve:], segment_size), out

    def seal_into(
        self,
        key: str,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        fmt: MemoryFormat,
        plain: memoryview,
        out: memoryview,
        segment_size: int = 0,
    ) -> Seal:
        """As :meth:`seal`, into a buffer the caller gives (e.g. registered memory a transfer
        reads): ``out`` is a writable byte view of exactly the stored length
        (:func:`~lmcache_async.records.sections.sealed_length`, ``ValueError`` otherwise); the
        seal for the record's header is returned."""
        plain = plain.cast("B") if plain.format != "B" or plain.ndim != 1 else plain
        n = plain.nbytes
        seal = self.new_seal(n, segment_size)
        _segments, stored_len = sealed_length(n, segment_size)
        if out.nbytes != stored_len:
            raise ValueError(f"out holds {out.nbytes} bytes; the sealed payload is {stored_len}")
        body = out.cast("B") if out.format != "B" or out.ndim != 1 else out
        for i in range(seal.segments):
            s, e = seal.plain_bounds(i, n)
            so, eo = seal.stored_bounds(i, n)
            self.seal_segment(seal, key, shape, dtype, fmt, n, i, plain[s:e], body[so:eo])
        return seal

    def new_seal(self, plain_len: int, segment_size: int = 0) -> Seal:
        """The seal of a new record of ``plain_len`` bytes (a fresh random nonce), for sealing
        its segments one at a time with :meth:`seal_segment` (e.g. as each goes out)."""
        if segment_size < 0:
            raise ValueError("segment_size must be >= 0")
        segments, _stored = sealed_length(plain_len, segment_size)
        return Seal(self.key_id, os.urandom(NONCE_LEN), segment_size if segments > 1 else 0, segments)

    def seal_segment(
        self,
        seal: Seal,
        key: str,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        fmt: MemoryFormat,
        plain_len: int,
        index: int,
        plain: memoryview,
        out: memoryview,
    ) -> None:
        """Encrypt segment ``index`` of a record sealed by ``seal`` (``plain``: its plaintext,
        ``seal.plain_bounds(index, plain_len)`` of the entry) into ``out`` (its ciphertext and
        tag: exactly ``len(plain) + 16`` writable bytes). Each segment must be sealed once."""
        if seal.key_id != self.key_id:
            raise ValueError("seal is not of this key")
        aad = _aad(key, shape, dtype, fmt, index, seal.segments, plain_len)
        self._aead.encrypt_into(seal.segment_nonce(index), plain, aad, out)

    def open_segment(self, hdr: RecordHeader, index: int, stored: memoryview, dst: memoryview) -> None:
        """Decrypt segment ``index`` of ``hdr``'s record (``stored``: its ciphertext and tag)
        into ``dst`` (its plaintext bytes). RecordError when the tag fails (damage)."""
        seal = hdr.seal
        if seal is None or seal.key_id != self.key_id:
            raise RecordError("record is not sealed under this key")
        aad = _aad(hdr.key, hdr.shape, hdr.dtype, hdr.fmt, index, seal.segments, hdr.plain_len)
        try:
            self._aead.decrypt_into(seal.segment_nonce(index), stored, aad, dst)
        except self._invalid_tag:
            raise RecordError(f"authentication tag of segment {index} fails") from None

    def open_into(self, hdr: RecordHeader, stored: memoryview, dst: memoryview) -> None:
        """Decrypt the whole stored payload ``stored`` of ``hdr``'s record into ``dst`` (the
        entry's ``hdr.plain_len`` bytes). RecordError when any tag fails (damage)."""
        seal = hdr.seal
        if seal is None:
            raise RecordError("record is not sealed")
        if stored.nbytes != hdr.payload_len or dst.nbytes != hdr.plain_len:
            raise RecordError("sealed payload has the wrong length")
        n = hdr.plain_len
        for i in range(seal.segments):
            s, e = seal.plain_bounds(i, n)
            so, eo = seal.stored_bounds(i, n)
            self.open_segment(hdr, i, stored[so:eo], dst[s:e])


def _check_mode(path: Path, st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"encryption_key_file {str(path)!r} is not a regular file")
    if st.st_mode & 0o077:
        raise ValueError(
            f"encryption_key_file {str(path)!r} has mode {stat.S_IMODE(st.st_mode):04o}; "
            "it must be readable by its owner only (chmod 600)"
        )


def load_cipher(path: str | os.PathLike[str]) -> RecordCipher:
    """The cipher of the key in file ``path`` (64 hex digits, or 32 raw bytes).

    ValueError naming ``encryption_key_file`` when the file is missing, not a regular file,
    readable by group or others, or holds no 256-bit key. Blocking: call before the loop runs
    or from an executor."""
    p = Path(os.fspath(path)).expanduser()
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise ValueError(f"encryption_key_file {str(p)!r} cannot be opened: {exc.strerror}") from None
    try:
        _check_mode(p, os.fstat(fd))
        data = os.read(fd, 4096)
    finally:
        os.close(fd)
    text = data.strip()
    if len(data) == KEY_LEN:
        key = data
    elif len(text) == 2 * KEY_LEN:
        try:
            key = bytes.fromhex(text.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            raise ValueError(f"encryption_key_file {str(p)!r} does not hold 64 hex digits") from None
    else:
        raise ValueError(f"encryption_key_file {str(p)!r} does not hold a 256-bit key (64 hex digits)")
    return RecordCipher(key)


def cipher_for(config: Any) -> RecordCipher | None:
    """The cipher of ``config.encryption_key_file``, None when it is not set (ValueError as
    :func:`load_cipher`)."""
    path = getattr(config, "encryption_key_file", None)
    return None if not path else load_cipher(path)


def write_key_file(path: str | os.PathLike[str]) -> bytes:
    """Write a new random key to ``path`` (created with mode 0600; an existing file is never
    overwritten: ``FileExistsError``). Returns the key's id."""
    key = os.urandom(KEY_LEN)
    fd = os.open(os.fspath(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, key.hex().encode("ascii") + b"\n")
    finally:
        os.close(fd)
    return key_id_of(key)
