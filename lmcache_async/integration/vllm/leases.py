"""Disk leases: an encoder-cache record that outlives its deletion until a worker has read it.

Across processes the scheduler's promise ("this item is cached, do not encode it") and the
worker's load are separate reads of a shared ``local_disk`` directory, so the record may be
evicted, replaced or deleted in between. A lease closes that window: when the scheduler
promises an item it hard-links the record's file into ``<local_disk>/.ec-leases/`` (same
filesystem, no bytes copied); the worker reads the lease when the record itself is gone and
removes the link once it loaded. Records are immutable once published (writers publish a new
inode, deleters unlink), so a link always names complete bytes, and the disk tier never looks
at the lease directory (only two-hex-digit shard directories are its own).

A lease that nobody removes (a worker that died, a request aborted before its load) is reaped
by :meth:`LeaseDir.reap` after ``max_age_s``. Lease files take disk space beyond the tier's
budget while they live, one record each.

With ``encryption_key_file`` the disk tier seals its records; a lease reads them with the same
key (:class:`LeaseDir`'s ``cipher``). A sealed record read without a key, one sealed under
another key, or a plain one read with a key is refused with
:class:`~lmcache_async.records.ForeignSeal` (a ``RecordError``), as the disk tier itself would.

Everything here is blocking file work; the connector calls it only where vLLM allows a short
synchronous step (the promise, the load).

:class:`PromiseLeases` is what the connector needs of a lease kind; :class:`LeaseDir` is the
disk one, :class:`~lmcache_async.integration.vllm.ec_server_leases.ServerHolds` the one for
the node cache server.
"""

from __future__ import annotations

import os
import secrets
import time
from typing import TYPE_CHECKING, Protocol

import torch

from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import tensor_byte_view
from lmcache_async.records import (
    RecordError,
    decode_header,
    payload_checksum,
    peek_header_len,
)

if TYPE_CHECKING:
    from lmcache_async.encryption import RecordCipher

LEASE_DIR_NAME = ".ec-leases"
LEASE_SUFFIX = ".lease"
DEFAULT_MAX_AGE_S = 600.0
_PROBE = 4096


class PromiseLeases(Protocol):
    """A way to keep a promised entry readable by workers in other processes until they load it.

    ``take`` returns a lease string for the step's metadata (None: the entry cannot be leased,
    so it must not be promised); ``read`` raises ``OSError`` (or ``RecordError``) when the
    leased bytes cannot be read; ``drop`` and ``reap`` never raise for storage trouble.
    """

    def take(self, key: CacheEngineKey) -> str | None: ...

    def drop(self, lease: str) -> bool: ...

    def owns(self, lease: str) -> bool: ...

    def read(self, lease: str, key: CacheEngineKey) -> torch.Tensor: ...

    def reap(self) -> int: ...


def _entry_path(root: str, key: CacheEngineKey) -> str:
    from lmcache_async.backends.disk_layout import entry_path, key_digest

    return entry_path(root, key_digest(key.to_string()))


class LeaseDir:
    """Leases under ``<root>/.ec-leases`` for the disk tier rooted at ``root``; ``cipher``: the
    disk tier's key (``encryption_key_file``), None when its records are plain."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        max_age_s: float = DEFAULT_MAX_AGE_S,
        cipher: RecordCipher | None = None,
    ) -> None:
        self.root = os.path.abspath(os.path.expanduser(os.fspath(root)))
        self.path = os.path.join(self.root, LEASE_DIR_NAME)
        self.max_age_s = max_age_s
        self.cipher = cipher

    def take(self, key: CacheEngineKey) -> str | None:
        """Hard-link the record of ``key``; the lease's path, or None when there is no record
        (or the link cannot be made). Never raises ``OSError``."""
        src = _entry_path(self.root, key)
        name = f"{os.getpid()}-{secrets.token_hex(8)}{LEASE_SUFFIX}"
        dst = os.path.join(self.path, name)
        try:
            os.link(src, dst)
        except FileNotFoundError:
            try:
                os.makedirs(self.path, mode=0o700, exist_ok=True)
                os.link(src, dst)
            except OSError:
                return None
        except OSError:
            return None
        return dst

    @staticmethod
    def drop(path: str) -> bool:
        """Remove a lease; True when it was there. Never raises ``OSError``."""
        try:
            os.unlink(path)
            return True
        except OSError:
            return False

    def owns(self, path: str) -> bool:
        """True when ``path`` names a lease file of this directory (never a path elsewhere)."""
        return (
            os.path.dirname(os.path.abspath(path)) == self.path
            and path.endswith(LEASE_SUFFIX)
            and os.sep not in os.path.basename(path)[:-1]
        )

    def read(self, lease: str, key: CacheEngineKey) -> torch.Tensor:
        """The entry of ``key`` read from the lease file (see :func:`read_record`)."""
        return read_record(lease, key, self.cipher)

    def reap(self, now: float | None = None) -> int:
        """Remove leases older than ``max_age_s``; how many were removed."""
        now = time.time() if now is None else now
        removed = 0
        try:
            names = os.listdir(self.path)
        except OSError:
            return 0
        for name in names:
            if not name.endswith(LEASE_SUFFIX):
                continue
            p = os.path.join(self.path, name)
            try:
                if now - os.stat(p).st_mtime > self.max_age_s:
                    os.unlink(p)
                    removed += 1
            except OSError:
                continue
        return removed


def read_record(path: str, key: CacheEngineKey, cipher: RecordCipher | None = None) -> torch.Tensor:
    """The tensor stored in the record file ``path`` for ``key``.

    Checks what every reader checks: magic, version, header checksum, key equality, file size
    and payload checksum; a sealed record is opened with ``cipher`` (read into a scratch buffer
    first, then decrypted into the tensor). ``RecordError`` for a damaged or foreign record
    (:class:`~lmcache_async.records.ForeignSeal` when it is sealed under another key, sealed
    while ``cipher`` is None, or plain while it is set; a tag that fails under ``cipher``: a
    plain ``RecordError``), ``OSError`` when the file cannot be read.
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, _PROBE, 0)
        hlen = peek_header_len(head)
        if hlen > len(head):
            head = os.pread(fd, hlen, 0)
        hdr = decode_header(head, expect_key=key.to_string(), key_id=cipher.key_id if cipher is not None else None)
        if hdr.num_parts != 1:
            raise RecordError("multi-part records are not disk records")
        if size != hdr.total_len:
            raise RecordError("file is truncated" if size < hdr.total_len else "trailing bytes")
        out = torch.empty(hdr.shape, dtype=hdr.dtype)
        from lmcache_async.backends.disk_layout import read_exact_into
        from lmcache_async.encryption import new_buffer

        view = tensor_byte_view(out) if out.numel() else memoryview(bytearray())
        stored = view if cipher is None else new_buffer(hdr.payload_len)
        got = read_exact_into(fd, stored, hdr.header_len) if len(stored) else 0
        if got != hdr.payload_len:
            raise RecordError("file is truncated")
        if payload_checksum(stored) != hdr.checksum:
            raise RecordError("payload checksum mismatch")
        if cipher is not None:
            cipher.open_into(hdr, stored, view)
        return out
    finally:
        os.close(fd)
