"""Where the ``nixl`` tier's records live: the storage layouts.

Everything here runs on the tier's worker threads, never on the event loop. How one record's
bytes move through NIXL (scratch area, piecewise checksummed transfer) is
:mod:`.nixl_transfer`; its names are re-exported here.

Layouts:

* :class:`KeyFileLayout` — one file per entry (``<hash>.<tag>-<n>.lmcr``): a new file is written
  under a temporary name (:mod:`lmcache_async.records.files`, the scheme every record-file store
  shares) and published without replacing another; the file of an evicted entry is overwritten
  in place under its name (a torn record fails its checksum on read); recently used record
  files stay open and registered (:class:`~lmcache_async.nixl.open_files.OpenFiles`). The tier locks its directory, so a
  restart deletes every temporary file there;
* :class:`SlotFileLayout` — ``nixl_pool_size`` pre-created slot files, opened and registered
  once; an entry occupies one slot;
* :class:`ObjectLayout` — two objects per entry (``<name>.hdr`` and ``<name>``) in an
  S3-compatible store; OBJ writes whole objects only, so the payload is written in one piece.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import itertools
import logging
import os
import secrets
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from lmcache_async.errors import BackendUnavailableError
from lmcache_async.nixl.agent import NixlAgent, NixlSettings, NixlStuckError, NixlTransferError, park
from lmcache_async.nixl.open_files import OPEN_FILES, OpenFile, OpenFiles
from lmcache_async.nixl.transfer import (
    EntryMeta,
    Loc,
    Scratch,
    ScratchSlot,
    read_record,
    write_record,
)
from lmcache_async.records import PROBE_LEN, RecordError, RecordHeader
from lmcache_async.records.files import TEMP_SUFFIX, publish_noreplace, read_header, reap_temp, temp_name
from lmcache_async.tiers import BackendContext

logger = logging.getLogger(__name__)

RECORD_SUFFIX = ".lmcr"
TMP_SUFFIX = TEMP_SUFFIX
SLOT_PREFIX = "slot-"
EMPTY_MAGIC = bytes(8)
"""What an unused or invalidated slot holds where a record's magic would be."""


def invalidate(fd: int) -> None:
    """Zero the magic of the record in file ``fd``: a restart finds it unreadable and drops it."""
    os.pwrite(fd, EMPTY_MAGIC, 0)


def probe_file(fd: int) -> RecordHeader:
    """Decode the header of the record file ``fd`` with plain reads (index rebuild)."""
    return read_header(fd, probe=PROBE_LEN)


@dataclass
class Scanned:
    """One record found by a layout scan."""

    location: str | int
    meta: EntryMeta
    mtime: float
    key_id: bytes | None = None
    """The id of the key the record is sealed under, None for a plain record."""


class DirectoryInUseError(BackendUnavailableError):
    """The storage directory is locked by another tier instance (this or another process)."""


def lock_directory(root: Path) -> int:
    """Take the exclusive ``flock`` of the storage directory ``root`` and write our pid into it;
    returns the lock file's descriptor (closing it releases the lock). Raises
    :class:`DirectoryInUseError` naming the holder's pid when another tier instance holds it."""
    fd = os.open(root / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "?"
        finally:
            os.close(fd)
        raise DirectoryInUseError(
            f"NIXL storage directory {str(root)!r} is in use (lock held by pid {holder}); "
            "give each process its own nixl_path"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
    return fd


def storage_root(ctx: BackendContext, settings: NixlSettings) -> str:
    """Where a manager's tier keeps its records: ``<nixl_path>/<cache>-<worker_id>`` (a
    directory, or an object-name prefix for OBJ), so the KV, hidden-state and encoder caches
    and the workers of one host never share one."""
    leaf = f"{ctx.cache_name}-{ctx.metadata.worker_id}"
    if settings.is_object_store:
        return f"{settings.path.rstrip('/')}/{leaf}"
    return str(Path(settings.path) / leaf)


# ---- layouts -----------------------------------------------------------------------------------
class KeyFileLayout:
    """One file per entry in ``root``; see the module docstring."""

    persistent = True
    piecewise = True

    def __init__(self, agent: NixlAgent, root: Path, open_files: int = OPEN_FILES) -> None:
        self.agent = agent
        self.root = root
        self.open_files = OpenFiles(agent, open_files)
        self._dir = str(root) + os.sep
        # Stems end in <random per instance>-<counter>: unique within this instance, and
        # across restarts unless 32 random bits repeat for the same key.
        self._stem_tag = secrets.token_hex(4)
        self._stem_counter = itertools.count()

    def new_location(self, key: str) -> str:
        """A fresh file stem for ``key``, named after the key it is created for. Called on the
        event loop only.

        A stem changes hands only when the tier plans a write into an evicted entry's file
        (:meth:`open_write`); the tier deletes a file only once its location left the index
        and never evicts what is not in the index, so a late delete cannot hit a rewrite."""
        digest = hashlib.blake2b(key.encode("utf-8"), digest_size=16).hexdigest()
        return f"{digest}.{self._stem_tag}-{next(self._stem_counter):x}"

    def _path(self, stem: str, suffix: str = RECORD_SUFFIX) -> str:
        return self._dir + stem + suffix

    @contextlib.contextmanager
    def open_write(self, location: str | int, meta: EntryMeta, recycle: Sequence[str | int] = ()) -> Iterator[Loc]:
        """A registered file for the record named ``location``.

        ``recycle`` lists record files of entries evicted to make room. When ``location`` is
        one of them (the tier plans it so), that file is overwritten in place: its pages are
        already in the page cache, which makes the write several times faster than into a
        fresh file, and it keeps its name (names only ever change hands this way). Otherwise
        a fresh temporary file is written and renamed to ``location`` when complete. The other
        evicted files are deleted. A write that fails deletes what it wrote into, so no evicted
        file is left under its name after a failure. An in-place write first zeroes the evicted
        record's magic, so a crash in the middle leaves either an unreadable file (dropped at
        the restart) or the new key's header over a torn payload, whose checksum fails on the
        first read, which removes it — never the evicted key's header.

        After a stuck request (:class:`NixlStuckError`) the descriptor and its registration
        are parked, never closed: the request may still write through them, and a closed
        descriptor's number would soon name another file.
        """
        name = str(location)
        path = self._path(name)
        reused = False
        for old in recycle:
            if str(old) != name:
                self.delete(old)
            else:
                reused = True
        f = self._open_existing(name) if reused else None
        target = path
        if f is None:
            reused = False
            target = self._dir + temp_name(name + RECORD_SUFFIX)
            try:
                f = self._open_registered(target, os.O_RDWR | os.O_CREAT | os.O_EXCL)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(target)
                raise
        ok = False
        stuck = False
        try:
            if reused:
                # The evicted record's magic goes first: a kill during the write must not leave
                # its key's header there (a restart would prefer this newer, torn file over a
                # good copy of that key written meanwhile). Zero magic: dropped at the restart.
                invalidate(f.fd)
            yield Loc(f.dev, 0, f.dev, meta.header_len)
            if reused:
                if os.fstat(f.fd).st_size > meta.total_len:
                    os.ftruncate(f.fd, meta.total_len)
            elif not publish_noreplace(target, path):
                # Stems are fresh per write: a file at this one is another record, never ours
                # to replace. The write fails; the temporary file goes below.
                raise FileExistsError(errno.EEXIST, "a record file already has this name", path)
            ok = True
        except NixlStuckError:
            stuck = True
            raise
        finally:
            self.open_files.settle(name, f, name if reused else None, ok, stuck)
            if not ok:
                with contextlib.suppress(OSError):
                    os.unlink(target)

    def _open_existing(self, name: str) -> OpenFile | None:
        """Record file ``name`` open and registered for writing (kept, or opened now); None
        when it is gone (or cannot be registered: the caller writes a fresh file then)."""
        f = self.open_files.take(name)
        if f is not None:
            if f.writable and os.fstat(f.fd).st_nlink > 0:
                return f
            # kept by a read (open it again for writing), or deleted meanwhile (then it is gone)
            self.open_files.release(f, taken_as=name)
        try:
            return self._open_registered(self._path(name), os.O_RDWR)
        except Exception:
            return None

    def _open_registered(
        self, path: str, flags: int, check: Callable[[os.stat_result], None] | None = None
    ) -> OpenFile:
        """``path`` opened with ``flags`` (writable unless ``O_RDONLY``), checked by ``check``
        when given, and registered as a NIXL target; the descriptor is closed on any failure."""
        fd = os.open(path, flags | os.O_CLOEXEC, 0o600)
        try:
            if check is not None:
                check(os.fstat(fd))
            dev, handle = self.agent.register_target(fd=fd)
        except BaseException:
            os.close(fd)
            raise
        return OpenFile(fd, handle, dev, writable=(flags & os.O_ACCMODE) != os.O_RDONLY)

    @contextlib.contextmanager
    def open_read(self, location: str | int, meta: EntryMeta) -> Iterator[Loc]:
        """The record's registered file, kept open afterwards when the read succeeded (a
        damaged, resized or deleted file is checked on every read and never kept)."""
        name = str(location)
        f = self.open_files.take(name)
        taken_as = name if f is not None else None
        try:
            if f is None:
                f = self._open_registered(self._path(name), os.O_RDONLY, lambda st: self._check_size(st, meta))
            else:
                st = os.fstat(f.fd)
                if st.st_nlink == 0:
                    raise FileNotFoundError(f"record file {name} was deleted")
                self._check_size(st, meta)
        except BaseException:
            if f is not None:
                self.open_files.release(f, taken_as=taken_as)
            raise
        ok = False
        stuck = False
        try:
            yield Loc(f.dev, 0, f.dev, meta.header_len)
            ok = True
        except NixlStuckError:
            stuck = True
            raise
        finally:
            self.open_files.settle(name, f, taken_as, ok, stuck)

    @staticmethod
    def _check_size(st: os.stat_result, meta: EntryMeta) -> None:
        if st.st_size != meta.total_len:
            raise RecordError(f"record file has {st.st_size} bytes, expected {meta.total_len}")

    def delete(self, location: str | int) -> None:
        self.open_files.drop(str(location))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path(str(location)))

    def scan(self) -> tuple[list[Scanned], int]:
        """Records in ``root`` (newest last) and how many leftovers/corrupt files were removed."""
        found: list[Scanned] = []
        removed = 0
        for entry in os.scandir(self.root):
            name = entry.name
            if not entry.is_file(follow_symlinks=False):
                continue
            if name.endswith(TMP_SUFFIX):
                # The directory lock is ours: any temporary file's writer is gone.
                removed += reap_temp(entry.path, None, exclusive=True)
                continue
            if name.startswith(SLOT_PREFIX):
                removed += _unlink(entry.path)
                continue
            if not name.endswith(RECORD_SUFFIX):
                continue
            try:
                fd = os.open(entry.path, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    st = os.fstat(fd)
                    header = probe_file(fd)
                finally:
                    os.close(fd)
                if st.st_size != header.total_len:
                    raise RecordError("size differs from the header")
            except (OSError, RecordError) as exc:
                logger.info("nixl: removing unreadable record %s (%s)", name, exc)
                removed += _unlink(entry.path)
                continue
            stem = name[: -len(RECORD_SUFFIX)]
            found.append(Scanned(stem, EntryMeta.from_header(header), st.st_mtime, _key_id(header)))
        found.sort(key=lambda s: s.mtime)
        return found, removed

    def close(self) -> None:
        """Close the kept record files (no job runs any more)."""
        self.open_files.close()


class SlotFileLayout:
    """``count`` slot files, opened and registered once; location = slot index."""

    persistent = True
    piecewise = True

    def __init__(self, agent: NixlAgent, root: Path, count: int) -> None:
        self.agent = agent
        self.root = root
        self.count = count
        self.fds: list[int] = []
        self.devs: list[int] = []
        self.handles: list[object] = []
        self.stuck: set[int] = set()
        """Slots a stuck request may still use: never reused, never closed."""
        try:
            for i in range(count):
                fd = os.open(self.slot_path(i), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                self.fds.append(fd)
                dev, handle = agent.register_target(fd=fd)
                self.devs.append(dev)
                self.handles.append(handle)
        except BaseException:
            self.close()
            raise

    def slot_path(self, i: int) -> Path:
        return self.root / f"{SLOT_PREFIX}{i:06d}{RECORD_SUFFIX}"

    @contextlib.contextmanager
    def open_write(self, location: str | int, meta: EntryMeta, recycle: Sequence[str | int] = ()) -> Iterator[Loc]:
        """Slot ``location`` for the record. ``recycle`` lists slots of entries evicted to make
        room (``location`` may be one of them): each is invalidated first, so a crash during
        the write cannot bring an evicted entry back at a restart."""
        for old in recycle:
            self.delete(old)
        i = int(location)
        dev = self.devs[i]
        try:
            yield Loc(dev, 0, dev, meta.header_len)
        except NixlStuckError:
            self.stuck.add(i)
            raise
        fd = self.fds[i]
        if os.fstat(fd).st_size > meta.total_len:
            os.ftruncate(fd, meta.total_len)  # a shorter record: give the tail back

    @contextlib.contextmanager
    def open_read(self, location: str | int, meta: EntryMeta) -> Iterator[Loc]:
        i = int(location)
        size = os.fstat(self.fds[i]).st_size
        if size < meta.total_len:
            raise RecordError(f"slot file has {size} bytes, expected {meta.total_len}")
        dev = self.devs[i]
        try:
            yield Loc(dev, 0, dev, meta.header_len)
        except NixlStuckError:
            self.stuck.add(i)
            raise

    def delete(self, location: str | int) -> None:
        """Invalidate the slot (zero its magic) so a restart does not find the old record.

        A few bytes at offset 0 of an open file, but they can wait for the page's writeback:
        the tier calls this on worker threads, and on the loop only while it rebuilds its index
        at start (a slot holding a second record of a key, or an unreadable key). The bytes are
        reclaimed when the next record of the slot is shorter (``open_write`` truncates).
        """
        invalidate(self.fds[int(location)])

    def scan(self) -> tuple[list[Scanned], int]:
        found: list[Scanned] = []
        removed = 0
        for entry in os.scandir(self.root):
            name = entry.name
            if not entry.is_file(follow_symlinks=False):
                continue
            if name.endswith(TMP_SUFFIX):
                removed += reap_temp(entry.path, None, exclusive=True)  # the directory lock is ours
            elif name.endswith(RECORD_SUFFIX) and not name.startswith(SLOT_PREFIX):
                removed += _unlink(entry.path)  # a per-key record from another mode
            elif name.startswith(SLOT_PREFIX) and name.endswith(RECORD_SUFFIX):
                try:
                    idx = int(name[len(SLOT_PREFIX) : -len(RECORD_SUFFIX)])
                except ValueError:
                    continue
                if idx >= self.count:
                    removed += _unlink(entry.path)  # the pool shrank
        for i, fd in enumerate(self.fds):
            try:
                st = os.fstat(fd)
                if st.st_size == 0 or os.pread(fd, len(EMPTY_MAGIC), 0) == EMPTY_MAGIC:
                    continue  # never used, or invalidated
                header = probe_file(fd)
                if st.st_size < header.total_len:
                    raise RecordError("slot shorter than its record")
            except (OSError, RecordError) as exc:
                logger.info("nixl: clearing unreadable slot %d (%s)", i, exc)
                with contextlib.suppress(OSError):
                    os.pwrite(fd, EMPTY_MAGIC, 0)
                removed += 1
                continue
            found.append(Scanned(i, EntryMeta.from_header(header), st.st_mtime, _key_id(header)))
        found.sort(key=lambda s: s.mtime)
        return found, removed

    def close(self) -> None:
        """Deregister and close the slot files, except those of stuck requests (parked)."""
        for i, (fd, h) in enumerate(zip(self.fds, self.handles, strict=False)):
            if i in self.stuck:
                park(fd, h)
                continue
            self.agent.deregister(h)
            with contextlib.suppress(OSError):
                os.close(fd)
        for fd in self.fds[len(self.handles) :]:  # a construction that failed half-way
            with contextlib.suppress(OSError):
                os.close(fd)
        self.handles.clear()
        self.fds.clear()


class ObjectLayout:
    """Two objects per entry under ``prefix``: ``<name>.hdr`` (header) and ``<name>``."""

    persistent = False
    piecewise = False

    def __init__(self, agent: NixlAgent, prefix: str) -> None:
        self.agent = agent
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""

    @staticmethod
    def new_location(key: str) -> str:
        # Objects cannot be deleted through NIXL: a key always maps to the same names, so a
        # rewrite replaces the old objects instead of leaking new ones.
        return hashlib.blake2b(key.encode("utf-8"), digest_size=16).hexdigest()

    @contextlib.contextmanager
    def _open(self, location: str | int) -> Iterator[Loc]:
        name = self.prefix + str(location)
        hdev, hh = self.agent.register_target(object_name=name + ".hdr")
        handles = [hh]
        try:
            pdev, ph = self.agent.register_target(object_name=name)
            handles.append(ph)
            yield Loc(hdev, 0, pdev, 0)
        except NixlStuckError:
            park(*handles)  # the stuck request may still use them
            handles.clear()
            raise
        finally:
            for h in reversed(handles):
                self.agent.deregister(h)

    @contextlib.contextmanager
    def open_write(self, location: str | int, meta: EntryMeta, recycle: Sequence[str | int] = ()) -> Iterator[Loc]:
        with self._open(location) as loc:
            yield loc

    @contextlib.contextmanager
    def open_read(self, location: str | int, meta: EntryMeta) -> Iterator[Loc]:
        with self._open(location) as loc:
            yield loc

    def delete(self, location: str | int) -> None:
        """NIXL cannot delete objects: the entry leaves the index; its objects are replaced
        when the key is written again (use bucket lifecycle rules to expire the rest)."""

    def scan(self) -> tuple[list[Scanned], int]:
        return [], 0

    def close(self) -> None:
        pass


Layout = KeyFileLayout | SlotFileLayout | ObjectLayout


def _key_id(header: RecordHeader) -> bytes | None:
    return header.seal.key_id if header.seal is not None else None


def _unlink(path: str) -> int:
    try:
        os.unlink(path)
    except OSError:
        return 0
    return 1


__all__ = [
    "EMPTY_MAGIC",
    "OPEN_FILES",
    "RECORD_SUFFIX",
    "TMP_SUFFIX",
    "DirectoryInUseError",
    "EntryMeta",
    "KeyFileLayout",
    "Layout",
    "Loc",
    "NixlStuckError",
    "NixlTransferError",
    "ObjectLayout",
    "OpenFile",
    "OpenFiles",
    "Scanned",
    "Scratch",
    "ScratchSlot",
    "SlotFileLayout",
    "lock_directory",
    "probe_file",
    "read_record",
    "storage_root",
    "write_record",
]
