"""Blocking record I/O of the ``nixl`` tier: where records live and how their bytes move.

Everything here runs on the tier's worker threads, never on the event loop.

A stored entry is one self-describing record (:mod:`lmcache_async.records`): header, then
payload. Both travel through NIXL: the header from a small registered scratch area, the payload
straight from/to the registered pool block (or through a registered bounce area when the block
is not registered memory). Payloads move in pieces of ``chunk_bytes``; each piece is
checksummed (xxh3-64) right before it is written or right after it was read, while it is still
in the CPU cache. The header rides in the same request as the last piece written (its checksum
is known only then) and the first piece read (so a wrong record is rejected early).

Layouts:

* :class:`KeyFileLayout` — one file per entry (``<hash>.<tag>-<n>.lmcr``): a new file is written
  under a temporary name and renamed; the file of an evicted entry is overwritten in place
  under its name (a torn record fails its checksum on read); recently used record
  files stay open and registered (:class:`OpenFiles`);
* :class:`SlotFileLayout` — ``nixl_pool_size`` pre-created slot files, opened and registered
  once; an entry occupies one slot;
* :class:`ObjectLayout` — two objects per entry (``<name>.hdr`` and ``<name>``) in an
  S3-compatible store; OBJ writes whole objects only, so the payload is written in one piece.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import itertools
import logging
import os
import queue
import secrets
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from lmcache_async.backends.nixl_agent import (
    HEADER_SCRATCH_BYTES,
    NixlAgent,
    NixlStuckError,
    NixlTransferError,
    park,
)
from lmcache_async.memory import MemoryFormat, MemoryObj, address_view, populate_pages
from lmcache_async.records import (
    PROBE_LEN,
    RecordError,
    RecordHeader,
    decode_header,
    encode_header,
    peek_header_len,
)

logger = logging.getLogger(__name__)

RECORD_SUFFIX = ".lmcr"
TMP_SUFFIX = ".tmp"
SLOT_PREFIX = "slot-"
EMPTY_MAGIC = bytes(8)
"""What an unused or invalidated slot holds where a record's magic would be."""


# ---- registered scratch ------------------------------------------------------------------------
@dataclass
class ScratchSlot:
    """One worker's registered scratch: a header area and a bounce area."""

    index: int
    header_ptr: int
    bounce: torch.Tensor
    retired: bool = False

    @property
    def bounce_ptr(self) -> int:
        return int(self.bounce.data_ptr())


class Scratch:
    """``slots`` scratch areas in one buffer registered with the agent once.

    A slot used by a stuck request (:class:`NixlStuckError`) is retired with :meth:`retire`:
    it never goes back to the queue, its memory stays allocated for the life of the process,
    and a freshly registered area takes its place. Thread-safe.
    """

    def __init__(self, agent: NixlAgent, slots: int, bounce_bytes: int) -> None:
        self.stride = HEADER_SCRATCH_BYTES + bounce_bytes
        self.buffer = torch.zeros(slots * self.stride, dtype=torch.uint8)
        populate_pages(self.buffer.data_ptr(), self.buffer.numel())
        base = int(self.buffer.data_ptr())
        self._agent = agent
        self.handle = agent.register_dram(base, self.buffer.numel())
        self._extra: list[tuple[torch.Tensor, object]] = []  # replacement areas and their handles
        self.retired: list[ScratchSlot] = []
        self._lock = threading.Lock()
        self._live = slots
        self._next_index = slots
        self._free: queue.SimpleQueue[ScratchSlot] = queue.SimpleQueue()
        for i in range(slots):
            off = i * self.stride
            bounce = self.buffer[off + HEADER_SCRATCH_BYTES : off + self.stride]
            self._free.put(ScratchSlot(i, base + off, bounce))

    @property
    def live(self) -> int:
        """Slots that can still be handed out (retired ones excluded)."""
        return self._live

    @contextlib.contextmanager
    def slot(self) -> Iterator[ScratchSlot]:
        """A scratch area for the duration of one job (jobs never outnumber slots).

        Raises :class:`NixlTransferError` when every area was retired and none could be
        replaced. A slot retired while held is not given back.
        """
        if self._live <= 0:
            raise NixlTransferError("no NIXL scratch area left (all were used by stuck requests)")
        try:
            s = self._free.get(timeout=60.0)
        except queue.Empty:
            raise NixlTransferError("no NIXL scratch area became free within 60 s") from None
        try:
            yield s
        finally:
            if not s.retired:
                self._free.put(s)

    def retire(self, s: ScratchSlot) -> None:
        """Never reuse ``s`` (a stuck request may still write into it); register a fresh area
        in its place. Registration errors are logged: the tier then has one slot less."""
        with self._lock:
            if s.retired:
                return
            s.retired = True
            self.retired.append(s)
            self._live -= 1
            index = self._next_index
            self._next_index += 1
        try:
            buf = torch.zeros(self.stride, dtype=torch.uint8)
            handle = self._agent.register_dram(int(buf.data_ptr()), buf.numel())
        except Exception as exc:
            logger.error("nixl: no replacement for a retired scratch area: %s", exc)
            return
        with self._lock:
            self._extra.append((buf, handle))
            self._live += 1
        self._free.put(ScratchSlot(index, int(buf.data_ptr()), buf[HEADER_SCRATCH_BYTES:]))

    def close(self) -> None:
        """Deregister the areas. With a retired slot, nothing is deregistered and the memory is
        parked for the life of the process (the stuck request may still use it)."""
        with self._lock:
            extra, self._extra = self._extra, []
            retired = list(self.retired)
        if retired or self._agent.stuck:
            park(self.buffer, *(b for b, _ in extra), *retired)
            return
        self._agent.deregister(self.handle)
        for _, handle in extra:
            self._agent.deregister(handle)


# ---- where the record's bytes are ---------------------------------------------------------------
@dataclass(frozen=True)
class Loc:
    """Registered targets of one record: header at ``(header_dev, header_off)``, payload at
    ``(payload_dev, payload_off)``."""

    header_dev: int
    header_off: int
    payload_dev: int
    payload_off: int


@dataclass(frozen=True)
class EntryMeta:
    """What the index knows of a record (enough to read it without a probe)."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    fmt: MemoryFormat
    header_len: int
    payload_len: int

    @property
    def total_len(self) -> int:
        return self.header_len + self.payload_len

    @classmethod
    def from_header(cls, h: RecordHeader) -> EntryMeta:
        return cls(h.key, h.shape, h.dtype, h.fmt, h.header_len, h.payload_len)


def _pieces(n: int, chunk: int) -> list[tuple[int, int]]:
    return [(off, min(chunk, n - off)) for off in range(0, n, chunk)]


def _flat(obj: MemoryObj) -> torch.Tensor:
    t = obj.tensor
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    return t.reshape(-1).view(torch.uint8)


def write_record(
    agent: NixlAgent,
    slot: ScratchSlot,
    loc: Loc,
    meta: EntryMeta,
    src: MemoryObj,
    src_registered: bool,
    chunk: int,
    piecewise: bool = True,
) -> None:
    """Write ``src``'s bytes as a record at ``loc`` (blocking). ``piecewise=False`` writes the
    payload in one request (object stores), which needs ``src_registered``."""
    n = meta.payload_len
    pieces = _pieces(n, chunk) if piecewise else ([(0, n)] if n else [])
    if not src_registered and not piecewise:
        raise ValueError("a one-piece write needs a registered source")
    hasher = xxhash.xxh3_64()
    flat = None if src_registered else _flat(src)
    header_desc: tuple[int, int] | None = None
    if not pieces:
        pieces_iter: list[tuple[int, int] | None] = [None]
    else:
        pieces_iter = list(pieces)
    last = len(pieces_iter) - 1
    for i, piece in enumerate(pieces_iter):
        local: list[tuple[int, int]] = []
        remote: list[tuple[int, int, int]] = []
        if piece is not None:
            off, ln = piece
            if flat is None:
                ptr = src.data_ptr + off
            else:
                slot.bounce[:ln].copy_(flat[off : off + ln])
                ptr = slot.bounce_ptr
            hasher.update(address_view(ptr, ln))
            local.append((ptr, ln))
            remote.append((loc.payload_off + off, ln, loc.payload_dev))
        if i == last:
            header = encode_header(meta.key, meta.shape, meta.dtype, meta.fmt, hasher.intdigest())
            if len(header) != meta.header_len or len(header) > HEADER_SCRATCH_BYTES:
                raise RecordError("header length differs from the planned one")
            address_view(slot.header_ptr, len(header))[:] = header
            header_desc = (slot.header_ptr, len(header))
            local.append(header_desc)
            remote.append((loc.header_off, len(header), loc.header_dev))
        agent.transfer("WRITE", local, remote)


def read_record(
    agent: NixlAgent,
    slot: ScratchSlot,
    loc: Loc,
    meta: EntryMeta,
    dst: MemoryObj,
    dst_registered: bool,
    chunk: int,
) -> None:
    """Read the record at ``loc`` into ``dst`` and verify it (blocking).

    Raises :class:`RecordError` when the header does not match ``meta`` (another key, another
    shape) or the payload checksum differs; :class:`NixlTransferError` when NIXL fails.
    """
    n = meta.payload_len
    if meta.header_len > HEADER_SCRATCH_BYTES:
        raise RecordError("header larger than the scratch area")
    pieces: list[tuple[int, int] | None] = list(_pieces(n, chunk)) or [None]
    flat = None if dst_registered else _flat(dst)
    hasher = xxhash.xxh3_64()
    header: RecordHeader | None = None
    for i, piece in enumerate(pieces):
        local: list[tuple[int, int]] = []
        remote: list[tuple[int, int, int]] = []
        if i == 0:
            local.append((slot.header_ptr, meta.header_len))
            remote.append((loc.header_off, meta.header_len, loc.header_dev))
        ptr = 0
        if piece is not None:
            off, ln = piece
            ptr = dst.data_ptr + off if flat is None else slot.bounce_ptr
            local.append((ptr, ln))
            remote.append((loc.payload_off + off, ln, loc.payload_dev))
        agent.transfer("READ", local, remote)
        if i == 0:
            header = decode_header(address_view(slot.header_ptr, meta.header_len), expect_key=meta.key)
            if EntryMeta.from_header(header) != meta:
                raise RecordError("record header does not match the index")
        if piece is not None:
            off, ln = piece
            hasher.update(address_view(ptr, ln))
            if flat is not None:
                flat[off : off + ln].copy_(slot.bounce[:ln])
    assert header is not None
    if hasher.intdigest() != header.checksum:
        raise RecordError("payload checksum mismatch")


def invalidate(fd: int) -> None:
    """Zero the magic of the record in file ``fd``: a restart finds it unreadable and drops it."""
    os.pwrite(fd, EMPTY_MAGIC, 0)


def probe_file(fd: int) -> RecordHeader:
    """Decode the header of the record file ``fd`` with plain reads (index rebuild)."""
    head = os.pread(fd, PROBE_LEN, 0)
    hlen = peek_header_len(head)
    if hlen > len(head):
        head = os.pread(fd, hlen, 0)
    return decode_header(head)


@dataclass
class Scanned:
    """One record found by a layout scan."""

    location: str | int
    meta: EntryMeta
    mtime: float


# ---- open record files ---------------------------------------------------------------------------
@dataclass(frozen=True)
class OpenFile:
    """A record file opened and registered with the agent as a NIXL target."""

    fd: int
    handle: object
    dev: int
    writable: bool


OPEN_FILES = 256
"""How many record files :class:`OpenFiles` keeps open and registered, at most."""


class OpenFiles:
    """Record files kept open and registered between operations, least recently used first
    out, so reading a record soon after it was written or read skips ``open``, registration,
    deregistration and ``close`` (≈ 15 µs here).

    A file is *taken* for an operation (out of the cache, so nothing else closes it under the
    operation) and *given back* afterwards under its (possibly new) name. Any thread; the
    lock covers the bookkeeping only, descriptors are closed outside it.
    """

    def __init__(self, agent: NixlAgent, cap: int = OPEN_FILES) -> None:
        self._agent = agent
        self._cap = cap
        self._lock = threading.Lock()
        self._files: collections.OrderedDict[str, OpenFile] = collections.OrderedDict()
        self._taken: set[str] = set()
        self._dropped: set[str] = set()

    def __len__(self) -> int:
        return len(self._files)

    def take(self, name: str) -> OpenFile | None:
        """The open file of record ``name``, now owned by the caller; None when not kept."""
        with self._lock:
            f = self._files.pop(name, None)
            if f is not None:
                self._taken.add(name)
            return f

    def give_back(self, name: str, f: OpenFile, taken_as: str | None = None) -> None:
        """Keep ``f`` as record ``name``'s open file (``taken_as``: the name it was taken
        under, when it was). Closes it instead when ``taken_as`` was dropped meanwhile, and
        closes the least recently used files beyond the cap."""
        out: list[OpenFile] = []
        with self._lock:
            if taken_as is not None:
                self._taken.discard(taken_as)
                if taken_as in self._dropped:
                    self._dropped.discard(taken_as)
                    out.append(f)
            if not out:
                self._files[name] = f
                while len(self._files) > self._cap:
                    out.append(self._files.popitem(last=False)[1])
        for old in out:
            self._close(old)

    def drop(self, name: str) -> None:
        """Record ``name`` is going away: close its kept file (or, when an operation has it
        taken, have :meth:`give_back` close it)."""
        with self._lock:
            f = self._files.pop(name, None)
            if f is None and name in self._taken:
                self._dropped.add(name)
        if f is not None:
            self._close(f)

    def release(self, f: OpenFile, taken_as: str | None = None) -> None:
        """Deregister and close ``f`` (owned by the caller; ``taken_as``: the name it was
        taken under, when it was)."""
        if taken_as is not None:
            with self._lock:
                self._taken.discard(taken_as)
                self._dropped.discard(taken_as)
        self._close(f)

    def settle(self, name: str, f: OpenFile, taken_as: str | None, ok: bool, stuck: bool) -> None:
        """After an operation on ``f``: keep it as ``name``'s file when it went well, park it
        after a stuck request (never closed: the request may still use it, and a closed
        descriptor's number would soon name another file), else close it."""
        if stuck:
            park(f.fd, f.handle)
        elif ok:
            self.give_back(name, f, taken_as)
        else:
            self.release(f, taken_as)

    def close(self) -> None:
        with self._lock:
            files = list(self._files.values())
            self._files.clear()
        for f in files:
            self._close(f)

    def _close(self, f: OpenFile) -> None:
        _release_target(self._agent, f.fd, f.handle, stuck=False)


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
            target = self._path(name, f".{os.getpid()}{TMP_SUFFIX}")
            try:
                f = self._open_registered(target, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
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
            else:
                os.replace(target, path)
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
            if name.endswith(TMP_SUFFIX) or name.startswith(SLOT_PREFIX):
                # The directory lock is ours: any temporary file's writer is gone.
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
            found.append(Scanned(stem, EntryMeta.from_header(header), st.st_mtime))
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
                removed += _unlink(entry.path)
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
            found.append(Scanned(i, EntryMeta.from_header(header), st.st_mtime))
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


def _release_target(agent: NixlAgent, fd: int, handle: object | None, stuck: bool) -> None:
    """Deregister and close a per-operation file target; after a stuck request, park both."""
    if stuck:
        park(fd, handle)
        return
    if handle is not None:
        agent.deregister(handle)
    os.close(fd)


def _unlink(path: str) -> int:
    try:
        os.unlink(path)
    except OSError:
        return 0
    return 1


__all__ = [
    "EntryMeta",
    "KeyFileLayout",
    "Layout",
    "Loc",
    "NixlStuckError",
    "NixlTransferError",
    "ObjectLayout",
    "Scanned",
    "Scratch",
    "ScratchSlot",
    "SlotFileLayout",
    "probe_file",
    "read_record",
    "write_record",
]
