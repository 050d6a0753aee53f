"""Taking entries out of the ``nixl`` tier and releasing their storage.

:class:`NixlRemovals` (a base of :class:`~lmcache_async.nixl.tier.NixlBackend`) keeps the index,
the byte budget and the storage in step on every removal path: eviction to make room (LRU or
FIFO, never an entry being read; the victims' files or slots may be handed to the coming write
job for reuse), drops of removed or damaged entries (storage goes once the last reader is
done), slot zeroing on the worker threads, and record file deletion. Evictions are reported
(EVICTED) here; the callers report the other removals. Event loop only.
"""

from __future__ import annotations

import asyncio
from typing import Any

from lmcache_async.keys import CacheEngineKey
from lmcache_async.nixl.index import Entry, NixlIndex
from lmcache_async.nixl.io import KeyFileLayout, ObjectLayout, SlotFileLayout
from lmcache_async.nixl.jobs import JobKind
from lmcache_async.nixl.resources import NixlResources
from lmcache_async.ratelog import RateLimitedLog
from lmcache_async.tiers import RemovalReason

__all__ = ["NixlRemovals"]


class NixlRemovals(NixlResources):
    """Eviction, drops and storage release (see the module docstring). The attributes below
    are set by the tier's constructor."""

    _index: NixlIndex
    _log: RateLimitedLog
    _zeroing: set[asyncio.Future[None]]
    """Slot-zeroing jobs in flight (a put waits for them rather than evict)."""
    _zeroings: JobKind[int]

    def _make_room(self, size: int, recycle: list[str | int] | None = None) -> bool:
        """Evict unread entries (LRU/FIFO order) until ``size`` more bytes (and, for slots, a
        slot) fit. False when they cannot. With ``recycle``, the victims' files or slots are
        handed over to the coming write job instead of being deleted or invalidated here: it
        reuses one and deletes/invalidates the rest off the event loop."""
        layout = self._layout
        slots = isinstance(layout, SlotFileLayout)
        stuck = layout.stuck if isinstance(layout, SlotFileLayout) else set()
        handover = recycle if isinstance(layout, KeyFileLayout | SlotFileLayout) else None
        index = self._index
        evicted: list[CacheEngineKey] = []
        try:
            while not index.fits(size) or (slots and size and not index.free_slots and not recycle):
                victim = index.oldest_unread()
                if victim is None:
                    return False
                key, entry = victim
                if handover is not None and entry.location not in stuck:  # a stuck slot is never reused
                    if self._forget(key, entry):
                        evicted.append(key)
                    handover.append(entry.location)
                else:
                    self._drop(key, entry, evicted)
                self.counters.evictions += 1
            return True
        finally:  # the victims are out of the index already (also when room cannot be made)
            self.report_removed(evicted, RemovalReason.EVICTED)

    def _forget(self, key: CacheEngineKey, entry: Entry) -> bool:
        """Take ``entry`` out of the index and the budget. True when ``key`` left the tier now
        (a removal to report): False when ``entry`` was removed already, or ``key`` is still
        held by another entry."""
        return self._index.discard(key, entry) and key not in self._index

    def _drop(
        self, key: CacheEngineKey, entry: Entry, gone: list[CacheEngineKey] | None = None
    ) -> asyncio.Future[Any] | None:
        """Remove ``key`` from the index and account its bytes; storage goes once unread.
        Returns what finishes the storage's removal when it started now, else None. With
        ``gone``, ``key`` is appended when it left the tier now (the caller reports it)."""
        if entry.removed:
            return None
        if self._forget(key, entry) and gone is not None:
            gone.append(key)
        if entry.readers == 0:
            return self._release_location(entry.location)
        return None

    def _release_location(self, location: str | int) -> asyncio.Future[Any] | None:
        """Delete what ``location`` holds and make it reusable: a file is deleted, a slot is
        zeroed on a worker thread and freed once that is done (a slot a stuck request may
        still use is never reused). Returns the future of that work (None: nothing to do);
        it never raises (failures are logged)."""
        if isinstance(self._layout, SlotFileLayout):
            # An 8-byte write into a page under writeback can wait for the disk: a zero job.
            done = self._enqueue(self._zeroings, [int(location)])
            if done not in self._zeroing:
                self._zeroing.add(done)
                done.add_done_callback(self._zeroing.discard)
            return done
        return self._discard_storage(location)

    def _finish_zeroing(self, slots: list[int], outcomes: list[BaseException | None]) -> None:
        """On the loop: free the zeroed slots (one that could not be zeroed is not reused)."""
        layout = self._layout
        for slot, failure in zip(slots, outcomes, strict=True):
            if failure is not None:
                self._log.warning("nixl: invalidating slot %s failed: %s", slot, failure)
            elif isinstance(layout, SlotFileLayout) and slot not in layout.stuck:
                self._index.free_slots.append(slot)

    def _discard_storage(self, location: str | int) -> asyncio.Future[Any] | None:
        """Delete a record file on a worker thread (a slot: invalidate it here). Returns the
        deletion's task, None when nothing is left to wait for."""
        layout = self._layout
        if layout is None or isinstance(layout, ObjectLayout):
            return None
        if isinstance(layout, SlotFileLayout):
            try:
                layout.delete(location)  # an 8-byte pwrite on an open fd
            except OSError as exc:
                self._log.warning("nixl: invalidating slot %s failed: %s", location, exc)
            return None
        task = asyncio.get_running_loop().create_task(self._unlink(layout, location))
        self._track(task)
        return task

    async def _unlink(self, layout: KeyFileLayout, location: str | int) -> None:
        try:
            await self._run(layout.delete, location)
        except Exception as exc:
            self._log.warning("nixl: deleting %s failed: %s", location, exc)

    def _reader_done(self, entry: Entry) -> None:
        if self._index.end_read(entry):
            self._release_location(entry.location)
