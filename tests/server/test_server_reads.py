"""Lease-free reads: READ answers checked by the pool's version table, locations a client
remembers, the TOUCH that reports reads from them, and races that must never yield another
entry's bytes."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch

import lmcache_async.server.client as client_mod
import lmcache_async.server.client_wire as client_wire
import lmcache_async.server.connection as connection
from lmcache_async.memory import MemoryFormat, PoolAllocator
from lmcache_async.read_sinks import ReadSink
from lmcache_async.server.client import ServerClient
from lmcache_async.server.client_wire import touch_frames as _touch_frames
from lmcache_async.server.protocol import FRAME, MAX_BATCH, Op, Reader
from lmcache_async.server.shm import OPTIMISTIC_READS, REGION_BYTES, PoolMapping, SharedPool
from lmcache_async.testing.conformance import make_key, make_obj

pytestmark = pytest.mark.skipif(not OPTIMISTIC_READS, reason="lease-free reads are used on x86-64 only")

SHAPE = (64, 64)


def _kb(i: int) -> bytes:
    return make_key(i).to_string().encode()


def _expected(seed: int, shape: tuple[int, ...] = SHAPE) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _put(
    client: ServerClient, pool: PoolAllocator, i: int, seed: int | None = None, shape: tuple[int, ...] = SHAPE
) -> bool:
    obj = make_obj(pool, shape, torch.float32, MemoryFormat.KV_2LTD, seed=i if seed is None else seed)
    try:
        res = client.put([(_kb(i), obj)])
        return bool(res and res[0])
    finally:
        obj.ref_count_down()


def _get(client: ServerClient, pool: PoolAllocator, i: int) -> torch.Tensor | None:
    got = client.get([_kb(i)], pool.allocate)
    assert got is not None, "the server could not be asked"
    if got[0] is None:
        return None
    t = got[0].tensor.clone()
    got[0].ref_count_down()
    return t


def _ns(srv, name: str) -> dict:
    return srv.status()["namespaces"][name]


@pytest.fixture
def pool() -> PoolAllocator:
    return PoolAllocator(64 << 20, name="t-reads", pretouch=False)


def test_an_entry_read_before_is_copied_from_its_known_location_and_reported_later(shared_server, pool) -> None:
    client = ServerClient(shared_server.socket, "known", timeout_s=5.0)
    try:
        assert _put(client, pool, 1)
        for _ in range(3):
            t = _get(client, pool, 1)
            assert t is not None and torch.equal(t, _expected(1))
        assert client.stats()["known_reads"] == 2  # the first read asked (READ), two did not
        assert _ns(shared_server, "known")["hits"] == 1  # not reported yet
        assert client.contains([_kb(1)]) == [True]  # carries the TOUCH of the two reads
        assert _ns(shared_server, "known")["hits"] == 3
        assert pool.used_bytes == 0
    finally:
        client.close()


def test_reads_from_known_locations_are_reported_in_batches_without_another_request(shared_server, pool) -> None:
    client = ServerClient(shared_server.socket, "touch-batch", timeout_s=5.0)
    try:
        assert _put(client, pool, 2)
        assert _get(client, pool, 2) is not None
        for _ in range(client_mod.TOUCH_BATCH):
            assert _get(client, pool, 2) is not None
        deadline = time.monotonic() + 10
        while _ns(shared_server, "touch-batch")["hits"] < 1 + client_mod.TOUCH_BATCH and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _ns(shared_server, "touch-batch")["hits"] == 1 + client_mod.TOUCH_BATCH
    finally:
        client.close()


@pytest.mark.parametrize("still_leased", [False, True])
def test_an_entry_removed_elsewhere_is_not_read_from_its_old_location(shared_server, pool, still_leased: bool) -> None:
    ns = f"removed-{still_leased}"
    reader = ServerClient(shared_server.socket, ns, timeout_s=5.0)
    other = ServerClient(shared_server.socket, ns, timeout_s=5.0)
    try:
        assert _put(other, pool, 3)
        assert _get(reader, pool, 3) is not None  # the reader now knows where it lies
        with other.get_view(_kb(3)) as view:  # a lease keeps the block alive, if asked to
            assert view is not None
            if not still_leased:
                view.close()
            assert other.remove([_kb(3)]) == [True]
            assert _get(reader, pool, 3) is None  # answered by the server: a miss
        assert reader.stats()["known_reads"] == 0
    finally:
        reader.close()
        other.close()


def test_an_entry_replaced_elsewhere_reads_as_its_new_bytes(shared_server, pool) -> None:
    reader = ServerClient(shared_server.socket, "replaced", timeout_s=5.0)
    other = ServerClient(shared_server.socket, "replaced", timeout_s=5.0)
    try:
        assert _put(other, pool, 4, seed=40)
        t = _get(reader, pool, 4)
        assert t is not None and torch.equal(t, _expected(40))
        assert other.remove([_kb(4)]) == [True]
        assert _put(other, pool, 4, seed=41)
        t = _get(reader, pool, 4)
        assert t is not None and torch.equal(t, _expected(41))
    finally:
        reader.close()
        other.close()


def test_entries_evicted_and_their_blocks_reused_never_read_as_another_key(make_server, pool) -> None:
    srv = make_server(max_local_cpu_size=4 / 1024).start()  # a 4 MiB pool: 1 MiB entries evict fast
    reader = ServerClient(srv.socket, "evict", timeout_s=5.0)
    writer = ServerClient(srv.socket, "evict", timeout_s=5.0)
    shape = (256, 1024)
    try:
        for i in range(3):
            assert _put(writer, pool, i, shape=shape)
            assert _get(reader, pool, i) is not None
        for i in range(3, 12):  # evicts 0..2 and reuses their blocks for other keys
            assert _put(writer, pool, i, shape=shape)
        for i in range(12):
            t = _get(reader, pool, i)
            assert t is None or torch.equal(t, _expected(i, shape)), i
        assert _ns(srv, "evict")["evictions"] >= 3
    finally:
        reader.close()
        writer.close()


@pytest.mark.parametrize("then", ["removed", "replaced"])
def test_a_copy_raced_by_a_removal_is_read_again_under_a_lease(shared_server, pool, monkeypatch, then: str) -> None:
    ns = f"race-{then}"
    reader = ServerClient(shared_server.socket, ns, timeout_s=5.0, remember_locations=False)
    other = ServerClient(shared_server.socket, ns, timeout_s=5.0)
    real_copy: Callable[..., None] = connection.copy_bytes  # a lease-free copy runs in client_wire
    raced: list[bool] = []

    def copy_during_a_removal(*args, **kwargs) -> None:
        if not raced:
            raced.append(True)
            assert other.remove([_kb(5)]) == [True]
            for j in range(6, 10):  # other entries of the same size may take the freed block
                assert _put(other, pool, j)
            if then == "replaced":
                assert _put(other, pool, 5, seed=55)
        real_copy(*args, **kwargs)

    try:
        assert _put(other, pool, 5)
        monkeypatch.setattr(client_wire, "copy_bytes", copy_during_a_removal)
        t = _get(reader, pool, 5)
        assert raced and reader.stats()["rereads"] == 1
        if then == "removed":
            assert t is None
        else:
            assert t is not None and torch.equal(t, _expected(55))
        assert _ns(shared_server, ns)["leases"] == 0 or _wait_no_leases(shared_server, ns)
        assert pool.used_bytes == 0
    finally:
        reader.close()
        other.close()


def _wait_no_leases(srv, ns: str) -> bool:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if _ns(srv, ns)["leases"] == 0:
            return True
        time.sleep(0.02)
    return False


def test_touch_frames_keep_within_the_batch_limit() -> None:
    keys = [_kb(i) for i in range(MAX_BATCH + 5)]
    data = _touch_frames(keys)
    got: list[bytes] = []
    pos = 0
    while pos < len(data):
        n, op, _seq = FRAME.unpack_from(data, pos)
        assert op == Op.TOUCH
        r = Reader(data[pos + FRAME.size : pos + FRAME.size + n])
        part = r.keys()
        r.done()
        assert 0 < len(part) <= MAX_BATCH
        got += part
        pos += FRAME.size + n
    assert got == keys


def test_the_version_table_moves_only_under_an_entry_that_leaves_the_index() -> None:
    pool = SharedPool(8 * REGION_BYTES, name="t-versions", generation=7, pretouch=False)
    try:
        one = pool.allocate((REGION_BYTES,), torch.uint8)  # region 0
        two = pool.allocate((REGION_BYTES + 4096,), torch.uint8)  # regions 1 and 2
        assert one is not None and two is not None
        v_one, v_two = pool.version(one.offset, one.size), pool.version(two.offset, two.size)
        pool.retire(two.offset, two.size)
        assert pool.version(one.offset, one.size) == v_one
        assert pool.version(two.offset, two.size) == v_two + 2  # one step in each region
        fd = __import__("os").dup(pool.fd)
        mapping = PoolMapping(fd, 7, pool.capacity, 4096, pool.align)
        assert mapping.version(two.offset, two.size) == pool.version(two.offset, two.size)
        one.ref_count_down()
        two.ref_count_down()
    finally:
        pool.close()


def test_a_pool_whose_header_misplaces_the_version_table_is_refused() -> None:
    import os
    import struct

    pool = SharedPool(2 * REGION_BYTES, name="t-bad-table", generation=9, pretouch=False)
    try:
        struct.pack_into("<Q", pool._mm, 24, pool.file_bytes)  # the table past the end of the file
        with pytest.raises(ValueError, match="table"):
            PoolMapping(os.dup(pool.fd), 9, pool.capacity, 4096, pool.align)
    finally:
        pool.close()


# ---- reads straight into caller memory (ServerClient.read_into) ----------------------------------
def _sink(dst: torch.Tensor) -> ReadSink:
    """A sink over the float32 tensor ``dst`` in two pieces (the pieces of a paged cache)."""
    base, n = dst.data_ptr(), dst.numel() * 4
    return ReadSink(tuple(dst.shape), torch.float32, ((base, 1000 * 4), (base + 1000 * 4, n - 1000 * 4)))


def test_read_into_copies_entries_straight_into_caller_memory(shared_server, pool) -> None:
    client = ServerClient(shared_server.socket, "into", timeout_s=5.0)
    try:
        assert _put(client, pool, 11) and _put(client, pool, 12)
        dsts = [torch.zeros(SHAPE) for _ in range(3)]
        assert client.read_into([_kb(11), _kb(12), _kb(13)], [_sink(d) for d in dsts]) == [True, True, False]
        assert torch.equal(dsts[0], _expected(11)) and torch.equal(dsts[1], _expected(12))
        assert not dsts[2].any()
        again = torch.zeros(SHAPE)
        assert client.read_into([_kb(12)], [_sink(again)]) == [True]  # a known location: no round trip
        assert torch.equal(again, _expected(12)) and client.stats()["known_reads"] == 1
        assert pool.used_bytes == 0
    finally:
        client.close()


def test_read_into_with_prefix_copies_nothing_after_the_first_miss(shared_server, pool) -> None:
    client = ServerClient(shared_server.socket, "into-prefix", timeout_s=5.0)
    try:
        assert _put(client, pool, 21) and _put(client, pool, 23)
        dsts = [torch.zeros(SHAPE) for _ in range(3)]
        got = client.read_into([_kb(21), _kb(22), _kb(23)], [_sink(d) for d in dsts], prefix=True)
        assert got == [True, False, False]
        assert torch.equal(dsts[0], _expected(21)) and not dsts[2].any()
    finally:
        client.close()


def test_read_into_a_sink_of_another_shape_is_a_counted_miss(shared_server, pool) -> None:
    client = ServerClient(shared_server.socket, "into-shape", timeout_s=5.0)
    try:
        assert _put(client, pool, 31)
        wrong = torch.zeros(32, 128)
        sink = ReadSink((32, 128), torch.float32, ((wrong.data_ptr(), wrong.numel() * 4),))
        assert client.read_into([_kb(31)], [sink]) == [False]
        assert not wrong.any() and client.stats()["read_mismatches"] == 1
        right = torch.zeros(SHAPE)
        assert client.read_into([_kb(31)], [_sink(right)]) == [True]  # the entry is kept
        assert torch.equal(right, _expected(31))
    finally:
        client.close()


@pytest.mark.parametrize("then", ["removed", "replaced"])
def test_read_into_raced_by_a_removal_reads_again_under_a_lease(shared_server, pool, monkeypatch, then: str) -> None:
    ns = f"into-race-{then}"
    reader = ServerClient(shared_server.socket, ns, timeout_s=5.0)
    other = ServerClient(shared_server.socket, ns, timeout_s=5.0)
    real_copy: Callable[..., None] = client_wire.copy_into
    raced: list[bool] = []

    def copy_during_a_removal(*args, **kwargs) -> None:
        if not raced:
            raced.append(True)
            assert other.remove([_kb(41)]) == [True]
            for j in range(42, 46):  # entries of the same size may take the freed block
                assert _put(other, pool, j)
            if then == "replaced":
                assert _put(other, pool, 41, seed=410)
        real_copy(*args, **kwargs)

    try:
        assert _put(other, pool, 41)
        monkeypatch.setattr(client_mod, "_copy_into", copy_during_a_removal)
        dst = torch.zeros(SHAPE)
        got = reader.read_into([_kb(41)], [_sink(dst)])
        assert raced and reader.stats()["rereads"] == 1
        if then == "removed":
            assert got == [False]
        else:
            assert got == [True] and torch.equal(dst, _expected(410))
        assert _ns(shared_server, ns)["leases"] == 0 or _wait_no_leases(shared_server, ns)
    finally:
        reader.close()
        other.close()


def test_read_into_from_a_known_location_of_a_replaced_entry_reads_its_new_bytes(shared_server, pool) -> None:
    reader = ServerClient(shared_server.socket, "into-replaced", timeout_s=5.0)
    other = ServerClient(shared_server.socket, "into-replaced", timeout_s=5.0)
    try:
        assert _put(other, pool, 51, seed=510)
        dst = torch.zeros(SHAPE)
        assert reader.read_into([_kb(51)], [_sink(dst)]) == [True]
        assert other.remove([_kb(51)]) == [True]
        for j in range(52, 56):  # may take the freed block
            assert _put(other, pool, j)
        assert _put(other, pool, 51, seed=511)
        assert reader.read_into([_kb(51)], [_sink(dst)]) == [True]
        assert torch.equal(dst, _expected(511))
    finally:
        reader.close()
        other.close()


def test_read_into_a_server_that_went_away_answers_none(make_server, pool) -> None:
    srv = make_server().start()
    client = ServerClient(srv.socket, "into-gone", timeout_s=2.0)
    try:
        assert _put(client, pool, 61)
        srv.kill()
        t0 = time.monotonic()
        assert client.read_into([_kb(61)], [_sink(torch.zeros(SHAPE))]) is None
        assert time.monotonic() - t0 < 2.5
        assert client.stats()["errors"] >= 1
    finally:
        client.close()


def test_read_into_under_leases_reads_a_batch_in_one_round_trip_and_keeps_the_prefix(
    shared_server, pool, monkeypatch
) -> None:
    """Where lease-free reads are not safe (not x86-64), the batch is read under leases."""
    monkeypatch.setattr(client_mod, "OPTIMISTIC_READS", False)
    client = ServerClient(shared_server.socket, "into-leased", timeout_s=5.0)
    exchanges = []
    real_exchange = connection.exchange

    def counting_exchange(*args, **kwargs):
        exchanges.append(args[1])
        return real_exchange(*args, **kwargs)

    try:
        assert _put(client, pool, 71) and _put(client, pool, 73)
        monkeypatch.setattr(client_mod, "_exchange", counting_exchange)
        dsts = [torch.zeros(SHAPE) for _ in range(3)]
        got = client.read_into([_kb(71), _kb(72), _kb(73)], [_sink(d) for d in dsts], prefix=True)
        assert got == [True, False, False] and exchanges == [Op.GET]
        assert torch.equal(dsts[0], _expected(71)) and not dsts[2].any()
        assert client.read_into([_kb(71), _kb(72), _kb(73)], [_sink(d) for d in dsts]) == [True, False, True]
        assert torch.equal(dsts[2], _expected(73))
        assert _ns(shared_server, "into-leased")["leases"] == 0 or _wait_no_leases(shared_server, "into-leased")
    finally:
        client.close()
