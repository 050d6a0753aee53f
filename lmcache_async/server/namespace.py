"""One namespace of the node cache server: its shared pool, index, grants and leases.

Thread affinity: every method runs on the server's event-loop thread (the allocator's own lock
makes the pool safe to share with the pre-touch thread); nothing here blocks or awaits.

* A **grant** is a pool block handed to one client for writing. It is not in the index: no
  reader can see it until the client commits it under a key. Uncommitted grants are freed when
  their client goes away or their TTL passes.
* A **lease** pins a committed entry's block for one reader (one more reference on the block).
  A leased entry is never evicted; a removed or evicted-while-leased entry's block is freed
  when its last lease ends. Leases end on release, on TTL expiry, or when the client goes away.
* A **hold** pins a committed entry for the whole namespace under a random token: the block
  and metadata stay readable through the token (``lease_held``) after the key was removed or
  evicted, until the hold is dropped (by any client of the namespace) or its TTL passes. Holds
  outlive the connection that took them (they exist for readers in other processes); the
  namespace holds at most ``max_leases`` of them.
* Each client has a cap on leases and on uncommitted grants, so one stuck client cannot pin
  the pool.
* The index is an :class:`~lmcache_async.lru.LruIndex` sized by payload bytes; eviction takes
  the least recently used entry whose block nobody else references.
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lmcache_async.lru import LruIndex
from lmcache_async.memory import MemoryObj
from lmcache_async.server.protocol import COMMIT_FAILED, COMMIT_PRESENT, COMMIT_STORED, EntryMeta
from lmcache_async.server.shm import SharedPool, new_generation

__all__ = ["ClientState", "Lease", "Namespace"]


@dataclass(slots=True)
class Entry:
    """A committed entry: the block (the index's reference) and its metadata."""

    obj: MemoryObj
    meta: EntryMeta


def _held(_key: bytes, entry: Entry) -> bool:
    """Eviction's rule: an entry whose block has a reference beside the index's (a lease, a
    hold, a write-through to a lower tier) is not a victim."""
    return entry.obj.get_ref_count() != 1


@dataclass(slots=True)
class Lease:
    """A reader's pin on one block."""

    obj: MemoryObj
    expires: float


@dataclass(slots=True)
class Grant:
    """A block granted for writing, not yet committed."""

    obj: MemoryObj
    expires: float


@dataclass(slots=True)
class Hold:
    """A namespace-wide pin on one committed entry's block (one reference on the block)."""

    obj: MemoryObj
    meta: EntryMeta
    expires: float


@dataclass
class ClientState:
    """What one connection holds in its namespace; reclaimed by :meth:`Namespace.drop_client`."""

    ident: int
    pid: int = 0
    leases: dict[int, Lease] = field(default_factory=dict)
    grants: dict[int, Grant] = field(default_factory=dict)
    requests: int = 0


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
        reserve_bytes: int | None = None,
        pretouch: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.pool = SharedPool(
            pool_bytes, name=f"ns-{name}", generation=new_generation(), reserve_bytes=reserve_bytes, pretouch=pretouch
        )
        self.lease_ttl_s = lease_ttl_s
        self.max_leases = max_leases
        self.max_grants = max_grants
        self._clock = clock
        self._index: LruIndex[bytes, Entry] = LruIndex()  # sized by payload bytes
        self._ids = itertools.count(1)
        self.clients: dict[int, ClientState] = {}
        self._holds: dict[int, Hold] = {}
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.commits = 0
        self.loaded = 0
        self.refused_grants = 0
        self.refused_leases = 0
        self.expired_leases = 0
        self.expired_grants = 0
        self.reclaimed_leases = 0
        self.reclaimed_grants = 0
        self.holds_taken = 0
        self.refused_holds = 0
        self.expired_holds = 0

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
        st = ClientState(ident, pid)
        self.clients[ident] = st
        return st

    def drop_client(self, st: ClientState) -> None:
        """Reclaim everything a closed connection held: leases end, uncommitted grants are freed."""
        for lease in st.leases.values():
            lease.obj.ref_count_down()
        for grant in st.grants.values():
            grant.obj.ref_count_down()
        self.reclaimed_leases += len(st.leases)
        self.reclaimed_grants += len(st.grants)
        st.leases.clear()
        st.grants.clear()
        self.clients.pop(st.ident, None)

    # ---- presence ----------------------------------------------------------------------------
    def contains(self, keys: list[bytes], touch: bool) -> list[bool]:
        idx = self._index
        if touch:
            return [idx.touch(k) for k in keys]
        return [k in idx for k in keys]

    # ---- reads ---------------------------------------------------------------------------------
    def lease(self, st: ClientState, key: bytes, *, count_miss: bool = True) -> tuple[int, MemoryObj, EntryMeta] | None:
        """Lease the entry of ``key`` for ``st``: (lease id, block, metadata), or None for a miss
        or when the client already holds its cap of leases."""
        entry = self._index.get(key)
        if entry is None:
            self.misses += count_miss
            return None
        if len(st.leases) >= self.max_leases:
            self.refused_leases += 1
            return None
        entry.obj.ref_count_up()
        self._index.touch(key)
        lid = next(self._ids)
        st.leases[lid] = Lease(entry.obj, self._clock() + self.lease_ttl_s)
        self.hits += 1
        return lid, entry.obj, entry.meta

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
        lease.obj.ref_count_down()
        return True

    # ---- holds -------------------------------------------------------------------------------
    def hold(self, key: bytes, ttl_s: float) -> int | None:
        """Pin the entry of ``key`` for ``ttl_s`` seconds: its token (non-zero), or None for a
        miss or when the namespace already holds ``max_leases`` holds."""
        entry = self._index.get(key)
        if entry is None:
            return None
        if len(self._holds) >= self.max_leases:
            self.refused_holds += 1
            return None
        token = secrets.randbits(63) | 1
        while token in self._holds:
            token = secrets.randbits(63) | 1
        entry.obj.ref_count_up()
        self._index.touch(key)
        self._holds[token] = Hold(entry.obj, entry.meta, self._clock() + ttl_s)
        self.holds_taken += 1
        return token

    def unhold(self, token: int) -> bool:
        """Drop one hold; False when there is no such hold (dropped, expired or never taken)."""
        h = self._holds.pop(token, None)
        if h is None:
            return False
        h.obj.ref_count_down()
        return True

    def lease_held(self, st: ClientState, token: int) -> tuple[int, MemoryObj, EntryMeta] | None:
        """Lease the block of hold ``token`` for ``st`` (as :meth:`lease` does for a key): None
        when there is no such hold or the client holds its cap of leases."""
        h = self._holds.get(token)
        if h is None:
            self.misses += 1
            return None
        if len(st.leases) >= self.max_leases:
            self.refused_leases += 1
            return None
        h.obj.ref_count_up()
        lid = next(self._ids)
        st.leases[lid] = Lease(h.obj, self._clock() + self.lease_ttl_s)
        self.hits += 1
        return lid, h.obj, h.meta

    # ---- writes --------------------------------------------------------------------------------
    def grant(self, st: ClientState, nbytes: int) -> tuple[int, MemoryObj] | None:
        """A block of at least ``nbytes`` for ``st`` to write (evicting unheld entries), or None
        when the pool cannot make room or the client holds its cap of grants."""
        if len(st.grants) >= self.max_grants or not self.pool.can_ever_fit(nbytes):
            self.refused_grants += 1
            return None
        obj = self._allocate(nbytes)
        if obj is None:
            self.refused_grants += 1
            return None
        gid = next(self._ids)
        st.grants[gid] = Grant(obj, self._clock() + self.lease_ttl_s)
        return gid, obj

    def _allocate(self, nbytes: int) -> MemoryObj | None:
        pool = self.pool
        obj = pool.allocate((max(nbytes, 1),), torch.uint8)
        if obj is not None:
            return obj
        while (victim := self._index.pop_oldest(_held)) is not None:
            self.evictions += 1
            self._retire(victim[1])
            obj = pool.allocate((max(nbytes, 1),), torch.uint8)
            if obj is not None:
                return obj
        return None

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
        location no longer trusts it), then give the index's reference back."""
        self.pool.retire(entry.obj.offset, entry.meta.nbytes)
        entry.obj.ref_count_down()

    def touch(self, keys: list[bytes]) -> None:
        """Readers that copied these entries from locations they knew: make each present one
        the youngest and count it as a hit."""
        idx = self._index
        for k in keys:
            self.hits += idx.touch(k)

    def clear(self) -> None:
        for key in list(self._index):
            self.remove(key)

    # ---- time ----------------------------------------------------------------------------------
    def expire(self) -> None:
        """End leases and free grants whose TTL passed (one hung client cannot pin the pool)."""
        now = self._clock()
        for st in self.clients.values():
            for lid in [lid for lid, lease in st.leases.items() if lease.expires <= now]:
                st.leases.pop(lid).obj.ref_count_down()
                self.expired_leases += 1
            for gid in [gid for gid, g in st.grants.items() if g.expires <= now]:
                st.grants.pop(gid).obj.ref_count_down()
                self.expired_grants += 1
        for token in [t for t, h in self._holds.items() if h.expires <= now]:
            self._holds.pop(token).obj.ref_count_down()
            self.expired_holds += 1

    def close(self) -> None:
        """Reclaim every client's holdings, drop the index and close the pool's descriptor."""
        for st in list(self.clients.values()):
            self.drop_client(st)
        for h in self._holds.values():
            h.obj.ref_count_down()
        self._holds.clear()
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
            "pool_used_bytes": self.pool.used_bytes,
            "committed_block_bytes": self.committed_block_bytes(),
            "clients": len(self.clients),
            "leases": sum(len(c.leases) for c in self.clients.values()),
            "grants": sum(len(c.grants) for c in self.clients.values()),
            "holds": len(self._holds),
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
            "expired_grants": self.expired_grants,
            "reclaimed_leases": self.reclaimed_leases,
            "reclaimed_grants": self.reclaimed_grants,
        }
