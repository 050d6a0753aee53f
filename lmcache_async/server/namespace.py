"""One namespace of the node cache server: its shared pool, index, grants and leases.

Thread affinity: every method runs on the server's event-loop thread (the allocator's own lock
makes the pool safe to share with the thread that grows it); nothing here blocks or awaits.

* A **grant** is a pool block handed to one client for writing. It is not in the index: no
  reader can see it until the client commits it under a key. A granted block goes back to the
  pool only when its writer can no longer write into it: it committed or returned the grant,
  its connection was closed by its own side (the client closes between calls, never during a
  copy; a killed process's socket closes after its memory is gone), or the server closed the
  connection and the process has exited (watched with a pidfd; until then the block is
  *quarantined*). A grant past its TTL is only counted (``overdue_grants``): a stalled writer of
  any length keeps its block, so its late copy can never land in another key's entry. The
  per-client grant cap bounds what a stalled writer pins.
* A **lease** pins a committed entry's block for one reader (one more reference on the block).
  A leased entry is never evicted; a removed or evicted-while-leased entry's block is freed
  when its last lease ends. Leases end on release, on TTL expiry, or when the client goes away.
  A reader checks after copying that its lease still held (the TTL had not passed by its clock,
  which the server's expiry never precedes, and the server had not closed the connection), so a
  lease that ended under a stalled reader costs it a miss, never wrong bytes.
* A **hold** pins a committed entry for the whole namespace under a random token: the block
  and metadata stay readable through the token (``lease_held``) after the key was removed or
  evicted, until the hold is dropped (by any client of the namespace) or its TTL passes. Holds
  outlive the connection that took them (they exist for readers in other processes).
* **Caps**, so one client cannot take every slot: per client process (all of its connections
  together, told apart by the pid ``SO_PEERCRED`` gives), leases (``max_leases``), holds
  (``max_client_holds``), the block bytes its leases pin (``max_pinned_fraction`` of the pool)
  and those its holds pin (half of that); per connection, uncommitted grants (``max_grants``); per namespace,
  leases (``max_namespace_leases``), holds (``max_holds``) and the bytes of the distinct blocks
  holds pin (``max_pinned_fraction`` of the pool).
* The index is an :class:`~lmcache_async.lru.LruIndex` sized by payload bytes; eviction takes
  the least recently used entry whose block nobody else references, and only after checking
  that evicting every such entry would make room (a put that cannot fit evicts nothing).
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections.abc import Callable
from typing import Any

import torch

from lmcache_async.lru import LruIndex
from lmcache_async.memory import MemoryObj
from lmcache_async.server.namespace_records import (
    ClientState,
    Entry,
    EntryListener,
    Grant,
    Hold,
    Lease,
    ProcessShare,
    pinned_elsewhere,
)
from lmcache_async.server.protocol import COMMIT_FAILED, COMMIT_PRESENT, COMMIT_STORED, EntryMeta
from lmcache_async.server.quarantine import Quarantine, discard, quarantine, sweep
from lmcache_async.server.shm import SharedPool, new_generation

__all__ = ["ClientState", "EntryListener", "Lease", "Namespace"]


class Namespace:
    """Index, LRU eviction, grants and leases over one :class:`SharedPool`."""

    def __init__(
        self,
        name: str,
        pool_bytes: int,
        *,
        lease_ttl_s: float,
        max_leases: int,
        max_grants: int,
        max_holds: int = 4096,
        max_client_holds: int = 1024,
        max_namespace_leases: int = 16384,
        max_pinned_fraction: float = 0.5,
        reserve_bytes: int | None = None,
        pretouch: bool = True,
        committed_bytes: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        listener: EntryListener | None = None,
    ) -> None:
        """``committed_bytes``: the pool's memory committed at once (None: all of it; see
        :class:`SharedPool`; the server passes 0 and grows it with its ``PoolGrowth``);
        ``listener``: told when described entries come and go (None: nobody)."""
        self.name = name
        self._listener = listener
        self.pool = SharedPool(
            pool_bytes,
            name=f"ns-{name}",
            generation=new_generation(),
            reserve_bytes=reserve_bytes,
            pretouch=pretouch,
            committed_bytes=committed_bytes,
        )
        self.lease_ttl_s = lease_ttl_s
        self.max_leases = max_leases
        self.max_grants = max_grants
        self.max_holds = max_holds
        self.max_client_holds = max_client_holds
        self.max_namespace_leases = max_namespace_leases
        #: Block bytes one client's leases, and all holds together, may pin.
        self.max_pinned_bytes = int(self.pool.capacity * max_pinned_fraction)
        self._clock = clock
        self._index: LruIndex[bytes, Entry] = LruIndex()  # sized by payload bytes
        self._ids = itertools.count(1)
        self.clients: dict[int, ClientState] = {}
        self._holds: dict[int, Hold] = {}
        #: What each client process holds, by pid (-ident when the kernel could not tell).
        self._shares: dict[int, ProcessShare] = {}
        self._held_bytes = 0  # bytes of the distinct blocks holds pin
        self._held_blocks: dict[int, int] = {}  # block offset -> holds on it
        self._leases = 0  # leases of every client
        self._quarantine: list[Quarantine] = []
        #: Since when the namespace has had no client (monotonic; None while it has one).
        self.idle_since: float | None = clock()
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.commits = 0
        self.loaded = 0
        self.refused_grants = 0
        self.refused_leases = 0
        self.expired_leases = 0
        self.reclaimed_leases = 0
        self.reclaimed_grants = 0
        self.holds_taken = 0
        self.refused_holds = 0
        self.expired_holds = 0
        self.overdue_grants = 0
        self.quarantined_grants = 0
        self.refused_evictions = 0

    @property
    def generation(self) -> int:
        return self.pool.generation

    @property
    def payload_bytes(self) -> int:
        """Payload bytes of the committed entries (without block alignment)."""
        return self._index.bytes

    def __len__(self) -> int:
        return len(self._index)

    # ---- clients ----------------------------------------------------------------------------
    def add_client(self, ident: int, pid: int = 0) -> ClientState:
        key = pid if pid > 0 else -ident
        share = self._shares.setdefault(key, ProcessShare(key))
        share.conns += 1
        st = ClientState(ident, pid, share=share)
        self.clients[ident] = st
        self.idle_since = None
        return st

    def drop_client(self, st: ClientState, *, writer_gone: bool = True) -> None:
        """Reclaim everything a closed connection held: leases end; uncommitted grants are
        freed when ``writer_gone`` (the client closed its side, so no copy of its runs), else
        quarantined until its process exits (the server closed a connection whose process may
        still be copying into them)."""
        for lease in st.leases.values():
            lease.obj.ref_count_down()
        self._leases -= len(st.leases)
        st.share.leases -= len(st.leases)
        st.share.pinned -= sum(lease.obj.size for lease in st.leases.values())
        st.share.conns -= 1
        self._forget_share(st.share)
        self.reclaimed_leases += len(st.leases)
        self.reclaimed_grants += len(st.grants)
        blocks = [g.obj for g in st.grants.values()]
        st.leases.clear()
        st.grants.clear()
        if blocks and not writer_gone:
            self._quarantine_blocks(st.pid, blocks)
        else:
            for obj in blocks:
                obj.ref_count_down()
        self.clients.pop(st.ident, None)
        if not self.clients:
            self.idle_since = self._clock()

    def _quarantine_blocks(self, pid: int, blocks: list[MemoryObj]) -> None:
        """Park ``blocks`` until process ``pid`` exits (see :mod:`.quarantine`)."""
        q = quarantine(pid, blocks)
        if q is not None:
            self.quarantined_grants += len(blocks)
            self._quarantine.append(q)

    def reclaimable(self, idle_s: float) -> bool:
        """True when nobody has used this namespace for ``idle_s`` seconds: no client (since
        then) and no hold; its pool may be released."""
        if self.clients or self._holds or self.idle_since is None:
            return False
        return self._clock() - self.idle_since >= idle_s

    # ---- presence ----------------------------------------------------------------------------
    def contains(self, keys: list[bytes], touch: bool) -> list[bool]:
        idx = self._index
        if touch:
            return [idx.touch(k) for k in keys]
        return [k in idx for k in keys]

    def _forget_share(self, share: ProcessShare) -> None:
        """Drop a process's record once it has no connection and no hold left."""
        if not share.conns and not share.holds and self._shares.get(share.key) is share:
            del self._shares[share.key]

    # ---- reads ---------------------------------------------------------------------------------
    def _may_lease(self, st: ClientState, obj: MemoryObj) -> bool:
        """The lease caps: per client (count and pinned bytes) and per namespace (count)."""
        if (
            st.share.leases >= self.max_leases
            or self._leases >= self.max_namespace_leases
            or (st.share.pinned and st.share.pinned + obj.size > self.max_pinned_bytes)  # one lease always fits
        ):
            self.refused_leases += 1
            return False
        return True

    def _add_lease(self, st: ClientState, obj: MemoryObj) -> int:
        obj.ref_count_up()
        lid = next(self._ids)
        st.leases[lid] = Lease(obj, self._clock() + self.lease_ttl_s)
        st.share.leases += 1
        st.share.pinned += obj.size
        self._leases += 1
        self.hits += 1
        return lid

    def lease(self, st: ClientState, key: bytes, *, count_miss: bool = True) -> tuple[int, MemoryObj, EntryMeta] | None:
        """Lease the entry of ``key`` for ``st``: (lease id, block, metadata), or None for a miss
        or when a lease cap is reached (counted in ``refused_leases``)."""
        entry = self._index.get(key)
        if entry is None:
            self.misses += count_miss
            return None
        if not self._may_lease(st, entry.obj):
            return None
        self._index.touch(key)
        return self._add_lease(st, entry.obj), entry.obj, entry.meta

    def locate(self, key: bytes, *, count_miss: bool = True) -> tuple[int, int, EntryMeta] | None:
        """Where the entry of ``key`` lies, unleased: (version of its bytes, block offset,
        metadata), or None for a miss. The entry may leave the index as soon as the caller
        yields; a reader checks the version after copying (:mod:`lmcache_async.server.shm`)."""
        entry = self._index.lookup(key)
        if entry is None:
            self.misses += count_miss
            return None
        self.hits += 1
        offset = entry.obj.offset
        return self.pool.version(offset, entry.meta.nbytes), offset, entry.meta

    def release(self, st: ClientState, lease_id: int) -> bool:
        """End one lease; False when ``st`` holds no such lease (expired or never granted)."""
        lease = st.leases.pop(lease_id, None)
        if lease is None:
            return False
        self._end_lease(st, lease)
        return True

    def _end_lease(self, st: ClientState, lease: Lease) -> None:
        st.share.leases -= 1
        st.share.pinned -= lease.obj.size
        self._leases -= 1
        lease.obj.ref_count_down()

    # ---- holds -------------------------------------------------------------------------------
    def hold(self, key: bytes, ttl_s: float, st: ClientState | None = None) -> int | None:
        """Pin the entry of ``key`` for ``ttl_s`` seconds on behalf of ``st``: its token
        (non-zero), or None for a miss or when a hold cap is reached (``refused_holds``): the
        namespace's count, or the bytes of the distinct blocks all holds pin (``max_pinned_bytes``),
        or the client's count, or the block bytes its holds pin (half the namespace's bytes, so
        one client never takes every slot). A first hold always fits the byte caps."""
        entry = self._index.get(key)
        if entry is None:
            return None
        size = entry.obj.size
        new_block = entry.obj.offset not in self._held_blocks
        if (
            len(self._holds) >= self.max_holds
            or (new_block and self._held_bytes and self._held_bytes + size > self.max_pinned_bytes)
            or (st is not None and st.share.holds >= self.max_client_holds)
            or (st is not None and st.share.held and st.share.held + size > self.max_pinned_bytes // 2)
        ):
            self.refused_holds += 1
            return None
        token = secrets.randbits(63) | 1
        while token in self._holds:
            token = secrets.randbits(63) | 1
        entry.obj.ref_count_up()
        self._index.touch(key)
        share = st.share if st is not None else None
        if share is not None:
            share.holds += 1
            share.held += size
        self._holds[token] = Hold(entry.obj, entry.meta, self._clock() + ttl_s, share)
        self._held_blocks[entry.obj.offset] = self._held_blocks.get(entry.obj.offset, 0) + 1
        self._held_bytes += size if new_block else 0
        self.holds_taken += 1
        return token

    def unhold(self, token: int) -> bool:
        """Drop one hold; False when there is no such hold (dropped, expired or never taken)."""
        h = self._holds.pop(token, None)
        if h is None:
            return False
        self._end_hold(h)
        return True

    def _end_hold(self, h: Hold) -> None:
        off = h.obj.offset
        left = self._held_blocks[off] - 1
        if left:
            self._held_blocks[off] = left
        else:
            del self._held_blocks[off]
            self._held_bytes -= h.obj.size
        if h.share is not None:
            h.share.holds -= 1
            h.share.held -= h.obj.size
            self._forget_share(h.share)
        h.obj.ref_count_down()

    def lease_held(self, st: ClientState, token: int) -> tuple[int, MemoryObj, EntryMeta] | None:
        """Lease the block of hold ``token`` for ``st`` (as :meth:`lease` does for a key): None
        when there is no such hold or a lease cap is reached."""
        h = self._holds.get(token)
        if h is None:
            self.misses += 1
            return None
        if not self._may_lease(st, h.obj):
            return None
        return self._add_lease(st, h.obj), h.obj, h.meta

    # ---- writes --------------------------------------------------------------------------------
    def grant(self, st: ClientState, nbytes: int, *, count_refusal: bool = True) -> tuple[int, MemoryObj] | None:
        """A block of at least ``nbytes`` for ``st`` to write (evicting unheld entries once the
        pool cannot grow), or None when the pool cannot make room or the client holds its cap of
        grants (counted in ``refused_grants`` unless ``count_refusal`` is False: the caller
        waits for the pool to grow and asks again)."""
        if len(st.grants) >= self.max_grants or not self.pool.can_ever_fit(nbytes):
            self.refused_grants += 1
            return None
        obj = self._allocate(nbytes)
        if obj is None:
            self.refused_grants += count_refusal
            return None
        gid = next(self._ids)
        st.grants[gid] = Grant(obj, self._clock() + self.lease_ttl_s)
        return gid, obj

    def _allocate(self, nbytes: int) -> MemoryObj | None:
        """A block of at least ``nbytes``; LRU entries nobody else references are evicted for it
        only when the pool cannot grow (all of it committed, or a step refused for lack of
        memory) and evicting all of them would make room."""
        pool = self.pool
        obj = pool.allocate((max(nbytes, 1),), torch.uint8)
        if obj is None and not pool.can_grow and self._could_fit(nbytes):
            while (victim := self._index.pop_oldest(pinned_elsewhere)) is not None:
                self.evictions += 1
                self._retire(victim[1])
                obj = pool.allocate((max(nbytes, 1),), torch.uint8)
                if obj is not None:
                    break
        return obj

    def _pinned_blocks(self) -> dict[int, int]:
        """Offset -> size of every block eviction cannot free: grants, leased and held blocks,
        quarantined grants."""
        out: dict[int, int] = {}
        for st in self.clients.values():
            for g in st.grants.values():
                out[g.obj.offset] = g.obj.size
            for lease in st.leases.values():
                out[lease.obj.offset] = lease.obj.size
        for h in self._holds.values():
            out[h.obj.offset] = h.obj.size
        for q in self._quarantine:
            for obj in q.blocks:
                out[obj.offset] = obj.size
        return out

    def _could_fit(self, nbytes: int) -> bool:
        """Whether a free run of ``nbytes`` (block-aligned) appears once every evictable entry
        is gone: the longest gap between the blocks eviction cannot free. Counted in
        ``refused_evictions`` when not."""
        align = self.pool.align
        need = max(1, -(-nbytes // align)) * align
        capacity = self.pool.committed
        pinned = self._pinned_blocks()
        if need * (len(pinned) + 1) <= capacity - sum(pinned.values()):
            return True  # pinned blocks cut the pool into at most len+1 runs: the longest is long enough
        pos = longest = 0
        for off in sorted(pinned):
            longest = max(longest, off - pos)
            pos = max(pos, off + pinned[off])
        if max(longest, capacity - pos) >= need:
            return True
        self.refused_evictions += 1
        return False

    def allocate_block(self, nbytes: int) -> MemoryObj | None:
        """A block for an entry loaded from a lower tier (evicting unheld entries), or None."""
        return self._allocate(nbytes)

    def insert(self, key: bytes, obj: MemoryObj, meta: EntryMeta) -> bool:
        """Index a filled block under ``key`` (its reference becomes the index's); False, and
        nothing changed, when ``key`` is already present (the caller keeps its reference)."""
        if key in self._index:
            return False
        self._index.put(key, Entry(obj, meta), meta.nbytes)
        return True

    def entry_view(self, key: bytes) -> tuple[MemoryObj, EntryMeta] | None:
        """The block and metadata of a committed entry (no reference taken; loop thread only)."""
        e = self._index.get(key)
        return None if e is None else (e.obj, e.meta)

    def ungrant(self, st: ClientState, grant_id: int) -> bool:
        grant = st.grants.pop(grant_id, None)
        if grant is None:
            return False
        grant.obj.ref_count_down()
        return True

    def grant_size(self, st: ClientState, grant_id: int) -> int | None:
        grant = st.grants.get(grant_id)
        return None if grant is None else grant.obj.size

    def commit(self, st: ClientState, grant_id: int, key: bytes, meta: EntryMeta) -> int:
        """Publish a granted block under ``key`` (the grant is consumed either way).

        COMMIT_STORED: now visible; COMMIT_PRESENT: the key was already present (entries are
        content-addressed; the block is freed); COMMIT_FAILED: unknown grant or payload larger
        than the block. The caller has validated ``key``'s grammar and ``meta``.
        """
        grant = st.grants.pop(grant_id, None)
        if grant is None:
            return COMMIT_FAILED
        if meta.nbytes > grant.obj.size:
            grant.obj.ref_count_down()
            return COMMIT_FAILED
        if self._index.touch(key):
            grant.obj.ref_count_down()
            return COMMIT_PRESENT
        self._index.put(key, Entry(grant.obj, meta), meta.nbytes)
        self.commits += 1
        return COMMIT_STORED

    def remove(self, key: bytes) -> bool:
        """Drop ``key`` from the index; a leased block is freed when its last lease ends."""
        entry = self._index.pop(key)
        if entry is None:
            return False
        self._retire(entry)
        return True

    def _retire(self, entry: Entry) -> None:
        """An entry just left the index: move its version counters (a reader holding its
        location no longer trusts it), give the index's reference back, tell the listener."""
        self.pool.retire(entry.obj.offset, entry.meta.nbytes)
        entry.obj.ref_count_down()
        if entry.chunk is not None and self._listener is not None:
            self._listener.entry_gone(entry.chunk)

    def describe(self, key: bytes, chunk: Any) -> bool:
        """Record what the committed entry of ``key`` holds (and tell the listener); False when
        there is no such entry. A description replaces an earlier one (the listener hears the old
        one go first). No recency change."""
        entry = self._index.lookup(key, touch=False)
        if entry is None:
            return False
        if entry.chunk == chunk:
            return True
        old, entry.chunk = entry.chunk, chunk
        if self._listener is not None:
            if old is not None:
                self._listener.entry_gone(old)
            self._listener.entry_described(chunk)
        return True

    def touch(self, keys: list[bytes]) -> None:
        """Readers that copied these entries from locations they knew: make each present one
        the youngest and count it as a hit."""
        idx = self._index
        for k in keys:
            self.hits += idx.touch(k)

    def list_page(
        self, after: bytes, prefix: bytes, limit: int
    ) -> tuple[list[tuple[bytes, int, EntryMeta, bool]], bool]:
        """Up to ``limit`` entries whose keys start with ``prefix`` and sort after ``after``, in
        key order: (key, block size, metadata, pinned by a lease or hold), and whether more
        follow. One pass over the index (no recency change, nothing counted)."""
        import heapq

        keys = (k for k in self._index if k > after and k.startswith(prefix))
        page = heapq.nsmallest(limit + 1, keys)
        out = []
        for k in page[:limit]:
            e = self._index.lookup(k, touch=False)
            if e is not None:
                out.append((k, e.obj.size, e.meta, e.obj.get_ref_count() != 1))
        return out, len(page) > limit

    def clear(self) -> None:
        for key in list(self._index):
            self.remove(key)

    # ---- time ----------------------------------------------------------------------------------
    def expire(self) -> None:
        """End leases and holds whose TTL passed, count grants past theirs (a grant's block is
        never taken from a writer that may still copy into it), and free quarantined blocks of
        processes that exited."""
        now = self._clock()
        for st in self.clients.values():
            for lid in [lid for lid, lease in st.leases.items() if lease.expires <= now]:
                self._end_lease(st, st.leases.pop(lid))
                self.expired_leases += 1
            for g in st.grants.values():
                if not g.overdue and g.expires <= now:
                    g.overdue = True
                    self.overdue_grants += 1
        for token in [t for t, h in self._holds.items() if h.expires <= now]:
            self._end_hold(self._holds.pop(token))
            self.expired_holds += 1
        if self._quarantine:
            self._quarantine = sweep(self._quarantine)

    def close(self) -> None:
        """Reclaim every client's holdings, drop the index and close the pool's descriptor (the
        pool is never handed out again, so quarantined blocks go too)."""
        for st in list(self.clients.values()):
            self.drop_client(st)
        for h in self._holds.values():
            self._end_hold(h)
        self._holds.clear()
        for q in self._quarantine:
            discard(q)
        self._quarantine.clear()
        self.clear()
        self.pool.close()

    # ---- figures -------------------------------------------------------------------------------
    def committed_block_bytes(self) -> int:
        """Pool bytes held by committed entries (block sizes, alignment included)."""
        return sum(e.obj.size for e in self._index.values())

    def stats(self) -> dict[str, Any]:
        lookups = self.hits + self.misses
        return {
            "generation": self.generation,
            "entries": len(self._index),
            "bytes": self.payload_bytes,
            "pool_capacity_bytes": self.pool.capacity,
            "pool_committed_bytes": self.pool.committed,
            "pool_grow_refused": self.pool.grow_refused,
            "pool_used_bytes": self.pool.used_bytes,
            "committed_block_bytes": self.committed_block_bytes(),
            "clients": len(self.clients),
            "leases": self._leases,
            "grants": sum(len(c.grants) for c in self.clients.values()),
            "quarantined_blocks": sum(len(q.blocks) for q in self._quarantine),
            "holds": len(self._holds),
            "held_bytes": self._held_bytes,
            "holds_taken": self.holds_taken,
            "refused_holds": self.refused_holds,
            "expired_holds": self.expired_holds,
            "hits": self.hits,
            "misses": self.misses,
            "hit_rate": (self.hits / lookups) if lookups else 0.0,
            "commits": self.commits,
            "loaded_from_lower_tiers": self.loaded,
            "evictions": self.evictions,
            "refused_grants": self.refused_grants,
            "refused_leases": self.refused_leases,
            "expired_leases": self.expired_leases,
            "overdue_grants": self.overdue_grants,
            "quarantined_grants": self.quarantined_grants,
            "refused_evictions": self.refused_evictions,
            "reclaimed_leases": self.reclaimed_leases,
            "reclaimed_grants": self.reclaimed_grants,
        }
