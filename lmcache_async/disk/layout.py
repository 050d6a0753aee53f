"""Directory layout of the disk tier: file names, temporary names, directories, raw file I/O.

One record (see :mod:`lmcache_async.records`) per entry, in a file named after a hash of the
key string so that no key can ever name a path outside the directory::

    <root>/.lmcache-disk.acct              shared byte budget (see backends.disk_budget)
    <root>/<ss>/<32 hex>.lmc               an entry; <ss> = first byte of the name (256 shards)
    <root>/<ss>/.<32 hex>.lmc.<host>.<pid>.<start>.<rand>.tmp   a record being written

The name is the BLAKE2b-128 digest of the UTF-8 key string; the key string itself lives in the
record header, so a reader recognises an entry without any index and detects a file that holds
another key. Temporary names follow the scheme every record-file store shares
(:func:`lmcache_async.records.files.temp_name`: the final name, the writer's host tag, pid and
process start time, a random part); the older ``.<32 hex>.<host>.<pid>.<start>.<rand>.tmp`` is
still recognised and reaped. Everything here is blocking and runs on executor threads, never on
the event loop.
"""

from __future__ import annotations

import hashlib
import os

from lmcache_async.records import RecordError

# re-exported: the disk tier's record-file naming, reaping and raw I/O live in the shared module
from lmcache_async.records.files import HOST_TAG as HOST_TAG
from lmcache_async.records.files import (
    STALE_TEMP_S,
    TEMP_SUFFIX,
    parse_temp_name,
    read_header,
    temp_name,
    temp_reapable,
)
from lmcache_async.records.files import process_start_time as process_start_time
from lmcache_async.records.files import publish_noreplace as publish_noreplace
from lmcache_async.records.files import read_exact_into as read_exact_into
from lmcache_async.records.files import reap_temp as reap_temp
from lmcache_async.records.files import write_all as write_all
from lmcache_async.records.files import writer_alive as writer_alive

__all__ = [
    "ACCT_NAME",
    "DIGEST_LEN",
    "DIR_MODE",
    "ENTRY_SUFFIX",
    "FILE_MODE",
    "HOST_TAG",
    "NUM_SHARDS",
    "TMP_OLD_S",
    "TMP_SUFFIX",
    "drop_from_page_cache",
    "ensure_dir",
    "entry_key",
    "entry_path",
    "fsync_dir",
    "is_shard_name",
    "key_digest",
    "make_private_dirs",
    "parse_entry_name",
    "parse_tmp_name",
    "process_start_time",
    "publish_noreplace",
    "read_exact_into",
    "reap_temp",
    "shard_name",
    "tmp_name",
    "tmp_reapable",
    "write_all",
    "writer_alive",
]

NUM_SHARDS = 256
ENTRY_SUFFIX = ".lmc"
TMP_SUFFIX = TEMP_SUFFIX
TMP_OLD_S = STALE_TEMP_S
"""A temporary file whose writer cannot be checked (another host) is reaped after this age."""
ACCT_NAME = ".lmcache-disk.acct"
DIGEST_LEN = 16
_NAME_LEN = 2 * DIGEST_LEN + len(ENTRY_SUFFIX)
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


def entry_key(root: str, digest: bytes) -> str | None:
    """The key string the record header of ``digest``'s entry file names (one open and one
    header read; blocking). None, never an error, when there is no such file, its header is not
    a well-formed record header, or it names a key whose digest is not ``digest``."""
    try:
        fd = os.open(entry_path(root, digest), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        key = read_header(fd).key
    except (OSError, RecordError):
        return None
    finally:
        os.close(fd)
    return key if key_digest(key) == digest else None


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


# ---- temporary names (the shared scheme of lmcache_async.records.files) --------------------------
def tmp_name(digest: bytes, hexd: str | None = None) -> str:
    """A fresh temporary file name for the entry of ``digest`` (``hexd``: its hex, when already
    known): ``.<32 hex>.lmc.<host>.<pid>.<start>.<rand>.tmp`` (:func:`temp_name`)."""
    return temp_name(f"{hexd or digest.hex()}{ENTRY_SUFFIX}")


def parse_tmp_name(fname: str) -> tuple[str, int, int] | None:
    """``(host_tag, pid, start)`` of a temporary name; None when the name is not one of ours."""
    writer = parse_temp_name(fname)
    return None if writer is None else (writer.host, writer.pid, writer.start)


def tmp_reapable(fname: str, mtime: float, now: float | None = None) -> bool:
    """True when the temporary file ``fname`` can be deleted (:func:`temp_reapable`): its writer
    is gone, or (for a writer this host cannot check) it is older than :data:`TMP_OLD_S`."""
    return temp_reapable(fname, mtime, now)


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
