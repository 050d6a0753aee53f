"""The read side of the Mooncake Store tier: gets, and removal after a header check.

One job: turn a batch of entry names into verified blocks. A get opens one session, reads every
header into a small registered block, allocates the payload buffers the headers ask for, reads
the payloads straight into them (a sealed payload into a staging block, then opened), and counts
and removes what is corrupt (see :mod:`.mooncake` for the record layout and the rules). The
blocking jobs here run on the tier's worker threads (:mod:`.mooncake_calls`); the
:class:`MooncakeReads` mixin holds them and the block helpers the write path shares.
"""

from __future__ import annotations

from typing import Any

import torch
import xxhash

from lmcache_async.encryption import RecordCipher
from lmcache_async.memory import HeapAllocator, MemoryFormat, MemoryObj, PoolAllocator
from lmcache_async.ratelog import RateLimitedLog
from lmcache_async.records import RecordError, RecordHeader, decode_header
from lmcache_async.tiers import Allocate

from .mooncake_record import read_room
from .mooncake_store import (
    INVALID_PARAMS,
    NOT_FOUND,
    MooncakeClient,
    MooncakeError,
    MooncakeUnavailable,
    check,
)
from .naming import EntryName

__all__ = ["MooncakeReads", "PendingRead", "release_all"]


class PendingRead:
    """A get in progress: where its header and payload go (``stored``: the staging block a
    sealed payload lands in before it is opened into ``obj``)."""

    __slots__ = ("hdr", "head", "name", "obj", "stored")

    def __init__(self, name: EntryName, head: MemoryObj) -> None:
        self.name = name
        self.head = head
        self.hdr: Any = None
        self.obj: MemoryObj | None = None
        self.stored: MemoryObj | None = None

    def target(self) -> MemoryObj:
        """The block the payload transfer writes into."""
        dst = self.stored if self.stored is not None else self.obj
        assert dst is not None
        return dst


class MooncakeReads:
    """The get and remove jobs of :class:`~.mooncake.MooncakeBackend` (a mixin), and the
    header/staging block helpers both directions use.

    The backend's ``__init__`` sets the attributes declared here; every method runs on one of
    the tier's worker threads except :meth:`_log` (any thread)."""

    _cipher: RecordCipher | None
    _key_id: bytes | None
    _alloc: Allocate
    _heads: PoolAllocator
    _heap: HeapAllocator
    _rate_log: RateLimitedLog
    corrupt: int
    foreign: int
    foreign_key: int
    alloc_failed: int
    read_errors: int
    bytes_read: int

    def _log(self, msg: str, *args: Any) -> None:
        """A warning, at most one every few seconds (any thread)."""
        self._rate_log.warning(msg, *args)

    def _head_block(self, room: int) -> MemoryObj:
        """A block of ``room`` bytes for a record header: from the registered header arena, else
        the heap (registered for the call that uses it). The caller releases it."""
        obj = self._heads.allocate((room,), torch.uint8)
        return obj if obj is not None else self._heap.allocate((room,), torch.uint8)

    def _staging_block(self, n: int) -> MemoryObj:
        """``n`` bytes for a sealed record: registered staging memory when the staging area has
        room, else a heap block (registered for the call that uses it)."""
        obj = self._alloc((n,), torch.uint8, MemoryFormat.UNDEFINED)
        if obj is not None and obj.nbytes == n:
            return obj
        if obj is not None:
            obj.ref_count_down()
        return self._heap.allocate((n,), torch.uint8)

    def _get_job(self, client: MooncakeClient, names: list[EntryName], alloc: Allocate) -> list[MemoryObj | None]:
        """One result per name; a key asked for twice is read once and its block handed out
        with one reference per occurrence (each result is released on its own)."""
        unique = list({n.record: n for n in names}.values())
        if len(unique) == len(names):
            return self._get_unique(client, names, alloc)
        found = dict(zip((n.record for n in unique), self._get_unique(client, unique, alloc), strict=True))
        out: list[MemoryObj | None] = []
        given: set[str] = set()
        for n in names:
            obj = found[n.record]
            if obj is not None and n.record in given:
                obj.ref_count_up()
            given.add(n.record)
            out.append(obj)
        return out

    def _get_unique(self, client: MooncakeClient, names: list[EntryName], alloc: Allocate) -> list[MemoryObj | None]:
        """One result per name (no name twice): one session, every header read in one batch, then
        every payload into a block from ``alloc``; a miss, damage or a failed allocation is None.
        Raises for an unreachable store, after releasing whatever it took."""
        keys = [n.record for n in names]
        codes = client.session_start(keys)
        open_keys = [k for k, c in zip(keys, codes, strict=True) if c == 0]
        reads: list[PendingRead] = []
        try:
            for name, code in zip(names, codes, strict=True):
                if code == 0:
                    reads.append(PendingRead(name, self._head_block(read_room(name.key))))
                elif code != NOT_FOUND:
                    self._read_failed(name, code)
            if reads:
                self._read_headers(client, reads)
                reads = [r for r in reads if r.hdr is not None]
            for r in reads:
                obj = alloc(r.hdr.shape, r.hdr.dtype, r.hdr.fmt)
                if obj is None or obj.nbytes != r.hdr.plain_len:
                    if obj is not None:
                        obj.ref_count_down()
                    self.alloc_failed += 1
                    r.hdr = None
                    continue
                r.obj = obj
                if r.hdr.seal is not None:
                    r.stored = self._staging_block(r.hdr.payload_len)
            payload_reads = [r for r in reads if r.obj is not None and r.target().nbytes]
            if payload_reads:
                self._read_payloads(client, payload_reads)
            found: dict[str, MemoryObj] = {}
            for r in reads:
                if r.obj is not None:
                    found[r.name.record] = r.obj
                    r.obj = None
            return [found.get(k) for k in keys]
        except BaseException:
            for r in reads:
                if r.obj is not None:
                    r.obj.ref_count_down()
            raise
        finally:
            for r in reads:
                r.head.ref_count_down()
                if r.stored is not None:
                    r.stored.ref_count_down()
            if open_keys:
                client.session_end(open_keys)

    def _read_failed(self, name: EntryName, code: int) -> None:
        """Count and log a read of ``name`` that failed with ``code`` (raises when it says the
        store is unreachable)."""
        check("get", code)  # raises for "unreachable"
        self.read_errors += 1
        self._log("mooncake tier: get of %s failed with status %d", name.record, code)

    def _read_headers(self, client: MooncakeClient, reads: list[PendingRead]) -> None:
        """Read and verify every read's header in one batch; set ``hdr`` on each whose record is
        sound, holds its key and is ours to open (the others stay None: missed, counted)."""
        heads = [(r.head.data_ptr, r.head.nbytes) for r in reads]
        with client.registered(heads):
            got = client.read_ranges(
                [r.name.record for r in reads], [[p] for p, _ in heads], [[n] for _, n in heads], [[0]] * len(reads)
            )
        for r, n in zip(reads, got, strict=True):
            if n == INVALID_PARAMS:
                n = self._read_short(client, r.name, r.head)
            if n < 0:
                if n != NOT_FOUND:
                    self._read_failed(r.name, n)
                continue
            try:
                hdr = decode_header(r.head.byte_view()[:n])
                if hdr.num_parts != 1:
                    raise RecordError("a Mooncake record is never split into parts")
            except RecordError as exc:
                self._corrupt(client, r.name, str(exc))
                continue
            if hdr.key != r.name.key:
                self.foreign += 1
                self._log("mooncake object %s holds another key; treated as a miss", r.name.record)
                continue
            if not self._ours(r.name, hdr):
                continue
            r.hdr = hdr

    def _read_short(self, client: MooncakeClient, name: EntryName, head: MemoryObj) -> int:
        """Read the whole object into ``head`` when it is shorter than the header range asked
        for (a plain record of a small entry); its size, or a status (``INVALID_PARAMS`` when
        the object is not shorter: the range was refused for another reason)."""
        size = client.size(name.record)
        if not 0 <= size < head.nbytes:
            return size if size < 0 else INVALID_PARAMS
        if size == 0:
            return 0
        with client.registered([(head.data_ptr, head.nbytes)]):
            return client.read_ranges([name.record], [[head.data_ptr]], [[size]], [[0]])[0]

    def _ours(self, name: EntryName, hdr: RecordHeader) -> bool:
        """True when this tier can open ``hdr``'s record; a foreign one (sealed under another
        key id, sealed without a key here, plain with one) is counted and kept."""
        seal = hdr.seal
        if (seal.key_id if seal is not None else None) == self._key_id:
            return True
        self.foreign_key += 1
        why = "sealed under another key" if seal is not None else "not sealed"
        self._log("mooncake object %s is %s; treated as a miss and kept", name.record, why)
        return False

    def _read_payloads(self, client: MooncakeClient, reads: list[PendingRead]) -> None:
        """Read every payload in one batch into its target and verify (and open) it; a read that
        fails leaves ``obj`` None, its block released (damage counted and removed)."""
        bufs = [(o.data_ptr, o.nbytes) for o in (r.target() for r in reads)]
        with client.registered(bufs):
            got = client.read_ranges(
                [r.name.record for r in reads],
                [[p] for p, _ in bufs],
                [[n] for _, n in bufs],
                [[r.hdr.header_len] for r in reads],
            )
        for r, n in zip(reads, got, strict=True):
            obj, dst = r.obj, r.target()
            assert obj is not None
            why = None
            if n == dst.nbytes:
                if xxhash.xxh3_64_intdigest(dst.byte_view()) == r.hdr.checksum:
                    why = self._open(r.hdr, r.stored, obj)
                    if why is None:
                        self.bytes_read += r.hdr.header_len + n
                        continue
                else:
                    why = "payload checksum mismatch"
            elif n == INVALID_PARAMS and 0 <= client.size(r.name.record) < r.hdr.header_len + dst.nbytes:
                why = "object is shorter than its header says"
            r.obj = None
            obj.ref_count_down()
            if why is not None:
                self._corrupt(client, r.name, why)
            elif n != NOT_FOUND:
                self._read_failed(r.name, n)

    def _open(self, hdr: RecordHeader, stored: MemoryObj | None, obj: MemoryObj) -> str | None:
        """Decrypt a sealed payload (``stored``) into ``obj``; None when done (or nothing to
        open), else why it failed (a tag that fails: damage)."""
        if stored is None:
            return None
        assert self._cipher is not None  # _ours let a sealed record through only with our key
        try:
            self._cipher.open_into(hdr, stored.byte_view(), obj.byte_view())
        except RecordError as exc:
            return str(exc)
        return None

    def _corrupt(self, client: MooncakeClient, name: EntryName, why: str) -> None:
        """Count, log and remove the damaged object of ``name``."""
        self.corrupt += 1
        self._log("mooncake object %s is corrupt (%s); removed", name.record, why)
        client.remove(name.record)

    def _remove_job(self, client: MooncakeClient, name: EntryName) -> bool:
        """Remove ``name``'s object unless its header names another key (forced: a reader's lease
        does not block it); True when an object was removed."""
        code = client.session_start([name.record])[0]
        if code == NOT_FOUND:
            return False
        check("remove", code)
        room = read_room(name.key)
        head = self._head_block(room)
        try:
            with client.registered([(head.data_ptr, room)]):
                n = client.read_ranges([name.record], [[head.data_ptr]], [[room]], [[0]])[0]
            if n == INVALID_PARAMS:
                n = self._read_short(client, name, head)
            if n >= 0:
                try:
                    if decode_header(head.byte_view()[:n]).key != name.key:
                        return False  # another key's entry (a digest collision): not ours to delete
                except RecordError:
                    pass  # damaged: remove it
            else:
                try:
                    check("remove", n)  # the store unreachable: raised
                except MooncakeUnavailable:
                    raise
                except MooncakeError:
                    pass  # an unreadable header (a damaged object): remove it
        finally:
            head.ref_count_down()
            client.session_end([name.record])
        code = client.remove(name.record)
        if code == NOT_FOUND:
            return False
        check("remove", code)
        return True


def release_all(objs: list[MemoryObj | None]) -> None:
    """Drop the reference of every block in a get's answer (an abandoned get's orphaned result)."""
    for o in objs:
        if o is not None:
            o.ref_count_down()
