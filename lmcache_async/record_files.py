"""Record files (:mod:`lmcache_async.records`) with plain file I/O: publishing and verifying.

Shared by the file-backed tiers (the disk tier, ``fs://``, the NIXL POSIX layouts' index
rebuild): each one names its own files (and temporary files: their formats are part of each
tier's on-disk layout, docs/formats.md) and decides what a bad record costs (a miss, a counter,
a deletion); how a record is written out, published under its final name without replacing
another writer's, and read back and checked lives here once. Blocking: call from executor or
worker threads, never on an event loop.

A reader trusts nothing it has not checked: magic, version, header checksum, key (when the
caller names one), the file's size against the header's, and the payload's checksum.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Sequence

from lmcache_async.records import PROBE_LEN, RecordError, RecordHeader, decode_header, payload_checksum, peek_header_len

__all__ = [
    "payload_problem",
    "publish_noreplace",
    "read_exact_into",
    "read_header",
    "verified_header",
    "write_all",
]

HEADER_PROBE = 512
"""First read of a header: most keys fit; a longer header takes a second read."""
_NO_LINK_ERRNOS = frozenset({errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.EXDEV})
"""``link`` errors of a filesystem without hard links."""


def read_header(fd: int, expect_key: str | None = None, probe: int = HEADER_PROBE) -> RecordHeader:
    """Decode and check the header of the record at the start of file ``fd``.

    ``expect_key``: also check that the record holds this key (None: any key). Raises
    :class:`RecordError` when the bytes are not a well-formed record header (of that key).
    ``probe`` is the size of the first read (between 1 and :data:`PROBE_LEN`).
    """
    if not 0 < probe <= PROBE_LEN:
        raise ValueError(f"probe must be between 1 and {PROBE_LEN}, got {probe!r}")
    head = os.pread(fd, probe, 0)
    hlen = peek_header_len(head)
    if hlen > len(head):
        head = os.pread(fd, hlen, 0)
    return decode_header(head, expect_key=expect_key)


def verified_header(fd: int, size: int, key: str) -> RecordHeader:
    """The header of the record in ``fd`` (a file of ``size`` bytes) when it is a well-formed
    record of ``key`` exactly as long as its header says; :class:`RecordError` otherwise."""
    hdr = read_header(fd, key)
    if size != hdr.total_len:
        raise RecordError("file is truncated" if size < hdr.total_len else "trailing bytes")
    return hdr


def read_exact_into(fd: int, view: memoryview, offset: int) -> int:
    """Fill ``view`` from ``fd`` at ``offset``; the number of bytes read (less than the view's
    size only at end of file)."""
    done = 0
    total = view.nbytes
    while done < total:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            break
        done += n
    return done


def payload_problem(fd: int, hdr: RecordHeader, view: memoryview) -> str | None:
    """Read the payload of ``fd``'s record (header ``hdr``) into ``view`` (``hdr.payload_len``
    bytes, owned by the caller) and check it: what is wrong with it, or None when it is whole and
    its checksum matches."""
    if read_exact_into(fd, view, hdr.header_len) != hdr.payload_len:
        return "file is truncated"
    if payload_checksum(view) != hdr.checksum:
        return "payload checksum mismatch"
    return None


# ---- writing and publishing -----------------------------------------------------------------------
def write_all(fd: int, bufs: Sequence[bytes | memoryview]) -> None:
    """Write every buffer in order (``os.writev``, looping over short writes)."""
    total = sum(memoryview(b).nbytes for b in bufs)
    if not total:
        return
    n = os.writev(fd, bufs)
    if n == total:  # the usual case for a regular file
        return
    views = [memoryview(b).cast("B") for b in bufs if len(b)]
    while views and n:  # skip what the first call wrote
        if n >= len(views[0]):
            n -= len(views.pop(0))
        else:
            views[0] = views[0][n:]
            n = 0
    while views:
        n = os.writev(fd, views)
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_renameat2 = None
_renameat2_ok = True
try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _renameat2 = _libc.renameat2
    _renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    _renameat2.restype = ctypes.c_int
except (OSError, AttributeError):  # pragma: no cover - non-glibc
    _renameat2_ok = False


def publish_noreplace(
    tmp: str | os.PathLike[str],
    final: str | os.PathLike[str],
    *,
    link_first: bool = False,
    rename_without_links: bool = False,
) -> bool:
    """Atomically rename ``tmp`` to ``final`` unless ``final`` exists.

    True when published; False when ``final`` already existed (``tmp`` is left for the caller to
    delete). Uses ``renameat2(RENAME_NOREPLACE)``; where the filesystem lacks it, a hard link
    (also atomic and never replacing) followed by unlinking ``tmp``. Other errors raise OSError.

    ``link_first``: skip the rename and publish with a hard link (network filesystems, where
    ``link`` is atomic on the server and ``renameat2`` flags are not passed on).
    ``rename_without_links``: where the filesystem supports neither (some network and FUSE
    filesystems), rename ``tmp`` over ``final`` when ``final`` does not exist — not atomic
    against a concurrent publisher, which is why it is the caller's choice (``fs://`` accepts it;
    its readers verify every record).
    """
    tmp, final = os.fspath(tmp), os.fspath(final)
    global _renameat2_ok
    if not link_first and _renameat2_ok and _renameat2 is not None:
        rc = _renameat2(_AT_FDCWD, os.fsencode(tmp), _AT_FDCWD, os.fsencode(final), _RENAME_NOREPLACE)
        if rc == 0:
            return True
        err = ctypes.get_errno()
        if err == errno.EEXIST:
            return False
        if err not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
            raise OSError(err, os.strerror(err), final)
        _renameat2_ok = False
    try:
        os.link(tmp, final)
    except FileExistsError:
        return False
    except OSError as exc:
        if not rename_without_links or exc.errno not in _NO_LINK_ERRNOS:
            raise
        if os.path.exists(final):
            return False
        os.replace(tmp, final)
        return True
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    return True
