"""What the ``nixl`` tier's worker threads do: the work items and the blocking jobs over them.

The backend (:mod:`.nixl`) plans on the loop — a :class:`WritePlan` per record to write, a
:class:`ReadJob` per record to read, a slot number per slot to invalidate — and hands lists of
them to :class:`NixlWork` through the job runner (:mod:`.nixl_jobs`). Every job returns one
outcome per item (None, or the exception that item met) and never raises.

Buffer ownership: a :class:`WritePlan` holds one reference to its source block, which the
backend's finish (or :meth:`NixlWork.orphan_writes`) gives back; a :class:`ReadJob`'s
destination belongs to its :class:`ReadBatch` once delivered, and to nobody (it stays allocated
for good) when a stuck request may still write into it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import MemoryObj, PoolAllocator
from lmcache_async.nixl.agent import NixlAgent, NixlStuckError, NixlTransferError, park
from lmcache_async.nixl.index import Entry, NixlCounters
from lmcache_async.nixl.io import (
    EntryMeta,
    KeyFileLayout,
    Layout,
    Scratch,
    ScratchSlot,
    SlotFileLayout,
    read_record,
    write_record,
)
from lmcache_async.nixl.jobs import Outcomes, each_with_slot
from lmcache_async.tiers import Allocate

if TYPE_CHECKING:
    from lmcache_async.encryption import RecordCipher

logger = logging.getLogger(__name__)

__all__ = ["NixlWork", "ReadBatch", "ReadJob", "WritePlan", "no_orphan", "plan_bytes", "read_bytes", "slot_bytes"]


@dataclass
class WritePlan:
    """One record to write: ``obj`` (one reference held for the job) to ``location``, reusing
    the evicted entries' files or slots in ``recycle``; ``future`` gets the result."""

    key: CacheEngineKey
    obj: MemoryObj
    meta: EntryMeta
    location: str | int
    future: asyncio.Future[bool]
    registered: bool
    recycle: list[str | int]


class ReadBatch:
    """Results of one ``batched_get``; buffers arriving after the caller gave up go back."""

    def __init__(self, results: list[MemoryObj | None]) -> None:
        self.results = results
        self.abandoned = False
        #: Deletions of records this batch found damaged; the call returns once they are done.
        self.discards: list[asyncio.Future[Any]] = []

    def deliver(self, index: int, obj: MemoryObj) -> None:
        """Hand ``obj`` (one reference) to the caller, or back to its pool once abandoned."""
        if self.abandoned:
            obj.ref_count_down()
        else:
            self.results[index] = obj

    def abandon(self) -> None:
        """The caller gave up: what arrived goes back now, the rest when it arrives."""
        self.abandoned = True
        for i, obj in enumerate(self.results):
            if obj is not None:
                obj.ref_count_down()
                self.results[i] = None


@dataclass
class ReadJob:
    """One record to read into ``dst`` (registered memory or not) for slot ``index`` of ``batch``."""

    index: int
    key: CacheEngineKey
    entry: Entry
    dst: MemoryObj
    registered: bool
    batch: ReadBatch


class NixlWork:
    """The blocking jobs of one tier, bound to its agent, layout and scratch area.

    ``registered`` are the pools registered with the agent; ``staging`` is the registered staging
    pool (reads that cannot land in registered memory, and copies of unregistered sources for
    one-piece object-store writes); None when there is none. ``cipher`` seals the records
    planned as sealed and opens them (through the scratch bounce area). The jobs run on worker
    threads.
    """

    def __init__(
        self,
        agent: NixlAgent,
        layout: Layout,
        scratch: Scratch,
        chunk_bytes: int,
        registered: tuple[PoolAllocator, ...],
        staging: PoolAllocator | None,
        cipher: RecordCipher | None = None,
    ) -> None:
        self.agent = agent
        self.layout = layout
        self.scratch = scratch
        self.chunk_bytes = chunk_bytes
        self._pools = registered
        self.staging = staging
        self.cipher = cipher

    def registered(self, obj: MemoryObj) -> bool:
        """``obj`` lies in memory registered with the agent (any thread)."""
        alloc = obj.allocator
        return any(alloc is p for p in self._pools)

    def read_buffer(self, meta: EntryMeta, alloc: Allocate, counters: NixlCounters) -> tuple[MemoryObj, bool] | None:
        """Where a read lands (loop thread): ``alloc``'s buffer when registered, else a staging
        block, else ``alloc``'s buffer through the bounce area; the flag says "registered". None
        when no memory is available (counted in ``counters.no_buffer``). The caller owns the
        returned buffer's reference."""
        try:
            obj = alloc(meta.shape, meta.dtype, meta.fmt)
        except Exception as exc:
            logger.debug("nixl: read allocation failed: %s", exc)
            obj = None
        if obj is not None and self.registered(obj):
            return obj, True
        if self.staging is not None:
            staged = self.staging.allocate(meta.shape, meta.dtype, meta.fmt)
            if staged is not None:
                if obj is not None:
                    obj.ref_count_down()
                return staged, True
        if obj is None:
            counters.no_buffer += 1
            return None
        counters.bounced += 1
        return obj, False

    def write(self, plans: list[WritePlan]) -> Outcomes:
        """Write every planned record; one outcome per plan."""
        layout, agent, chunk, cipher = self.layout, self.agent, self.chunk_bytes, self.cipher

        def write(slot: ScratchSlot, plan: WritePlan) -> None:
            src, registered = plan.obj, plan.registered
            staged: MemoryObj | None = None
            try:
                if not registered and not layout.piecewise and not plan.meta.sealed:
                    staged = self._stage_copy(src)
                    src, registered = staged, True
                with layout.open_write(plan.location, plan.meta, plan.recycle) as loc:
                    write_record(agent, slot, loc, plan.meta, src, registered, chunk, layout.piecewise, cipher=cipher)
            finally:
                # A stuck write only reads its source: the block may go back.
                if staged is not None:
                    staged.ref_count_down()

        return each_with_slot(self.scratch, plans, write)

    def orphan_writes(self, plans: list[WritePlan], outcomes: Outcomes) -> None:
        """The loop being gone: give sources back, delete unconsumed victims."""
        layout = self.layout
        for plan, failure in zip(plans, outcomes, strict=True):
            plan.obj.ref_count_down()
            if failure is not None and isinstance(layout, KeyFileLayout):
                for loc in plan.recycle:
                    with contextlib.suppress(OSError):
                        layout.delete(loc)

    def _stage_copy(self, src: MemoryObj) -> MemoryObj:
        """A registered copy of ``src`` for one-piece writes (object stores)."""
        staged = None
        if self.staging is not None:
            staged = self.staging.allocate(src.shape, src.dtype, src.fmt)
        if staged is None:
            raise NixlTransferError("no registered staging room for an unregistered source")
        staged.tensor.copy_(src.tensor)
        return staged

    def read(self, jobs: list[ReadJob]) -> Outcomes:
        """Read and verify every record; one outcome per job."""
        layout, agent, chunk, cipher = self.layout, self.agent, self.chunk_bytes, self.cipher

        def read(slot: ScratchSlot, job: ReadJob) -> None:
            with layout.open_read(job.entry.location, job.entry.meta) as loc:
                read_record(agent, slot, loc, job.entry.meta, job.dst, job.registered, chunk, cipher=cipher)

        return each_with_slot(self.scratch, jobs, read)

    @staticmethod
    def orphan_reads(jobs: list[ReadJob], outcomes: Outcomes) -> None:
        """The loop being gone: give read buffers back (never a stuck one)."""
        for job, failure in zip(jobs, outcomes, strict=True):
            if isinstance(failure, NixlStuckError):
                park(job.dst)
            else:
                job.dst.ref_count_down()

    def zero(self, slots: list[int]) -> Outcomes:
        """Zero each slot's magic (slot layout only); one outcome per slot."""
        layout = self.layout
        out: Outcomes = []
        for slot in slots:
            try:
                if not isinstance(layout, SlotFileLayout):
                    raise NixlTransferError("slot zeroing needs the slot layout")
                layout.delete(slot)
            except Exception as exc:
                out.append(exc)
            else:
                out.append(None)
        return out


def plan_bytes(plan: WritePlan) -> int:
    """How much a write moves (for the split between workers)."""
    return plan.meta.total_len


def read_bytes(job: ReadJob) -> int:
    """How much a read moves (for the split between workers)."""
    return job.entry.size


def slot_bytes(_slot: int) -> int:
    """A slot invalidation writes a few bytes: they all go in one job."""
    return 0


def no_orphan(_items: list[Any], _outcomes: Outcomes) -> None:
    """Nothing to give back (the loop is gone, and so is the tier's use of the items)."""
