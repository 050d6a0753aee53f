"""vLLM's wire format, replay, snapshots on request, and a publish that never blocks."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import cast

import pytest

from lmcache_async.events.publisher import ZmqEventPublisher
from lmcache_async.events.subscriber import EventSubscriber
from lmcache_async.events.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
    int_block_hash,
    medium_of,
    ownership_of,
)

pytestmark = pytest.mark.timeout(60)


def _stored(i: int) -> BlockStored:
    return BlockStored(
        block_hashes=[i.to_bytes(32, "big")], parent_block_hash=None, token_ids=[1] * 16, block_size=16,
        lora_id=None, medium="CPU", lora_name=None, ownership="lmcache_async:server",
    )  # fmt: skip


def test_a_batch_encodes_as_vllms_array_with_tagged_event_maps() -> None:
    import msgspec

    raw = encode_batch(KVEventBatch(ts=1.5, events=[_stored(1), BlockRemoved([b"x"], "CPU"), AllBlocksCleared()]))
    plain = msgspec.msgpack.decode(raw)
    assert plain[0] == 1.5 and plain[2:] in ([], [None])  # [ts, events, data_parallel_rank]
    assert [e["type"] for e in plain[1]] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert {"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"} <= set(
        plain[1][0]
    )
    assert decode_batch(raw).events[0] == _stored(1)


def test_mediums_and_ownership() -> None:
    assert medium_of("cpu") == medium_of("server") == "CPU"
    assert medium_of("disk") == medium_of("remote") == "STORAGE"
    assert ownership_of("disk") == "lmcache_async:disk"
    assert int_block_hash(b"\x01" + b"\x00" * 8) == 0 and int_block_hash(5) == 5


@pytest.fixture
def pub() -> Iterator[ZmqEventPublisher]:
    p = ZmqEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", on_snapshot_request=None)
    yield p
    p.close()


def test_a_subscriber_that_lost_messages_recovers_them_by_replay(pub: ZmqEventPublisher) -> None:
    with EventSubscriber(pub.endpoint, pub.replay_endpoint or "", lose=lambda s: s % 3 == 1) as sub:
        time.sleep(0.3)  # the subscription reaches the publisher
        got: list[KVEventBatch] = []
        for i in range(30):
            pub.publish([_stored(i)])
        pub.flush()
        deadline = time.monotonic() + 10
        while len(got) < 30 and time.monotonic() < deadline:
            got += sub.receive(0.1)
        stored = [e for b in got for e in b.events]
        assert all(isinstance(e, BlockStored) for e in stored)
        hashes = [cast(BlockStored, e).block_hashes[0] for e in stored]
        assert isinstance(hashes[0], bytes)
        first = int.from_bytes(hashes[0], "big")
        assert hashes == [i.to_bytes(32, "big") for i in range(first, 30)]
        assert sub.lost and sub.replays


def test_publish_never_blocks_and_counts_what_it_drops(pub: ZmqEventPublisher) -> None:
    small = ZmqEventPublisher("tcp://127.0.0.1:0", max_queue=4)
    try:
        t0 = time.perf_counter()
        ok = [small.publish([_stored(i)]) for i in range(5000)]
        assert time.perf_counter() - t0 < 2.0
        assert not all(ok) and small.dropped_batches == ok.count(False) and small.resync_needed
    finally:
        small.close()


def test_a_snapshot_request_is_answered_with_the_owners_snapshot() -> None:
    holder: list[ZmqEventPublisher] = []

    def on_request() -> None:
        holder[0].publish_snapshot([AllBlocksCleared(), _stored(9)])

    p = ZmqEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", on_snapshot_request=on_request)
    holder.append(p)
    try:
        with EventSubscriber(p.endpoint, p.replay_endpoint or "") as sub:
            events = [e for b in sub.snapshot() for e in b.events]
            assert events == [AllBlocksCleared(), _stored(9)]
            assert sub.next_seq is not None
    finally:
        p.close()


def test_a_replay_of_numbers_the_buffer_no_longer_holds_falls_back_to_a_snapshot() -> None:
    holder: list[ZmqEventPublisher] = []

    def on_request() -> None:
        holder[0].publish_snapshot([AllBlocksCleared()])

    p = ZmqEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", buffer_steps=2, on_snapshot_request=on_request)
    holder.append(p)
    try:
        with EventSubscriber(p.endpoint, p.replay_endpoint or "", lose=lambda s: True) as sub:
            time.sleep(0.3)
            sub.next_seq = p.stats()["next_seq"]  # type: ignore[assignment]
            for i in range(5):
                p.publish([_stored(i)])
            p.flush()
            got = sub.catch_up(int(p.stats()["next_seq"]))  # type: ignore[arg-type]
            assert sub.snapshots == 1 and isinstance(got[-1].events[0], AllBlocksCleared)
    finally:
        p.close()
