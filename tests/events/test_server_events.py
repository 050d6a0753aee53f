"""The node server's KV events: stores on describe, removals on remove/evict/clear, snapshots,
restarts, and whole chunks only, parent first."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import cast

import pytest
from events.kv_workload import CHUNK_BLOCKS, CacheSide, make_prompts, prompt_of

from lmcache_async.events.subscriber import EventSubscriber
from lmcache_async.events.wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

pytestmark = pytest.mark.timeout(120)


def _events(batches: list[KVEventBatch]) -> list[object]:
    return [e for b in batches for e in b.events]


def _drain(sub: EventSubscriber, srv: object, wait_s: float = 5.0) -> list[KVEventBatch]:
    """Everything published so far (the server's queue drained, gaps recovered)."""
    import time

    out: list[KVEventBatch] = []
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        st = srv.status()["events"]  # type: ignore[attr-defined]
        if st["queued"] == 0:
            out += sub.catch_up(st["next_seq"])
            if sub.next_seq == st["next_seq"]:
                return out
    raise AssertionError(f"events did not settle: {srv.status()['events']}, subscriber at {sub.next_seq}")  # type: ignore[attr-defined]


@pytest.fixture
def setup(make_event_server: type) -> Iterator[tuple[object, CacheSide, EventSubscriber]]:
    srv = make_event_server().start()
    sub = EventSubscriber(srv.endpoint, srv.replay_endpoint)
    sub.snapshot()  # joins: the server's view so far (nothing)
    cache = CacheSide(srv.socket)
    yield srv, cache, sub
    cache.close()
    sub.close()


def test_a_described_chunk_is_stored_with_medium_and_ownership(setup: tuple) -> None:
    srv, cache, sub = setup
    p = make_prompts(random.Random(1), 1)[0]
    assert cache.store(p, 1) == 1
    stored = [e for e in _events(_drain(sub, srv)) if isinstance(e, BlockStored)]
    assert len(stored) == 1
    ev = stored[0]
    assert ev.block_hashes == list(p.chunks[0].block_hashes) and ev.parent_block_hash is None
    assert ev.token_ids == list(p.tokens[: len(ev.token_ids)]) and ev.block_size == 16
    assert ev.medium == "CPU" and ev.ownership == "lmcache_async:server"


def test_a_child_waits_for_its_parent_and_removal_goes_leaves_first(setup: tuple) -> None:
    srv, cache, sub = setup
    p = prompt_of(tuple(range(1, 1 + 32 * 3)), None)
    # chunks 1 and 2 without chunk 0: nothing advertised (their parent is not there)
    _put_describe(cache, p, [1, 2])
    assert not [e for e in _events(_drain(sub, srv)) if isinstance(e, BlockStored)]
    _put_describe(cache, p, [0])
    stored = [e for e in _events(_drain(sub, srv)) if isinstance(e, BlockStored)]
    assert [e.block_hashes for e in stored] == [list(c.block_hashes) for c in p.chunks]  # parents first
    cache.remove([p.keys[0]])
    removed = [e for e in _events(_drain(sub, srv)) if isinstance(e, BlockRemoved)]
    assert [e.block_hashes for e in removed] == [list(c.block_hashes) for c in reversed(p.chunks)]  # leaves first


def _put_describe(cache: CacheSide, p: object, idx: list[int]) -> None:
    import torch

    from lmcache_async.memory import MemoryFormat

    for i in idx:
        obj = cache.pool.allocate((16, 256), torch.float32, MemoryFormat.KV_2LTD)
        assert obj is not None
        try:
            assert cache.client.put([(p.keys[i], obj)]) == [True]  # type: ignore[attr-defined]
        finally:
            obj.ref_count_down()
        assert cache.describer.describe([(p.keys[i], p.chunks[i])]) == [True]  # type: ignore[attr-defined]


def test_eviction_under_pressure_publishes_removals(setup: tuple) -> None:
    srv, cache, sub = setup
    prompts = make_prompts(random.Random(2), 60)
    for p in prompts:
        cache.store(p, len(p.chunks))
    evs = _events(_drain(sub, srv))
    stored = sum(isinstance(e, BlockStored) for e in evs)
    removed = sum(isinstance(e, BlockRemoved) for e in evs)
    ns = srv.status()["namespaces"]["events"]
    assert ns["evictions"] > 0 and removed > 0
    assert stored - removed == srv.status()["events"]["advertised_chunks"] <= ns["entries"]


def test_a_snapshot_clears_then_stores_what_is_held(setup: tuple) -> None:
    srv, cache, sub = setup
    p = make_prompts(random.Random(3), 1)[0]
    cache.store(p, len(p.chunks))
    _drain(sub, srv)
    snap = _events(sub.snapshot())
    assert isinstance(snap[0], AllBlocksCleared)
    assert all(isinstance(e, BlockStored) for e in snap[1:])
    assert [cast(BlockStored, e).block_hashes for e in snap[1:]] == [list(c.block_hashes) for c in p.chunks]


def test_describe_of_an_absent_key_is_not_recorded(setup: tuple) -> None:
    _srv, cache, _sub = setup
    p = make_prompts(random.Random(4), 1)[0]
    assert cache.describer.describe([(p.keys[0], p.chunks[0])]) == [False]


def test_a_restarted_server_is_seen_as_empty(make_event_server: type, setup: tuple) -> None:
    srv, cache, sub = setup
    p = make_prompts(random.Random(5), 1)[0]
    cache.store(p, len(p.chunks))
    _drain(sub, srv)
    port = int(srv.endpoint.rsplit(":", 1)[1])
    srv.stop()
    srv2 = make_event_server(port).start()
    evs = _events(_drain(sub, srv2))
    assert any(isinstance(e, AllBlocksCleared) for e in evs)
    assert sub.snapshots + sub.replays >= 1


def test_every_chunk_holds_whole_blocks() -> None:
    p = prompt_of(tuple(range(1, 65)), None)
    assert all(len(c.block_hashes) == CHUNK_BLOCKS for c in p.chunks)


def test_the_server_tiers_client_describes_what_it_committed(setup: tuple) -> None:
    """``ServerClient.describe`` (the data client the server tier uses) sends DESCRIBE itself."""
    srv, cache, sub = setup
    p = make_prompts(random.Random(6), 1)[0]
    import torch

    from lmcache_async.memory import MemoryFormat

    obj = cache.pool.allocate((16, 256), torch.float32, MemoryFormat.KV_2LTD)
    assert obj is not None
    try:
        assert cache.client.put([(p.keys[0], obj)]) == [True]
    finally:
        obj.ref_count_down()
    assert cache.client.describe([(p.keys[0], p.chunks[0]), (b"absent", p.chunks[1])]) == [True, False]
    stored = [e for e in _events(_drain(sub, srv)) if isinstance(e, BlockStored)]
    assert [e.block_hashes for e in stored] == [list(p.chunks[0].block_hashes)]
