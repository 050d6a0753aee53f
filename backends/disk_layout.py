"""Directory layout of the disk tier: file names, temporary names, writer liveness, raw file I/O.

One record (see :mod:`lmcache_async.records`) per entry, in a file named after a hash of the
key string so that no key can ever name a path outside the directory::

    <root>/.lmcache-disk.acct              shared byte budget (see backends.disk_budget)
    <root>/<ss>/<32 hex>.lmc               an entry; <ss> = first byte of the name (256 shards)
    <root>/<ss>/.<32 hex>.<host>.<pid>.<start>.<rand>.tmp   a record being written

The name is the BLAKE2b-128 digest of the UTF-8 key string; the key string itself lives in the
record header, so a reader recognises an entry without any index and detects a file that holds
another key. Temporary names carry the writer's host tag, pid and process start time (so a
reused pid is not mistaken for the writer) and a random part. Everything here is blocking and
runs on executor threads, never on the event loop.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time

# re-exported: the disk tier's raw record-file I/O lives in the shared module
from lmcache_async.record_files import publish_noreplace as publish_noreplace
from lmcache_async.record_files import read_exact_into as read_exact_into
from lmcache_async.record_files import write_all as write_all

NUM_SHARDS = 256
ENTRY_SUFFIX = ".lmc"
TMP_SUFFIX = ".tmp"
ACCT_NAME = ".lmcache-disk.acct"
DIGEST_LEN = 16
_NAME_LEN = 2 * DIGEST_LEN + len(ENTRY_SUFFIX)
TMP_OLD_S = 3600.0
"""A temporary file whose writer cannot be checked (another host) is reaped after this age."""
FILE_MODE = 0o600
DIR_MODE = 0o700
_HEX = frozenset("0123456789abcdef")


def key_digest(key_str: str) -> bytes:
    """The 16-byte name digest of a key string (BLAKE2b-128 of its UTF-8 bytes)."""
    return hashlib.blake2b(key_str.encode("utf-8"), digest_size=DIGEST_LEN).digest()


def shard_name(shard: int) -> str:
    """Sub-directory name of ``shard`` (two lowercase hex digits)."""
    return f"{shard:02x}"


def entry_path(root: str, digest: bytes) -> str:
    """Path of the entry file for ``digest``."""
    h = digest.hex()
    return f"{root}/{h[:2]}/{h}{ENTRY_SUFFIX}"


def parse_entry_name(fname: str) -> bytes | None:
    """The digest an entry file name stands for, or None when it is not an entry name."""
    if len(fname) != _NAME_LEN or not fname.endswith(ENTRY_SUFFIX):
        return None
    h = fname[: 2 * DIGEST_LEN]
    if not _HEX.issuperset(h):
        return None
    return bytes.fromhex(h)


def is_shard_name(name: str) -> bool:
    """True for the 256 shard directory names."""
    return len(name) == 2 and _HEX.issuperset(name)


# ---- writer identity and temporary names -------------------------------------------------------
def _host_tag() -> str:
    return hashlib.blake2b(socket.gethostname().encode("utf-8", "replace"), digest_size=4).hexdigest()


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


HOST_TAG = _host_tag()
_my_pid = -1
_my_start = 0
_my_prefix = ""


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


def tmp_name(digest: bytes, hexd: str | None = None) -> str:
    """A fresh temporary file name for ``digest`` (``hexd``: its hex, when already known);
    unique per writer and call: the writer's host tag, pid and start time, and 32 random bits."""
    if os.getpid() != _my_pid:
        _identity()
    return f".{hexd or digest.hex()}{_my_prefix}{os.urandom(4).hex()}{TMP_SUFFIX}"


def parse_tmp_name(fname: str) -> tuple[str, int, int] | None:
    """``(host_tag, pid, start)`` of a temporary name; None when the name is not one of ours."""
    if not fname.startswith(".") or not fname.endswith(TMP_SUFFIX):
        return None
    parts = fname[1 : -len(TMP_SUFFIX)].split(".")
    if len(parts) != 5 or len(parts[0]) != 2 * DIGEST_LEN or not _HEX.issuperset(parts[0]):
        return None
    try:
        return parts[1], int(parts[2]), int(parts[3])
    except ValueError:
        return None


def _tmp_like(fname: str) -> bool:
    return (
        fname.startswith(".")
        and fname.endswith(TMP_SUFFIX)
        and len(fname) > 2 * DIGEST_LEN + 1
        and _HEX.issuperset(fname[1 : 1 + 2 * DIGEST_LEN])
    )


def writer_alive(pid: int, start: int) -> bool:
    """True when the process ``pid`` that started at ``start`` may still be running."""
    if pid <= 0:
        return False
    if pid == os.getpid():
        return start == _identity()[1]
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


def tmp_reapable(fname: str, mtime: float, now: float | None = None) -> bool:
    """True when the temporary file ``fname`` can be deleted: its writer is gone, or (for a
    writer this host cannot check) the file is older than :data:`TMP_OLD_S`. Never True while a
    live writer on this host may still rename it."""
    parsed = parse_tmp_name(fname)
    if parsed is None:  # ours by its shape but not its form: reap only when old
        return _tmp_like(fname) and (now if now is not None else time.time()) - mtime > TMP_OLD_S
    host, pid, start = parsed
    if host != HOST_TAG:
        return (now if now is not None else time.time()) - mtime > TMP_OLD_S
    return not writer_alive(pid, start)


def ensure_dir(path: str) -> bool:
    """Create ``path`` (0700) if missing; True when it was created by this call."""
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        return False
    return True


def make_private_dirs(path: str | os.PathLike[str]) -> None:
    """Create ``path`` and every missing parent with mode 0700 (existing ones are left as they are)."""
    missing: list[str] = []
    p = os.path.abspath(os.fspath(path))
    while not os.path.isdir(p):
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    for d in reversed(missing):
        try:
            os.mkdir(d, DIR_MODE)
        except FileExistsError:
            pass


def fsync_dir(path: str) -> None:
    """fsync a directory so a rename or creation in it survives a power loss."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def drop_from_page_cache(path: str) -> None:
    """Ask the kernel to forget the cached pages of ``path`` (best effort; benchmarks)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass
    finally:
        os.close(fd)
