"""A full publisher queue never blocks the server: what was dropped is repaired by a snapshot."""

from __future__ import annotations

import time

import pytest
from events.conftest import free_port_pair

from lmcache_async.events.chunks import Chunk
from lmcache_async.events.subscriber import EventSubscriber
from lmcache_async.events.wire import AllBlocksCleared, BlockRemoved, BlockStored
from lmcache_async.server.events import ServerEvents

pytestmark = pytest.mark.timeout(60)


def _chunk(i: int) -> Chunk:
    return Chunk((i.to_bytes(32, "big"),), None, tuple(range(16)), 16)


def test_dropped_batches_are_counted_then_a_snapshot_resynchronises_subscribers() -> None:
    port = free_port_pair()
    ev = ServerEvents(f"tcp://127.0.0.1:{port}", max_queue=2)
    try:
        with EventSubscriber(ev.publisher.endpoint, ev.publisher.replay_endpoint or "") as sub:
            time.sleep(0.3)
            view: set[bytes] = set()
            t0 = time.perf_counter()
            for i in range(3000):
                ev.entry_described(_chunk(i))
                if i % 3 == 0:
                    ev.entry_gone(_chunk(i))
            assert time.perf_counter() - t0 < 5.0  # never waited on the queue
            assert ev.publisher.dropped_batches > 0
            deadline = time.monotonic() + 10
            while ev.publisher.resync_needed and time.monotonic() < deadline:
                ev.tick()
                time.sleep(0.01)
            ev.publisher.flush()
            for b in sub.catch_up(int(ev.publisher.stats()["next_seq"])):  # type: ignore[arg-type]
                for e in b.events:
                    if isinstance(e, AllBlocksCleared):
                        view.clear()
                    elif isinstance(e, BlockStored):
                        view.update(e.block_hashes)  # type: ignore[arg-type]
                    elif isinstance(e, BlockRemoved):
                        view.difference_update(e.block_hashes)
            want = {c.block_hashes[0] for c in ev.advertiser.advertised()}
            assert len(want) == 2000 and view == want
    finally:
        ev.close()
