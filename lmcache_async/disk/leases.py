"""Disk leases: a record that outlives its deletion until a reader in another process has read it
(the disk tier's :class:`~lmcache_async.tiers.Leasing` capability).

Across processes a promise ("this entry is cached, do not recompute it") and the load that
follows are separate reads of a shared ``local_disk`` directory, so the record may be evicted,
replaced or deleted in between. A lease closes that window: the promise hard-links the record's
file into ``<local_disk>/.ec-leases/`` (same filesystem, no bytes copied); the reader reads the
lease when the record itself is gone and removes the link once it loaded. Records are immutable
once published (writers publish a new inode, deleters unlink), so a link always names complete
bytes, and the disk tier never looks at the lease directory (only two-hex-digit shard
directories are its own).

A lease that nobody removes (a reader that died) is reaped by :meth:`LeaseDir.reap` after
``max_age_s``. Lease files take disk space beyond the tier's budget while they live.

With ``encryption_key_file`` the disk tier seals its records; a lease reads them with the same
key. A record is verified exactly as the disk tier verifies its own (:mod:`lmcache_async.records.files`):
a sealed record read without a key, under another key, or a plain one read with a key is refused
with :class:`~lmcache_async.records.ForeignSeal`. Everything here is blocking file work.
"""

from __future__ import annotations

import os
import secrets
import time
from typing import TYPE_CHECKING

import torch

from lmcache_async.disk.layout import entry_path, key_digest
from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import tensor_byte_view
from lmcache_async.records import RecordError
from lmcache_async.records.files import payload_problem, verified_header

if TYPE_CHECKING:
    from lmcache_async.encryption import RecordCipher

__all__ = ["DEFAULT_MAX_AGE_S", "LEASE_DIR_NAME", "LEASE_SUFFIX", "LeaseDir", "read_record"]

LEASE_DIR_NAME = ".ec-leases"
LEASE_SUFFIX = ".lease"
DEFAULT_MAX_AGE_S = 600.0


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
        if not max_age_s > 0:
            raise ValueError(f"max_age_s must be > 0, got {max_age_s!r}")
        self.root = os.path.abspath(os.path.expanduser(os.fspath(root)))
        self.path = os.path.join(self.root, LEASE_DIR_NAME)
        self.max_age_s = max_age_s
        self.cipher = cipher

    def take(self, key: CacheEngineKey) -> str | None:
        """Hard-link the record of ``key``; the lease's path, or None when there is no record
        (or the link cannot be made). Never raises ``OSError``."""
        src = entry_path(self.root, key_digest(key.to_string()))
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
    """The tensor stored in the record file ``path`` for ``key``, verified as the disk tier
    verifies its records (header, key, size, payload checksum; a sealed record opened with
    ``cipher``). ``RecordError`` for a damaged or foreign record (``ForeignSeal`` for one sealed
    under another key, sealed while ``cipher`` is None, or plain while it is set), ``OSError``
    when the file cannot be read."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        key_id = cipher.key_id if cipher is not None else None
        hdr = verified_header(fd, os.fstat(fd).st_size, key.to_string(), key_id=key_id)
        if hdr.num_parts != 1:
            raise RecordError("multi-part records are not disk records")
        out = torch.empty(hdr.shape, dtype=hdr.dtype)
        view = tensor_byte_view(out) if out.numel() else memoryview(bytearray())
        if cipher is None:
            problem = payload_problem(fd, hdr, view)
        else:
            from lmcache_async.encryption import new_buffer

            stored = new_buffer(hdr.payload_len)
            problem = payload_problem(fd, hdr, stored)
        if problem is not None:
            raise RecordError(problem)
        if cipher is not None:
            cipher.open_into(hdr, stored, view)
        return out
    finally:
        os.close(fd)
