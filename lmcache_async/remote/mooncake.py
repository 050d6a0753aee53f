"""The Mooncake Store tier (``remote_url: mooncake://HOST:PORT``, the master's RPC address).

Entries live in Mooncake's distributed memory: the master places objects into segments that
holders (``mooncake_client`` processes, or clients with ``mooncake_global_segment_size > 0``)
mount; this process is usually a pure client (segment size 0) that moves bytes between its
registered memory and those segments.

Layout: one object per entry, named like the Redis tier's record (``<prefix>:<model>:{<digest>}``,
:mod:`.naming`), holding one record (:mod:`lmcache_async.records`): the header, zero-padded to a
length that depends on the key alone (:func:`header_room`), then the payload. So a reader knows
where the payload starts before it has read a byte, and reads header and payload as two ranges
of one get session: the header into a small registered buffer, then — once the header said the
shape and dtype, and the allocator gave a buffer for them — the payload straight into that
buffer. A put sends header and payload from their own buffers as one object: a single entry
with ``put_from_with_metadata`` (the same request path as ``put_from``), a batch with one
``batch_put_from_multi_buffers``. A single entry's header is written into one of the header
arena's slots (one per worker thread), so such a put allocates nothing. No payload byte is
copied on the way in either direction.

Sealed records (``encryption_key_file``): the payload is AES-256-GCM ciphertext and tag (one
segment: an object is always read whole; :mod:`lmcache_async.encryption`), the header carries
the seal (key id, nonce). Then no transfer can use the caller's block as it is: a put seals into
a staging block (header room, then the sealed payload; registered staging memory when the
staging area has room, else a heap block registered for the call) and sends that; a get reads
the sealed payload into such a block and opens it into the caller's buffer. A record sealed
under another key id, or sealed while this tier has no key, or plain while it has one, is
foreign: a miss, kept, counted as ``foreign_key``; a tag that fails under this key is damage: a
miss, removed, counted as ``corrupt``. Readers always fetch :func:`read_room` header bytes (room
for a sealed header), so either kind of reader recognises either kind of record.

Every read is verified (magic, version, header checksum, key, sizes, payload checksum): a
corrupt object is a miss, counted and removed; an object holding another key is a miss, counted
and kept. Presence comes from ``batch_is_exist``; an error answer there raises (the manager
treats it as "unknown"), it never reads as "absent". Removal is forced: the lease a recent
reader holds on an object does not block it.

Blocking: every Mooncake call blocks, so calls run on this tier's own bounded pool of worker
threads within ``remote_timeout_s``, and a store that stops answering is marked down and probed
until it answers again (:mod:`.mooncake_calls`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import xxhash

from lmcache_async.encryption import RecordCipher, cipher_for
from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import HeapAllocator, MemoryObj, PoolAllocator
from lmcache_async.ratelog import RateLimitedLog
from lmcache_async.records.sections import sealed_length
from lmcache_async.tiers import Allocate, BackendContext, StorageBackend

from .mooncake_calls import MooncakeCalls, MooncakeTimeout
from .mooncake_reads import MooncakeReads, release_all
from .mooncake_record import header_room, padded_header, read_room, write_header
from .mooncake_store import (
    ALREADY_EXISTS,
    NO_SPACE,
    MooncakeClient,
    MooncakeError,
    MooncakeUnavailable,
    check,
    mooncake_settings,
)
from .naming import EntryName, check_prefix, entry_name

__all__ = [
    "HEAD_SLOT_BYTES",
    "MooncakeBackend",
    "MooncakeError",
    "MooncakeTimeout",
    "MooncakeUnavailable",
    "create",
    "header_room",
    "mooncake_settings",
    "padded_header",
    "read_room",
]

logger = logging.getLogger(__name__)

HEADER_ARENA_BYTES = 4 << 20
HEAD_SLOT_BYTES = 1024
"""Bytes of each header slot of a single-entry put (the header room of keys up to 704 bytes; a
longer key's header gets a block of the arena for that put)."""
_LOG_EVERY_S = 5.0


class MooncakeBackend(MooncakeReads, StorageBackend):
    """The remote tier over a Mooncake Store; see the module docstring.

    ``url``, ``prefix`` and ``timeout_s`` default to ``remote_url``, ``remote_key_prefix`` and
    ``remote_timeout_s``. ``encryption_key_file`` in the config seals every record written and
    opens those read (see the module docstring). Construction validates the settings (and reads
    the key file) and does not connect;
    :meth:`start` (or the first call) sets the client up. Thread affinity: coroutines run on the
    manager's loop; Mooncake calls run on the tier's threads (``lmcache-async-<cache>-mooncake``).
    """

    name = "remote"

    def __init__(
        self,
        ctx: BackendContext,
        url: str | None = None,
        *,
        prefix: str | None = None,
        timeout_s: float | None = None,
        workers: int | None = None,
    ) -> None:
        cfg = ctx.config
        url = url if url is not None else cfg.remote_url
        if not url:
            raise ValueError("remote_url is not set")
        self._cipher: RecordCipher | None = cipher_for(cfg)
        self._key_id = self._cipher.key_id if self._cipher is not None else None
        timeout = cfg.remote_timeout_s if timeout_s is None else timeout_s
        if not timeout > 0:
            raise ValueError(f"remote_timeout_s must be > 0, got {timeout!r}")
        settings = mooncake_settings(ctx, url)
        self._prefix = check_prefix(cfg.remote_key_prefix if prefix is None else prefix)
        self._alloc = ctx.staging
        self._heads = PoolAllocator(
            HEADER_ARENA_BYTES, name=f"{ctx.cache_name} mooncake headers", align=64, pretouch=False, reserve_bytes=0
        )
        self._heap = HeapAllocator(f"{ctx.cache_name}-mooncake-heap")
        self._rate_log = RateLimitedLog(logger, _LOG_EVERY_S)
        # Registered once per client: the pool, the staging area and the header arena.
        regions = [
            (p.base_ptr, p.capacity) for p in (ctx.pool, ctx.staging_pool, self._heads) if p is not None and p.capacity
        ]
        self._calls = MooncakeCalls(
            settings,
            regions,
            timeout_s=float(timeout),
            workers=workers if workers is not None else max(2, cfg.executor_workers),
            thread_name=f"lmcache-async-{ctx.cache_name}-mooncake",
            log=self._rate_log,
        )
        # As many header slots as worker threads, so a single-entry put always finds one (a job
        # holds its slot until its Mooncake call returned, an abandoned call included).
        # list.pop/append are atomic: no lock on the put path.
        self._slots: list[MemoryObj] = []
        for _ in range(self._calls.workers):
            slot = self._heads.allocate((HEAD_SLOT_BYTES,), torch.uint8)
            if slot is not None:
                self._slots.append(slot)
        # counters
        self.corrupt = 0
        self.foreign = 0
        self.foreign_key = 0
        self.alloc_failed = 0
        self.no_space = 0
        self.put_errors = 0
        self.read_errors = 0
        self.bytes_written = 0
        self.bytes_read = 0

    # ---- capabilities ----------------------------------------------------------------------------
    @property
    def persistent(self) -> bool:
        return True  # entries outlive this process (they live in the holders' segments)

    @property
    def shared(self) -> bool:
        return True

    @property
    def is_remote(self) -> bool:
        return True

    @property
    def prefix(self) -> str:
        """The namespace of this backend's entries."""
        return self._prefix

    def entry_name(self, key: CacheEngineKey) -> EntryName:
        """Where ``key``'s entry lives; its Mooncake key is ``.record``."""
        return entry_name(self._prefix, key)

    def _seal(self, name: EntryName, obj: MemoryObj) -> tuple[MemoryObj, int]:
        """A staging block holding ``obj``'s sealed record (padded header, then the sealed
        payload) and its header room; the caller releases the block."""
        assert self._cipher is not None
        room = header_room(name.key, sealed=True)
        _segments, stored_len = sealed_length(obj.nbytes, 0)
        block = self._staging_block(room + stored_len)
        try:
            view = block.byte_view()
            body = view[room:]
            seal = self._cipher.seal_into(name.key, tuple(obj.shape), obj.dtype, obj.fmt, obj.byte_view(), body)
            write_header(view, obj, name.key, xxhash.xxh3_64_intdigest(body), seal)
        except BaseException:
            block.ref_count_down()
            raise
        return block, room

    def _put_sealed(self, client: MooncakeClient, items: list[tuple[EntryName, MemoryObj]]) -> list[bool]:
        """Seal every entry into a staging block and publish the blocks (one call for a single
        entry, one batch call otherwise)."""
        blocks: list[tuple[MemoryObj, int]] = []
        try:
            for name, obj in items:
                blocks.append(self._seal(name, obj))
            bufs = [(b.data_ptr, b.nbytes) for b, _room in blocks]
            with client.registered(bufs):
                if len(items) == 1:
                    ((block, room),) = blocks
                    codes = [
                        client.put_with_header(
                            items[0][0].record, block.data_ptr, room, block.data_ptr + room, block.nbytes - room
                        )
                    ]
                else:
                    codes = client.put_parts([n.record for n, _o in items], [[p] for p, _ in bufs],
                                             [[s] for _, s in bufs])  # fmt: skip
        finally:
            for block, _room in blocks:
                block.ref_count_down()
        sizes = [size for _p, size in bufs]
        return [self._put_done(name, code, size) for code, (name, _o), size in zip(codes, items, sizes, strict=True)]

    def _put_job(self, client: MooncakeClient, items: list[tuple[EntryName, MemoryObj]]) -> list[bool]:
        """Publish every item (one Mooncake call: a single entry from a header slot, else one batch
        of header and payload buffers; sealed records via :meth:`_put_sealed`); one flag per item."""
        if self._cipher is not None:
            return self._put_sealed(client, items)
        if len(items) == 1 and items[0][1].nbytes:
            return [self._put_one(client, *items[0])]
        heads: list[MemoryObj] = []
        try:
            keys: list[str] = []
            ptrs: list[list[int]] = []
            sizes: list[list[int]] = []
            buffers: list[tuple[int, int]] = []
            for name, obj in items:
                block = self._head_block(header_room(name.key))
                heads.append(block)
                room = write_header(block.byte_view(), obj, name.key, xxhash.xxh3_64_intdigest(obj.byte_view()))
                p, s = [block.data_ptr], [room]
                if obj.nbytes:
                    p.append(obj.data_ptr)
                    s.append(obj.nbytes)
                keys.append(name.record)
                ptrs.append(p)
                sizes.append(s)
                buffers.extend(zip(p, s, strict=True))
            with client.registered(buffers):
                codes = client.put_parts(keys, ptrs, sizes)
        finally:
            for block in heads:
                block.ref_count_down()
        return [self._put_done(name, code, sum(s)) for code, (name, _o), s in zip(codes, items, sizes, strict=True)]

    def _put_one(self, client: MooncakeClient, name: EntryName, obj: MemoryObj) -> bool:
        """One entry with a payload: its header in a thread slot, one ``put_from_with_metadata``."""
        room = header_room(name.key)
        slot: MemoryObj | None = None
        if room <= HEAD_SLOT_BYTES:
            try:
                slot = self._slots.pop()
            except IndexError:  # (only if the arena could not give every thread a slot)
                slot = None
        head = slot if slot is not None else self._head_block(room)
        try:
            write_header(head.byte_view(), obj, name.key, xxhash.xxh3_64_intdigest(obj.byte_view()))
            with client.registered(((head.data_ptr, room), (obj.data_ptr, obj.nbytes))):
                code = client.put_with_header(name.record, head.data_ptr, room, obj.data_ptr, obj.nbytes)
        finally:
            if slot is not None:
                self._slots.append(slot)
            else:
                head.ref_count_down()
        return self._put_done(name, code, room + obj.nbytes)

    def _put_done(self, name: EntryName, code: int, size: int) -> bool:
        """Count a put's answer; True when the entry is stored (also when it already was)."""
        if code in (0, ALREADY_EXISTS):
            if code == 0:
                self.bytes_written += size
            return True
        if code == NO_SPACE:
            self.no_space += 1
            self._log("mooncake tier: no segment has room for %s (%d bytes)", name.record, size)
            return False
        check("put", code)  # raises for "unreachable"
        self.put_errors += 1
        self._log("mooncake tier: put of %s failed with status %d", name.record, code)
        return False

    # ---- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        """Set the client up and register the pool, staging and header memory. An unreachable
        master raises (the manager logs and counts it); later calls set up by themselves."""
        await self._calls.run(_nothing)

    async def close(self) -> None:
        """Refuse new calls and close the client; a client still used by an abandoned call is
        closed by that call when it ends."""
        await self._calls.close()

    # ---- core ----------------------------------------------------------------------------------------
    async def put(self, key: CacheEngineKey, obj: MemoryObj) -> bool:
        return (await self.batched_put([(key, obj)]))[0]

    async def batched_put(self, items: Sequence[tuple[CacheEngineKey, MemoryObj]]) -> list[bool]:
        """All items in one job (one Mooncake call); each block is referenced until it ends."""
        if not items:
            return []
        named = [(entry_name(self._prefix, k), o) for k, o in items]
        taken: list[MemoryObj] = []
        for _, o in named:
            o.ref_count_up()  # the job reads the block; it must outlive a caller that gave up
            taken.append(o)

        def release() -> None:
            for o in taken:
                o.ref_count_down()

        return await self._calls.run(self._put_job, named, n=len(named), after=release)

    async def get(self, key: CacheEngineKey, alloc: Allocate | None = None) -> MemoryObj | None:
        return (await self.batched_get([key], alloc))[0]

    async def batched_get(
        self, keys: Sequence[CacheEngineKey], alloc: Allocate | None = None
    ) -> list[MemoryObj | None]:
        """One result per key, read in one job (one session, two batched transfers)."""
        if not keys:
            return []
        names = [entry_name(self._prefix, k) for k in keys]
        return await self._calls.run(self._get_job, names, alloc or self._alloc, n=len(names), orphan=release_all)

    async def contains(self, key: CacheEngineKey) -> bool:
        return (await self.batched_contains([key]))[0]

    async def batched_contains(self, keys: Sequence[CacheEngineKey]) -> list[bool]:
        """``batch_is_exist`` in one job; an error answer raises (unknown, never absent)."""
        if not keys:
            return []
        records = [entry_name(self._prefix, k).record for k in keys]
        flags = await self._calls.run(MooncakeClient.batch_is_exist, records, n=len(records))
        return [f == 1 for f in flags]

    async def remove(self, key: CacheEngineKey) -> bool:
        return await self._calls.run(self._remove_job, entry_name(self._prefix, key))

    async def clear(self) -> None:
        """Remove every object below this backend's prefix (all models)."""
        pattern = "^" + "".join(c if c.isalnum() or c in "_:" else f"[{c}]" for c in self._prefix) + ":"
        await self._calls.run(MooncakeClient.remove_matching, pattern)

    def stats(self) -> dict[str, Any]:
        return {
            "scheme": "mooncake",
            "prefix": self._prefix,
            "corrupt": self.corrupt,
            "foreign": self.foreign,
            "foreign_key": self.foreign_key,
            "sealed": self._cipher is not None,
            "alloc_failed": self.alloc_failed,
            "no_space": self.no_space,
            "put_errors": self.put_errors,
            "read_errors": self.read_errors,
            "bytes_written": self.bytes_written,
            "bytes_read": self.bytes_read,
            **self._calls.stats(),
        }


def _nothing(_client: MooncakeClient) -> None:
    return None


def create(ctx: BackendContext) -> MooncakeBackend:
    """Registry factory of the ``mooncake://`` remote tier."""
    return MooncakeBackend(ctx)
