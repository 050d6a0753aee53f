"""Record files (:mod:`lmcache_async.records`) with plain file I/O: naming, publishing, reaping
and verifying.

One record-file store, shared by every file-backed tier (the disk tier, ``fs://``, the NIXL
POSIX layouts): each tier names its final files (docs/formats.md), and everything else lives
here once:

* **Temporary names** (:func:`temp_name`): a record is written to a hidden file in the directory
  of its final name, ``.<final name>.<host>.<pid>.<start>.<rand>.tmp`` — the writer's host tag,
  pid and process start time (so a reused pid is not mistaken for the writer) and 32 random
  bits. Readers only ever open final names, so a half-written temporary file is never read.
* **Publishing** (:func:`publish_noreplace`): the temporary file takes its final name atomically
  and never replaces a record another writer published there.
* **Reaping** (:func:`temp_reapable`, :func:`reap_temp`, :func:`reap_temps`): a leftover is
  deleted once its writer is gone (same host: no such pid, a zombie, or another start time), or,
  for a writer this host cannot check, once it is older than :data:`STALE_TEMP_S`; never while a
  live writer on this host may still publish it. A directory its owner holds exclusively (the
  NIXL tier's locked directory) loses every temporary file. Older temporary-name forms are
  recognised too (see :func:`parse_temp_name`).
* **Verifying** (:func:`read_header`, :func:`verified_header`, :func:`payload_problem`, and
  :func:`payload_problem_views` for a payload read into scattered caller memory).

Blocking: call from executor or worker threads, never on an event loop.

A reader trusts nothing it has not checked: magic, version, header checksum, key (when the
caller names one), the file's size against the header's, and the payload's checksum.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import socket
import time
from collections.abc import Sequence
from typing import NamedTuple

from lmcache_async.records import (
    PROBE_LEN,
    RecordError,
    RecordHeader,
    decode_header,
    payload_checksum,
    payload_checksum_parts,
    peek_header_len,
)

__all__ = [
    "HOST_TAG",
    "STALE_TEMP_S",
    "TEMP_SUFFIX",
    "TempWriter",
    "parse_temp_name",
    "payload_problem",
    "payload_problem_views",
    "process_start_time",
    "publish_noreplace",
    "read_exact_into",
    "read_exact_into_views",
    "read_header",
    "reap_temp",
    "reap_temps",
    "temp_name",
    "temp_reapable",
    "verified_header",
    "write_all",
    "writer_alive",
]

_IOV_MAX = 1024
"""Buffers per ``preadv`` call (Linux's ``IOV_MAX``)."""
HEADER_PROBE = 512
"""First read of a header: most keys fit; a longer header takes a second read."""
_NO_LINK_ERRNOS = frozenset({errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.EXDEV})
"""``link`` errors of a filesystem without hard links."""


def read_header(
    fd: int, expect_key: str | None = None, probe: int = HEADER_PROBE, *, key_id: bytes | bool | None = False
) -> RecordHeader:
    """Decode and check the header of the record at the start of file ``fd``.

    ``expect_key``: also check that the record holds this key (None: any key). Raises
    :class:`RecordError` when the bytes are not a well-formed record header (of that key).
    ``probe`` is the size of the first read (between 1 and :data:`PROBE_LEN`). ``key_id``: as
    :func:`~lmcache_async.records.decode_header` (``ForeignSeal`` for a record this reader's
    key cannot open; False, the default, accepts any).
    """
    if not 0 < probe <= PROBE_LEN:
        raise ValueError(f"probe must be between 1 and {PROBE_LEN}, got {probe!r}")
    head = os.pread(fd, probe, 0)
    hlen = peek_header_len(head)
    if hlen > len(head):
        head = os.pread(fd, hlen, 0)
    return decode_header(head, expect_key=expect_key, key_id=key_id)


def verified_header(fd: int, size: int, key: str, *, key_id: bytes | bool | None = False) -> RecordHeader:
    """The header of the record in ``fd`` (a file of ``size`` bytes) when it is a well-formed
    record of ``key`` exactly as long as its header says; :class:`RecordError` otherwise
    (``ForeignSeal`` for one ``key_id`` cannot open, see :func:`read_header`)."""
    hdr = read_header(fd, key, key_id=key_id)
    if size != hdr.total_len:
        raise RecordError("file is truncated" if size < hdr.total_len else "trailing bytes")
    return hdr


def read_exact_into(fd: int, view: memoryview, offset: int) -> int:
    """Fill ``view`` from ``fd`` at ``offset``; the number of bytes read (less than the view's
    size only at end of file)."""
    return read_exact_into_views(fd, [view], offset)


def read_exact_into_views(fd: int, views: Sequence[memoryview], offset: int) -> int:
    """Fill ``views`` in order from ``fd`` at ``offset`` (``os.preadv``, resuming after short
    reads); the number of bytes read (less than the views hold only at end of file)."""
    todo = [v for v in views if v.nbytes]
    done = 0
    while todo:
        n = os.preadv(fd, todo[:_IOV_MAX], offset + done)
        if n <= 0:
            break
        done += n
        while todo and n >= todo[0].nbytes:
            n -= todo[0].nbytes
            todo.pop(0)
        if n:
            todo[0] = todo[0][n:]
    return done


def payload_problem_views(fd: int, hdr: RecordHeader, views: Sequence[memoryview]) -> str | None:
    """:func:`payload_problem` for a payload read into ``views`` (in order, ``hdr.payload_len``
    bytes in all, owned by the caller)."""
    if read_exact_into_views(fd, views, hdr.header_len) != hdr.payload_len:
        return "file is truncated"
    if payload_checksum_parts(views) != hdr.checksum:
        return "payload checksum mismatch"
    return None


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


# ---- temporary names ------------------------------------------------------------------------------
TEMP_SUFFIX = ".tmp"
STALE_TEMP_S = 3600.0
"""A temporary file whose writer this host cannot check (another host) is reaped after this age."""
_HEX = frozenset("0123456789abcdef")
_DIGEST_HEX = 32
"""Every store names its records after a 128-bit digest: 32 hex digits lead their names."""


def _host_tag() -> str:
    return hashlib.blake2b(socket.gethostname().encode("utf-8", "replace"), digest_size=4).hexdigest()


def _legacy_fs_host() -> str:
    host = "".join(c if c.isalnum() or c in "-_" else "_" for c in socket.gethostname())[:32]
    return host or "host"


HOST_TAG = _host_tag()
"""This host's tag in temporary names (8 hex digits of a hash of the host name)."""
_LEGACY_FS_HOST = _legacy_fs_host()
_my_pid = -1
_my_start = 0
_my_prefix = ""


def process_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (``/proc``), None when unknown or gone.

    Returns -1 for a zombie (the process is dead but not yet reaped by its parent).
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    rest = data[data.rfind(b")") + 2 :].split()
    try:
        if rest[0] in (b"Z", b"X"):
            return -1
        return int(rest[19])
    except (IndexError, ValueError):
        return None


def _identity() -> tuple[int, int]:
    global _my_pid, _my_start, _my_prefix
    pid = os.getpid()
    if pid != _my_pid:  # first use, or a forked child
        start = process_start_time(pid) or 0
        # _my_pid last: another thread that sees it current must also see the prefix
        _my_start = start
        _my_prefix = f".{HOST_TAG}.{pid}.{start}."
        _my_pid = pid
    return pid, _my_start


def temp_name(final_name: str) -> str:
    """A fresh temporary file name for a record to be published as ``final_name`` (a bare name
    in the same directory): ``.<final_name>.<host>.<pid>.<start>.<rand>.tmp``, unique per writer
    and call. Raises ValueError for an empty ``final_name`` or one holding a ``/``."""
    if not final_name or "/" in final_name:
        raise ValueError(f"final_name must be a bare file name, got {final_name!r}")
    if os.getpid() != _my_pid:
        _identity()
    return f".{final_name}{_my_prefix}{os.urandom(4).hex()}{TEMP_SUFFIX}"


class TempWriter(NamedTuple):
    """What a temporary name says about its writer."""

    final_name: str
    """The name the record was to be published under."""
    host: str
    """The writer's host tag (:data:`HOST_TAG` form); "" when the name does not say."""
    pid: int
    start: int
    """The writer's process start time; 0 when the name does not say (then the pid decides)."""


def _is_hex(text: str, length: int) -> bool:
    return len(text) == length and _HEX.issuperset(text)


def _is_num(text: str) -> bool:
    return text.isascii() and text.isdigit()


def parse_temp_name(fname: str) -> TempWriter | None:
    """The writer of the temporary file ``fname``; None when the name is not one of our forms.

    Forms: ``.<final>.<host>.<pid>.<start>.<rand>.tmp`` (every store; the disk tier's older
    ``.<32 hex>.<host>.<pid>.<start>.<rand>.tmp`` is this form with a bare digest as the final
    name) and the older ``fs://`` form ``.<name>.rec.<host name>.<pid>.<rand>.tmp``.
    """
    if not fname.startswith(".") or not fname.endswith(TEMP_SUFFIX):
        return None
    parts = fname[1 : -len(TEMP_SUFFIX)].split(".")
    if len(parts) < 5:
        return None
    if _is_hex(parts[-4], 8) and _is_num(parts[-3]) and _is_num(parts[-2]) and _is_hex(parts[-1], 8):
        return TempWriter(".".join(parts[:-4]), parts[-4], int(parts[-3]), int(parts[-2]))
    if parts[-4] == "rec" and _is_num(parts[-2]) and parts[-1] and _HEX.issuperset(parts[-1]):
        host = HOST_TAG if parts[-3] == _LEGACY_FS_HOST else ""
        return TempWriter(".".join(parts[:-3]), host, int(parts[-2]), 0)
    return None


def _ours_by_shape(fname: str) -> bool:
    """A hidden temporary file named after a record digest, in a form we cannot parse."""
    return (
        fname.startswith(".")
        and fname.endswith(TEMP_SUFFIX)
        and len(fname) > _DIGEST_HEX + 1
        and _HEX.issuperset(fname[1 : 1 + _DIGEST_HEX])
    )


def writer_alive(pid: int, start: int) -> bool:
    """True when the process ``pid`` that started at ``start`` (0: unknown) may still be running
    on this host."""
    if pid <= 0:
        return False
    if pid == os.getpid():
        return not start or start == _identity()[1]
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    now = process_start_time(pid)
    if now == -1:
        return False  # zombie
    # a different start time: the pid was reused by a younger process
    return now is None or not start or now == start


# ---- the reaper -----------------------------------------------------------------------------------
def temp_reapable(fname: str, mtime: float, now: float | None = None, *, exclusive: bool = False) -> bool:
    """True when the temporary file ``fname`` (last modified at ``mtime``, seconds since the
    epoch) may be deleted: its writer on this host is gone, or it is older than
    :data:`STALE_TEMP_S` and its writer cannot be checked from here (another host, or a name that
    is ours by its shape but not its form). Never True while a live writer on this host may still
    publish it. ``exclusive``: the caller holds the directory exclusively (nobody else writes
    there), so every file with the temporary suffix is a leftover. ``now``: the current time
    (None: read the clock)."""
    if exclusive:
        return fname.endswith(TEMP_SUFFIX)
    writer = parse_temp_name(fname)
    if writer is None:
        return _ours_by_shape(fname) and (time.time() if now is None else now) - mtime > STALE_TEMP_S
    if writer.host != HOST_TAG:
        return (time.time() if now is None else now) - mtime > STALE_TEMP_S
    return not writer_alive(writer.pid, writer.start)


def reap_temp(path: str, mtime: float | None = None, now: float | None = None, *, exclusive: bool = False) -> bool:
    """Delete the temporary file at ``path`` when :func:`temp_reapable` allows it; True when this
    call deleted it. ``mtime`` None: read it from the file. A file that is gone, or cannot be
    examined or deleted, is False (never an exception)."""
    name = os.path.basename(path)
    if not name.endswith(TEMP_SUFFIX):
        return False
    try:
        if mtime is None:
            mtime = os.stat(path, follow_symlinks=False).st_mtime
        if not temp_reapable(name, mtime, now, exclusive=exclusive):
            return False
        os.unlink(path)
    except OSError:
        return False
    return True


def reap_temps(
    directory: str | os.PathLike[str], *, recursive: bool = False, exclusive: bool = False, now: float | None = None
) -> int:
    """Delete the reapable temporary files in ``directory`` (and below it when ``recursive``);
    how many were deleted. A missing or unreadable directory reaps nothing."""
    top = os.fspath(directory)
    t = time.time() if now is None else now
    reaped = 0
    if recursive:
        for dirpath, _dirs, files in os.walk(top):
            for fn in files:
                if fn.endswith(TEMP_SUFFIX) and reap_temp(os.path.join(dirpath, fn), None, t, exclusive=exclusive):
                    reaped += 1
        return reaped
    try:
        it = os.scandir(top)
    except OSError:
        return 0
    with it:
        for de in it:
            if not de.name.endswith(TEMP_SUFFIX):
                continue
            try:
                if not de.is_file(follow_symlinks=False):
                    continue
                mtime = de.stat(follow_symlinks=False).st_mtime
            except OSError:
                continue
            if reap_temp(de.path, mtime, t, exclusive=exclusive):
                reaped += 1
    return reaped
