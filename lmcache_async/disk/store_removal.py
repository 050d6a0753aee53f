"""Removal and eviction in the disk store: deleting entry files and keeping the budget.

:class:`StoreRemoval` (a base of :class:`~lmcache_async.disk.store.DiskStore`) deletes entry
files under the directory lock and keeps the shared accounting right: LRU eviction until a
write fits the budget (falling back to file mtimes for entries this process has not indexed),
deletion of damaged records, ``remove``/``clear``, and the repair of shards whose files were
deleted behind the tier's back (:class:`~lmcache_async.disk.budget.Repairs`). Every entry it
drops on its own is reported to :attr:`~lmcache_async.disk.store_state.StoreState.on_removed`.
Blocking; executor threads only.
"""

from __future__ import annotations

import os

from lmcache_async.disk.budget import Ledger, Repairs, ShardListing, list_shard
from lmcache_async.disk.layout import NUM_SHARDS, entry_key
from lmcache_async.disk.store_state import StoreState
from lmcache_async.tiers import RemovalReason

__all__ = ["StoreRemoval"]


class StoreRemoval(StoreState):
    """Entry deletion, eviction and accounting repair (see the module docstring)."""

    # ---- removal primitives (directory lock held) ----------------------------------------------
    def _unlink_entry(
        self,
        led: Ledger,
        digest: bytes,
        expect_ino: int | None = None,
        *,
        repairs: Repairs | None = None,
    ) -> int | None:
        """Delete the entry file of ``digest`` (only if it is inode ``expect_ino`` when given);
        bytes freed, or None when nothing was deleted. The accounting follows.

        ``repairs``: the caller knew the file (an indexed entry). If it is already gone, it was
        deleted behind the tier's back (or by another process) and the accounting may still
        count it: its shard is recounted (see :class:`Repairs`).
        """
        path = self._path(digest)
        missing = False

        def fn() -> tuple[int, int]:
            nonlocal missing
            try:
                st = os.stat(path, follow_symlinks=False)
            except FileNotFoundError:
                missing = True
                return 0, 0
            if expect_ino is not None and st.st_ino != expect_ino:
                return 0, 0  # replaced by a fresh record since the caller looked
            try:
                os.unlink(path)
            except FileNotFoundError:
                missing = True
                return 0, 0
            return -st.st_size, -1

        db, df = led.change(digest[0], fn)
        self._note_removed(digest)
        if df:
            return -db
        if missing and repairs is not None:
            repairs.shard(led, digest[0])
        return None

    def _pop_victim(self, exclude: bytes | None) -> tuple[bytes, str | None] | None:
        with self._ilock:
            return self._index.pop_oldest(None if exclude is None else lambda d, _kstr: d == exclude)

    def _evict_unindexed(
        self, led: Ledger, need: int, exclude: bytes | None, repairs: Repairs, evicted: list[str]
    ) -> bool:
        """Evict files this process has not indexed (oldest mtime first, shard by shard) until
        ``need`` more bytes fit in the budget, appending the key each record header names to
        ``evicted``. A shard whose accounting claims more bytes than its files hold (files
        deleted behind the tier's back) is recounted instead of paying for the missing bytes
        with real entries. True when anything was evicted or recounted."""
        budget = self.budget_bytes
        progress = False
        for _ in range(NUM_SHARDS):
            if led.total_bytes + need <= budget:
                break
            shard = self._evict_cursor
            self._evict_cursor = (shard + 1) % NUM_SHARDS
            listing = list_shard(self.root, shard)
            if sum(e.size for e in listing.entries) < led.shard(shard)[0]:
                fresh = repairs.shard(led, shard)
                if fresh is not None:
                    listing = fresh
                    progress = True
                    if led.total_bytes + need <= budget:
                        break
            for e in sorted(listing.entries, key=lambda e: e.mtime_ns):
                if led.total_bytes + need <= budget:
                    return True
                if e.digest == exclude:
                    continue
                kstr = entry_key(self.root, e.digest)
                if self._unlink_entry(led, e.digest, e.ino) is not None:
                    self.count("evictions")
                    progress = True
                    if kstr is not None:
                        evicted.append(kstr)
        return progress

    def _make_room(self, led: Ledger, need: int, exclude: bytes | None) -> bool:
        """Evict (LRU) until ``need`` more bytes fit in the budget; False when they cannot.

        Self-repairing (:class:`Repairs`): an indexed victim whose file is already gone has its
        shard recounted, and when nothing at all can be evicted while the accounting says the
        directory is over budget, every shard is recounted once before giving up (files deleted
        behind the tier's back must not refuse writes until the next start)."""
        budget = self.budget_bytes
        if need > budget:
            return False
        repairs = Repairs()
        evicted: list[str] = []
        vanished: list[str] = []
        try:
            while led.total_bytes + need > budget:
                victim = self._pop_victim(exclude)
                if victim is None:
                    if self._evict_unindexed(led, need, exclude, repairs, evicted) or repairs.everything(led):
                        continue
                    return False
                digest, kstr = victim
                if kstr is None:  # found by the scan: its record header names it
                    kstr = entry_key(self.root, digest)
                if self._unlink_entry(led, digest, repairs=repairs) is not None:
                    self.count("evictions")
                    if kstr is not None:
                        evicted.append(kstr)
                elif kstr is not None:  # its file was already gone
                    vanished.append(kstr)
            return True
        finally:
            self._report(evicted, RemovalReason.EVICTED)
            self._report(vanished, RemovalReason.DELETED)

    def _discard_corrupt(self, digest: bytes, ino: int, why: str, kstr: str | None = None) -> None:
        """Count and delete a damaged file (unless a fresh record replaced it meanwhile); the
        key ``kstr`` (when known) is reported DAMAGED unless a fresh record replaced it."""
        self.count("corrupt")
        self.warn("corrupt", "disk tier: %s is damaged (%s); deleted", self._path(digest), why)
        try:
            with self._budget.locked() as led:
                self._unlink_entry(led, digest, ino)
                led.recount(digest[0])  # its size may have changed behind the accounting
        except OSError as exc:  # read-only filesystem: it stays, and stays a miss
            self._note_removed(digest)
            self.warn("corrupt-rm", "disk tier: cannot delete a damaged file: %s", exc)
        if kstr is not None and not _replaced(self._path(digest), ino):
            self._report([kstr], RemovalReason.DAMAGED)

    def forget_vanished(self, digest: bytes, kstr: str | None = None) -> bool:
        """A lookup found no file for ``digest`` (the entry of ``kstr``, when the caller knows
        it): drop its index entry (any thread, no I/O).

        True when it was indexed (counted as ``vanished``, its key reported DELETED): the file
        was deleted behind the tier's back and the accounting may still count it, so the caller
        has its shard recounted (:meth:`repair_shard`)."""
        with self._ilock:
            known = digest in self._index
            if known:
                kstr = self._index.pop(digest) or kstr
                if self._scan_removed is not None:
                    self._scan_removed.add(digest)
        if known:
            self.count("vanished")
            self._report([kstr] if kstr is not None else [], RemovalReason.DELETED)
        return known

    def repair_shard(self, shard: int) -> None:
        """Recount ``shard`` (all of them when it counted bytes of missing files; see
        :class:`Repairs`) under the directory lock. Blocking; failures are ignored (the next
        holder of the lock, or the next start, repairs it)."""
        try:
            with self._budget.locked() as led:
                Repairs().shard(led, shard)
        except OSError:
            pass

    def _vanished(self, digest: bytes, kstr: str) -> None:
        """A file the index knew is gone: forget it and repair the shard's accounting."""
        if self.forget_vanished(digest, kstr):
            self.repair_shard(digest[0])

    def remove(self, digest: bytes) -> bool:
        """Delete the entry; True when a file was deleted. An indexed entry whose file is gone
        has its shard recounted (it was deleted behind the tier's back)."""
        repairs = Repairs() if digest in self._index else None
        with self._budget.locked() as led:
            return self._unlink_entry(led, digest, repairs=repairs) is not None

    def clear(self) -> None:
        for shard in range(NUM_SHARDS):
            with self._budget.locked() as led:
                listing = list_shard(self.root, shard)
                if listing.entries or led.shard(shard) != (0, 0):
                    kstrs = self._keys_of(listing) if self.on_removed is not None else []
                    led.delete_listed(listing)
                    self._report(kstrs, RemovalReason.DELETED)
        with self._ilock:
            self._index.clear()
            if self._scan_removed is not None:
                self._scan_removed = set()
                self._scan_cleared = True

    def _keys_of(self, listing: ShardListing) -> list[str]:
        """The key strings of the entries in ``listing`` (from the index, else from each record
        header; entries whose key cannot be read are left out)."""
        with self._ilock:
            known = [self._index.get(e.digest) for e in listing.entries]
        out = []
        for e, kstr in zip(listing.entries, known, strict=True):
            kstr = kstr if kstr is not None else entry_key(self.root, e.digest)
            if kstr is not None:
                out.append(kstr)
        return out

    def evict_to_budget(self) -> None:
        with self._budget.locked() as led:
            self._make_room(led, 0, None)


def _replaced(path: str, ino: int) -> bool:
    """True when ``path`` now holds another file than inode ``ino`` (a fresh record)."""
    try:
        return os.stat(path, follow_symlinks=False).st_ino != ino
    except OSError:
        return False
