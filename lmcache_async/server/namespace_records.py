"""The records one namespace of the node cache server keeps, and who hears about its entries.

One job: the plain data of :class:`~lmcache_async.server.namespace.Namespace` — a committed
:class:`Entry`, a reader's :class:`Lease`, a writer's :class:`Grant`, a namespace-wide
:class:`Hold`, what one connection holds (:class:`ClientState`) and what all connections of one
process hold together (:class:`ProcessShare`) — plus the
:class:`EntryListener` protocol and eviction's rule (:func:`pinned_elsewhere`). No behaviour
beyond that: the namespace owns every invariant between them. Loop thread only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from lmcache_async.memory import MemoryObj
from lmcache_async.server.protocol import EntryMeta

__all__ = [
    "ClientState",
    "Entry",
    "EntryListener",
    "Grant",
    "Hold",
    "Lease",
    "ProcessShare",
    "pinned_elsewhere",
]


class EntryListener(Protocol):
    """Who hears which described entries a namespace holds (the server's KV events). Called on
    the loop thread, synchronously; must not call back into the namespace."""

    def entry_described(self, chunk: Any) -> None:
        """A committed entry now says what it holds (``chunk``, as given to :meth:`Namespace.describe`)."""

    def entry_gone(self, chunk: Any) -> None:
        """A described entry left the index (removed, evicted, cleared, the namespace closed)."""


@dataclass(slots=True)
class Entry:
    """A committed entry: the block (the index's reference), its metadata and, once described,
    what it holds in vLLM's terms (``chunk``; None until then)."""

    obj: MemoryObj
    meta: EntryMeta
    chunk: Any = None


def pinned_elsewhere(_key: bytes, entry: Entry) -> bool:
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
    """A block granted for writing, not yet committed (``overdue``: its TTL passed; counted once)."""

    obj: MemoryObj
    expires: float
    overdue: bool = False


@dataclass(slots=True)
class Hold:
    """A namespace-wide pin on one committed entry's block (one reference on the block)."""

    obj: MemoryObj
    meta: EntryMeta
    expires: float
    #: The process that took it (its holds count against that process until it ends), or None.
    share: ProcessShare | None


@dataclass
class ProcessShare:
    """What all connections of one client process hold in a namespace, so the per-client caps
    bind a process, not a connection (eight connections of one process share one allowance).

    ``leases``/``pinned``: its live leases and their block bytes; ``holds``/``held``: its live
    holds and their block bytes (a block held twice counted twice); ``conns``: its open
    connections; ``key``: its pid (-connection id when the kernel could not tell). Kept while it
    has a connection or a hold."""

    key: int = 0
    leases: int = 0
    pinned: int = 0
    holds: int = 0
    held: int = 0
    conns: int = 0


@dataclass
class ClientState:
    """What one connection holds in its namespace; reclaimed by :meth:`Namespace.drop_client`.

    ``share``: what its process holds over all of its connections (the caps are checked
    there)."""

    ident: int
    pid: int = 0
    leases: dict[int, Lease] = field(default_factory=dict)
    grants: dict[int, Grant] = field(default_factory=dict)
    requests: int = 0
    share: ProcessShare = field(default_factory=ProcessShare)
