"""The node server's KV events: what its pool can serve, published in vLLM's format.

:class:`ServerEvents` is built before the server (``lmcache-async serve --events``) and handed
to it; each namespace reports entries that gained a description (``DESCRIBE``) or left the pool
(eviction, ``REMOVE``, ``CLEAR``, a namespace released, the server stopping) through the
:class:`~lmcache_async.server.namespace.EntryListener` methods. A
:class:`~lmcache_async.events.chunks.ChunkAdvertiser` turns those into whole-chunk, parent-first
stores and leaves-first removals with the same hashes, published with medium ``CPU`` and
ownership ``lmcache_async:server`` by a :class:`~lmcache_async.events.publisher.ZmqEventPublisher`.

Exactness: after a quiet point (no request in flight, the publisher's queue drained), the chunks
stored minus removed on the stream are exactly those a prefix lookup of the pool serves (an
entry without a description is never advertised). The stream covers every namespace of the
server (a chunk two namespaces hold is advertised once, removed when the last one drops it).
It starts with ``AllBlocksCleared`` (a restarted server holds nothing) and answers snapshot
requests with ``AllBlocksCleared`` then a store of every advertised chunk; a batch the
publisher had to drop (its queue full) is followed by such a snapshot once there is room.

Thread affinity: the server's event loop, except that the publisher's thread asks for snapshots
through :meth:`request_snapshot` (thread-safe).
"""

from __future__ import annotations

import asyncio
from typing import Any

from lmcache_async.events.chunks import Changes, Chunk, ChunkAdvertiser
from lmcache_async.events.describe import decode_describe
from lmcache_async.events.publisher import ZmqEventPublisher, replay_endpoint_for
from lmcache_async.events.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    medium_of,
    ownership_of,
)
from lmcache_async.server.protocol import Reader

__all__ = ["ServerEvents", "removed_event", "stored_event"]

TIER = "server"
#: Seconds of silence after which the stream carries an empty batch (a subscriber that missed
#: the last batches, or a restarted server's first, learns of the gap within this time).
HEARTBEAT_S = 2.0


def stored_event(chunk: Chunk, tier: str) -> BlockStored:
    """vLLM's ``BlockStored`` for one whole chunk held by ``tier``."""
    return BlockStored(
        block_hashes=list(chunk.block_hashes),
        parent_block_hash=chunk.parent_hash,
        token_ids=list(chunk.token_ids),
        block_size=chunk.block_size,
        lora_id=None,
        medium=medium_of(tier),
        lora_name=chunk.lora_name,
        extra_keys=None if chunk.extra_keys is None else list(chunk.extra_keys),
        ownership=ownership_of(tier),
    )


def removed_event(chunk: Chunk, tier: str) -> BlockRemoved:
    """vLLM's ``BlockRemoved`` with the same hashes as the chunk's store."""
    return BlockRemoved(block_hashes=list(chunk.block_hashes), medium=medium_of(tier), ownership=ownership_of(tier))


def events_of(changes: Changes, tier: str) -> list[Event]:
    """Removals (leaves first), then stores (parents first)."""
    out: list[Event] = [removed_event(c, tier) for c in changes.removed]
    out.extend(stored_event(c, tier) for c in changes.stored)
    return out


class ServerEvents:
    """See the module docstring. ``endpoint``: where the PUB socket binds
    (``tcp://127.0.0.1:PORT``); ``replay_endpoint``: the replay ROUTER (default: the next port)."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, *, max_queue: int = 10_000,
                 buffer_steps: int = 10_000) -> None:  # fmt: skip
        self.advertiser = ChunkAdvertiser()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: list[Event] = []  # events of this loop iteration, published as one batch
        self._flush_scheduled = False
        self.described = 0
        self.undescribable = 0
        self.publisher = ZmqEventPublisher(
            endpoint,
            replay_endpoint or replay_endpoint_for(endpoint),
            max_queue=max_queue,
            buffer_steps=buffer_steps,
            on_snapshot_request=self.request_snapshot,
        )
        self.publisher.publish([AllBlocksCleared()])  # a (re)started server holds nothing

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """The loop the server runs on (snapshot requests are answered there)."""
        self._loop = loop

    def close(self) -> None:
        """Send what is queued (bounded) and close the sockets; after the namespaces closed."""
        self.flush()
        self.publisher.close()

    # ---- EntryListener -----------------------------------------------------------------------------
    def entry_described(self, chunk: Chunk) -> None:
        """A committed entry now says which chunk it holds."""
        self._emit(self.advertiser.add(chunk))

    def entry_gone(self, chunk: Chunk) -> None:
        """A described entry left the pool."""
        self._emit(self.advertiser.discard(chunk))

    # ---- requests ------------------------------------------------------------------------------------
    def describe(self, ns: Any, r: Reader) -> bytes:
        """Answer a ``DESCRIBE`` request for namespace ``ns``: a u16 count and a u8 per entry."""
        items = decode_describe(r)
        out = bytearray(len(items).to_bytes(2, "little"))
        for key, chunk in items:
            ok = chunk is not None and ns.describe(key, chunk)
            self.described += ok
            self.undescribable += chunk is None
            out.append(1 if ok else 0)
        return bytes(out)

    def snapshot_events(self) -> list[Event]:
        """AllBlocksCleared, then a store of every advertised chunk (parents first)."""
        out: list[Event] = [AllBlocksCleared()]
        out.extend(stored_event(c, TIER) for c in self.advertiser.advertised())
        return out

    def request_snapshot(self) -> None:
        """Publish a snapshot soon (any thread)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        loop.call_soon_threadsafe(self._snapshot)

    def tick(self) -> None:
        """Resynchronise subscribers after dropped batches once the queue has room; an empty batch
        after :data:`HEARTBEAT_S` of silence (the server's sweep calls this about once a second)."""
        if self.publisher.resync_needed and self.publisher.room() > 0:
            self._snapshot()
        self.publisher.heartbeat(HEARTBEAT_S)

    def stats(self) -> dict[str, Any]:
        return {**self.publisher.stats(), "advertised_chunks": len(self.advertiser),
                "described": self.described, "undescribable": self.undescribable}  # fmt: skip

    def _snapshot(self) -> None:
        self._pending.clear()  # the snapshot holds these changes already
        self.publisher.publish_snapshot(self.snapshot_events())

    def _emit(self, changes: Changes) -> None:
        """Queue the events of ``changes``; they leave as one batch when the loop iteration
        ends (at once when no loop was started), so one request makes one batch."""
        if not changes:
            return
        self._pending.extend(events_of(changes, TIER))
        if self._loop is None:
            self.flush()
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self.flush)

    def flush(self) -> None:
        """Publish the queued events as one batch (a snapshot instead after dropped batches)."""
        self._flush_scheduled = False
        if self.publisher.resync_needed and self.publisher.room() > 0:
            self._snapshot()
            return
        if self._pending:
            events, self._pending = self._pending, []
            self.publisher.publish(events)
