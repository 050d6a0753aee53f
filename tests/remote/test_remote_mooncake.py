"""The Mooncake Store tier against a real store: master, metadata server and a segment holder
started on free loopback ports (:class:`~lmcache_async.testing.servers.MooncakeServers`). The
manager over a failing store and the configuration are in test_remote_mooncake_manager.py.

Without the Mooncake wheel or its binaries the tests skip with the reason, unless
``LMCACHE_ASYNC_REQUIRE_MOONCAKE=1`` (set by ``nox -s tests``) turns the skip into a failure.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from lmcache_async.config import LMCacheEngineConfig
from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import HeapAllocator, MemoryObj, PoolAllocator
from lmcache_async.records import decode_header
from lmcache_async.testing import PersistentBackendConformanceTests, make_key, make_obj
from lmcache_async.testing.servers import MooncakeServers, is_loopback_listener
from lmcache_async.tiers import BackendContext

from .mooncake_support import _start

pytestmark = pytest.mark.mooncake


def same(a: MemoryObj, b: MemoryObj) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bytes(a.byte_view()) == bytes(b.byte_view())


def mooncake_backend(
    ctx: BackendContext, store: MooncakeServers, prefix: str, timeout_s: float = 30.0, key_file: str | None = None
) -> Any:
    from lmcache_async.remote.mooncake import MooncakeBackend

    ctx.config = LMCacheEngineConfig.from_defaults(**store.config(), encryption_key_file=key_file)
    return MooncakeBackend(ctx, prefix=prefix, timeout_s=timeout_s)


def raw_client(store: MooncakeServers) -> Any:
    """A pure client of ``store`` through the tier's blocking wrapper (for inspecting objects)."""
    from lmcache_async.remote.mooncake_store import MooncakeClient, MooncakeSettings

    settings = MooncakeSettings(master=store.url.split("://", 1)[1], metadata_server=store.metadata_server)
    return MooncakeClient.open(settings)


# ---- the conformance suite ------------------------------------------------------------------------
class TestMooncakeConformance(PersistentBackendConformanceTests):
    """Entries live in the holder's segment, so a reopened backend (a new client) finds them."""

    @pytest.fixture(autouse=True)
    def _store(self, mooncake_store: MooncakeServers) -> None:
        self.store = mooncake_store
        self.prefix = f"c{uuid.uuid4().hex[:12]}"

    async def make_backend(self, ctx: BackendContext, location: Path) -> Any:
        return mooncake_backend(ctx, self.store, self.prefix)


class TestSealedMooncakeConformance(PersistentBackendConformanceTests):
    """The same contract with every record sealed (``encryption_key_file``; the key file sits
    beside the location, so a reopened backend has the same key)."""

    @pytest.fixture(autouse=True)
    def _store(self, mooncake_store: MooncakeServers) -> None:
        self.store = mooncake_store
        self.prefix = f"s{uuid.uuid4().hex[:12]}"

    async def make_backend(self, ctx: BackendContext, location: Path) -> Any:
        key_file = location.parent / "conformance.key"
        if not key_file.exists():
            _key_file(location.parent, "conformance.key")
        return mooncake_backend(ctx, self.store, self.prefix, key_file=str(key_file))


# ---- fixtures of the specific tests -------------------------------------------------------------------
@pytest.fixture
def prefix() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
def src_pool() -> PoolAllocator:
    return PoolAllocator(64 << 20, name="mooncake-src", pretouch=False)


@pytest.fixture
async def open_backend(make_ctx: Any, prefix: str) -> AsyncIterator[Callable[..., Any]]:
    """``await open_backend(store, **kw)``: a started Mooncake backend closed after the test."""
    made: list[Any] = []

    async def make(store: MooncakeServers, **kw: Any) -> Any:
        be = mooncake_backend(make_ctx(), store, kw.pop("prefix", prefix), **kw)
        made.append(be)
        await be.start()
        return be

    yield make
    for be in made:
        await be.close()


# ---- the store the fixtures start ------------------------------------------------------------------
def test_every_listener_of_the_store_is_on_loopback(mooncake_store: MooncakeServers) -> None:
    listeners = mooncake_store.listeners()
    assert set(listeners) == {"metadata", "master", "holder"}
    for part, addrs in listeners.items():
        assert addrs, part
        assert all(is_loopback_listener(a) for a in addrs), (part, addrs)


# ---- layout ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("batched", [False, True], ids=["single", "batch"])
async def test_entry_is_one_object_holding_header_then_payload(
    mooncake_store: MooncakeServers, open_backend: Any, src_pool: PoolAllocator, prefix: str, batched: bool
) -> None:
    """A single put (``put_from_with_metadata``) and a batch (``batch_put_from_multi_buffers``)
    store the same layout."""
    from lmcache_async.remote.mooncake import header_room

    be = await open_backend(mooncake_store)
    key = make_key(1, model="org/model")
    src = make_obj(src_pool, (64, 256), torch.float32, seed=1)
    if batched:
        other = make_obj(src_pool, (8,), torch.float32, seed=2)
        assert await be.batched_put([(key, src), (make_key(2, model="org/model"), other)]) == [True, True]
        other.ref_count_down()
    else:
        assert await be.put(key, src)
    name = be.entry_name(key)
    assert name.record.startswith(f"{prefix}:org%2Fmodel:{{")
    client = raw_client(mooncake_store)
    try:
        room = header_room(name.key)
        buf = torch.zeros(room + src.nbytes, dtype=torch.uint8)
        with client.registered([(buf.data_ptr(), buf.numel())]):
            assert client.session_start([name.record]) == [0]
            try:
                got = client.read_ranges([name.record], [[buf.data_ptr()]], [[buf.numel()]], [[0]])
            finally:
                client.session_end([name.record])
        assert got == [room + src.nbytes]
        hdr = decode_header(buf.numpy().data)
        assert hdr.key == name.key and hdr.header_len == room and hdr.payload_len == src.nbytes
        assert bytes(buf[room:].numpy()) == bytes(src.byte_view())
    finally:
        client.close()
    src.ref_count_down()


async def test_prefixes_isolate_deployments_on_one_store(
    mooncake_store: MooncakeServers, open_backend: Any, src_pool: PoolAllocator, prefix: str
) -> None:
    a = await open_backend(mooncake_store, prefix=prefix + "-a")
    b = await open_backend(mooncake_store, prefix=prefix + "-b")
    src = make_obj(src_pool, seed=3)
    key = make_key(3)
    assert await a.put(key, src)
    assert await a.contains(key)
    assert not await b.contains(key)
    assert await b.get(key) is None
    await b.clear()
    assert await a.contains(key)
    src.ref_count_down()


async def test_entries_from_registered_memory_round_trip(
    mooncake_store: MooncakeServers, make_ctx: Any, prefix: str
) -> None:
    """Blocks of the registered staging area need no registration per call, single or batched."""
    ctx = make_ctx()
    be = mooncake_backend(ctx, mooncake_store, prefix)
    await be.start()
    assert ctx.staging_pool is not None
    srcs = [make_obj(ctx.staging_pool, (32, 64), torch.bfloat16, seed=40 + i) for i in range(3)]
    keys = [make_key(40 + i) for i in range(3)]
    try:
        assert await be.put(keys[0], srcs[0])
        assert await be.batched_put(list(zip(keys[1:], srcs[1:], strict=True))) == [True, True]
        got = await be.batched_get(keys)
        assert all(g is not None and same(g, s) for g, s in zip(got, srcs, strict=True))
        for g in got:
            if g is not None:
                g.ref_count_down()
    finally:
        for s in srcs:
            s.ref_count_down()
        await be.close()


async def test_a_key_asked_twice_in_one_batch_gets_one_reference_per_answer(
    mooncake_store: MooncakeServers, make_ctx: Any, prefix: str, src_pool: PoolAllocator
) -> None:
    ctx = make_ctx()
    be = mooncake_backend(ctx, mooncake_store, prefix)
    await be.start()
    assert ctx.staging_pool is not None
    src = make_obj(src_pool, (16, 8), torch.float32, seed=45)
    key = make_key(45)
    try:
        assert await be.put(key, src)
        before = ctx.staging_pool.used_bytes
        got = await be.batched_get([key, make_key(46), key])
        assert got[1] is None
        for g in (got[0], got[2]):
            assert g is not None and same(g, src)
        for g in (got[0], got[2]):
            assert g is not None
            g.ref_count_down()  # each answer is released on its own, and nothing is left behind
        assert ctx.staging_pool.used_bytes == before
    finally:
        src.ref_count_down()
        await be.close()


async def test_empty_payloads_and_keys_too_long_for_a_header_slot_round_trip(
    mooncake_store: MooncakeServers, open_backend: Any, src_pool: PoolAllocator
) -> None:
    """An empty payload goes through the batch call (the single-object call stores nothing for
    it); a header longer than a slot gets its own block of the header arena."""
    from lmcache_async.remote.mooncake import HEAD_SLOT_BYTES, header_room

    be = await open_backend(mooncake_store)
    empty = make_obj(src_pool, (0, 4), torch.float32, seed=0)
    long_key = make_key(51, model="m" * 900)
    assert header_room(be.entry_name(long_key).key) > HEAD_SLOT_BYTES
    src = make_obj(src_pool, (16, 16), torch.float32, seed=51)
    for key, obj in ((make_key(50), empty), (long_key, src)):
        assert await be.put(key, obj)
        got = await be.get(key)
        assert got is not None and same(got, obj)
        got.ref_count_down()
        obj.ref_count_down()


async def test_a_put_no_segment_has_room_for_is_a_counted_false(
    make_ctx: Any, prefix: str, src_pool: PoolAllocator
) -> None:
    """A "no space" answer is False, counted as ``no_space``, single or batched, and the
    store stays up."""
    store = _start(segment_bytes=16 << 20)
    be = mooncake_backend(make_ctx(), store, prefix)
    big = make_obj(src_pool, ((32 << 20) // 4,), torch.float32, seed=60)
    small = make_obj(src_pool, (8,), torch.float32, seed=61)
    try:
        await be.start()
        assert await be.put(make_key(60), big) is False
        assert await be.batched_put([(make_key(61), big), (make_key(62), small)]) == [False, True]
        st = be.stats()
        assert st["no_space"] == 2 and st["put_errors"] == 0 and not st["store_down"]
        # (The small entry may already be gone: a failed allocation makes the master evict.)
        assert not await be.contains(make_key(60))
    finally:
        big.ref_count_down()
        small.ref_count_down()
        await be.close()
        store.stop()


async def test_heap_buffers_round_trip(mooncake_store: MooncakeServers, open_backend: Any) -> None:
    """Buffers outside the registered pools are registered for the call and released after."""
    be = await open_backend(mooncake_store)
    heap = HeapAllocator("mooncake-heap")
    src = heap.allocate((3 << 20,), torch.uint8)
    src.tensor.random_(0, 256, generator=torch.Generator().manual_seed(3))
    key = make_key(30)
    assert await be.put(key, src)
    got = await be.get(key, lambda s, d, f: heap.allocate(s, d, f))
    assert got is not None and torch.equal(got.tensor, src.tensor)
    got.ref_count_down()
    src.ref_count_down()


# ---- bad objects -----------------------------------------------------------------------------------------
def _replace_object(store: MooncakeServers, record: str, data: bytes) -> None:
    """Put ``data`` under ``record`` in place of what is there (as a foreign writer would)."""
    client = raw_client(store)
    try:
        client.remove(record)
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        with client.registered([(buf.data_ptr(), buf.numel())]):
            assert client.put_parts([record], [[buf.data_ptr()]], [[buf.numel()]]) == [0]
    finally:
        client.close()


def _read_object(store: MooncakeServers, record: str, size: int) -> bytes:
    client = raw_client(store)
    try:
        buf = torch.zeros(size, dtype=torch.uint8)
        with client.registered([(buf.data_ptr(), size)]):
            assert client.session_start([record]) == [0]
            try:
                assert client.read_ranges([record], [[buf.data_ptr()]], [[size]], [[0]]) == [size]
            finally:
                client.session_end([record])
        return bytes(buf.numpy())
    finally:
        client.close()


def _exists(store: MooncakeServers, record: str) -> bool:
    client = raw_client(store)
    try:
        return bool(client.is_exist(record))
    finally:
        client.close()


async def _stored(be: Any, src_pool: PoolAllocator, i: int) -> tuple[CacheEngineKey, str, MemoryObj, int]:
    from lmcache_async.remote.mooncake import header_room

    src = make_obj(src_pool, seed=i)
    key = make_key(i)
    assert await be.put(key, src)
    name = be.entry_name(key)
    return key, name.record, src, header_room(name.key) + src.nbytes


async def test_corrupt_payload_is_a_counted_miss_and_removed(
    mooncake_store: MooncakeServers, open_backend: Any, src_pool: PoolAllocator
) -> None:
    be = await open_backend(mooncake_store)
    key, record, src, size = await _stored(be, src_pool, 6)
    data = bytearray(_read_object(mooncake_store, record, size))
    data[-10] ^= 0xFF
    _replace_object(mooncake_store, record, bytes(data))
    assert await be.get(key) is None
    assert be.stats()["corrupt"] == 1
    assert not _exists(mooncake_store, record)
    src.ref_count_down()


async def test_truncated_object_is_a_counted_miss_and_removed(
    mooncake_store: MooncakeServers, open_backend: Any, src_pool: PoolAllocator
) -> None:
    be = await open_backend(mooncake_store)
    key, record, src, size = await _stored(be, src_pool, 7)
    data = _read_object(mooncake_store, record, size)
    _replace_object(mooncake_store, record, data[:100])
    assert await be.get(key) is None
    assert be.stats()["corrupt"] == 1
    assert not _exists(mooncake_store, record)
    src.ref_count_down()


async def test_object_of_another_key_is_a_miss_and_kept(
    mooncake_store: MooncakeServers, open_backend: Any, src_pool: PoolAllocator
) -> None:
    be = await open_backend(mooncake_store)
    _key, record, src, size = await _stored(be, src_pool, 8)
    other = be.entry_name(make_key(9)).record
    _replace_object(mooncake_store, other, _read_object(mooncake_store, record, size))  # as if digests collided
    assert await be.get(make_key(9)) is None
    assert await be.remove(make_key(9)) is False
    assert be.stats()["foreign"] == 1
    assert _exists(mooncake_store, other)
    src.ref_count_down()


async def test_objects_read_a_moment_ago_are_removed_despite_their_lease(
    own_store: MooncakeServers, open_backend: Any, src_pool: PoolAllocator
) -> None:
    be = await open_backend(own_store)
    key, record, src, _size = await _stored(be, src_pool, 10)
    got = await be.get(key)  # the master now holds a read lease on the object
    assert got is not None
    got.ref_count_down()
    assert await be.remove(key) is True
    assert not _exists(own_store, record)
    assert await be.get(key) is None
    src.ref_count_down()


# ---- the store failing -----------------------------------------------------------------------------------
async def test_presence_is_unknown_not_absent_when_the_master_is_gone(
    own_store: MooncakeServers, open_backend: Any, src_pool: PoolAllocator
) -> None:
    from lmcache_async.remote.mooncake import MooncakeError

    be = await open_backend(own_store, timeout_s=1.0)
    key, _record, src, _size = await _stored(be, src_pool, 11)
    own_store.kill_master()
    with pytest.raises((MooncakeError, TimeoutError)):
        await be.batched_contains([key, make_key(12)])
    src.ref_count_down()


@pytest.mark.chaos
async def test_calls_on_a_hung_master_are_abandoned_bounded_and_leak_no_buffer(
    own_store: MooncakeServers, make_ctx: Any, src_pool: PoolAllocator, prefix: str
) -> None:
    from lmcache_async.remote.mooncake import MooncakeBackend, MooncakeError

    ctx = make_ctx()
    staging = ctx.staging_pool
    ctx.config = LMCacheEngineConfig.from_defaults(**own_store.config())
    timeout = 0.5
    be = MooncakeBackend(ctx, prefix=prefix, timeout_s=timeout, workers=2)
    await be.start()
    keys = [make_key(20 + i) for i in range(4)]
    srcs = [make_obj(src_pool, seed=i) for i in range(4)]
    fresh = make_obj(src_pool, seed=99)
    try:
        assert all(await be.batched_put(list(zip(keys, srcs, strict=True))))
        own_store.pause_master()
        try:
            with pytest.raises((MooncakeError, TimeoutError)):
                # A new object needs the master to place it: the call blocks in the client and
                # is abandoned at the timeout. (A get of an object the client has already placed
                # may still be served from the holder without the master.)
                await be.put(make_key(40), fresh)
            for i, k in enumerate(keys):  # refused while the store is down, or the right bytes
                try:
                    got = await be.get(k)
                except (MooncakeError, TimeoutError):
                    continue
                if got is not None:
                    assert same(got, srcs[i])
                    got.ref_count_down()
            st = be.stats()
            assert st["store_down"] and st["refused"] >= 1
            assert 1 <= st["in_flight_abandoned"] <= 2
        finally:
            own_store.resume_master()
        deadline = time.monotonic() + 60
        got = None
        while time.monotonic() < deadline:  # recovers: a probe succeeds and a new client is set up
            try:
                got = await be.get(keys[0])
            except (MooncakeError, TimeoutError):
                await asyncio.sleep(0.2)
                continue
            break
        assert got is not None and same(got, srcs[0]), be.stats()
        got.ref_count_down()
        deadline = time.monotonic() + 90  # a call stuck on the paused master ends at its RPC timeout
        while be.stats()["in_flight_abandoned"] and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert be.stats()["in_flight_abandoned"] == 0
        assert staging is not None and staging.used_bytes == 0  # abandoned reads released their buffers
    finally:
        await be.close()
        for s in [*srcs, fresh]:
            s.ref_count_down()


# ---- record headers (no store needed) ---------------------------------------------------------------
def test_headers_are_padded_to_a_length_known_from_the_key(src_pool: PoolAllocator) -> None:
    from lmcache_async.remote.mooncake import header_room, padded_header

    for shape in [(), (7,), (2, 3, 4, 5, 6, 7, 8)]:
        obj = make_obj(src_pool, shape, torch.float16, seed=1)
        head = padded_header(obj, "some/key@1@0@abc@bfloat16", 1234)
        assert len(head) == header_room("some/key@1@0@abc@bfloat16")
        hdr = decode_header(head)
        assert hdr.shape == shape and hdr.header_len == len(head) and hdr.checksum == 1234
        obj.ref_count_down()


def test_a_header_is_written_in_place_and_leaves_the_rest_of_the_buffer(src_pool: PoolAllocator) -> None:
    from lmcache_async.remote.mooncake_record import header_room, padded_header, write_header

    key = "some/key@1@0@abc@bfloat16"
    obj = make_obj(src_pool, (3, 5), torch.float32, seed=2)
    buf = bytearray(b"\xaa" * (header_room(key) + 16))
    assert write_header(memoryview(buf), obj, key, 99) == header_room(key)
    assert bytes(buf[: header_room(key)]) == padded_header(obj, key, 99)
    assert bytes(buf[header_room(key) :]) == b"\xaa" * 16
    with pytest.raises(ValueError, match="needs"):
        write_header(memoryview(bytearray(64)), obj, key, 99)
    obj.ref_count_down()


# ---- encryption at rest ------------------------------------------------------------------------------
def _key_file(tmp_path: Path, name: str) -> str:
    from lmcache_async.encryption import write_key_file

    path = str(tmp_path / name)
    write_key_file(path)
    return path


def _object(store: MooncakeServers, record: str) -> bytes:
    """The whole object as the store holds it."""
    client = raw_client(store)
    try:
        size = client.size(record)
    finally:
        client.close()
    assert size > 0
    return _read_object(store, record, size)


def _plain_absent(src: MemoryObj, blob: bytes) -> None:
    plain = bytes(src.byte_view())
    for off in range(0, len(plain) - 32, 4096):
        assert plain[off : off + 32] not in blob


@pytest.mark.parametrize("batched", [False, True], ids=["single", "batch"])
async def test_sealed_entries_round_trip_and_the_store_holds_no_plaintext(
    mooncake_store: MooncakeServers, open_backend: Any, src_pool: PoolAllocator, tmp_path: Path, batched: bool
) -> None:
    from lmcache_async.remote.mooncake import header_room

    be = await open_backend(mooncake_store, key_file=_key_file(tmp_path, "a"))
    srcs = [make_obj(src_pool, (256, 256), torch.float32, seed=40), make_obj(src_pool, (0,), torch.float16, seed=41)]
    keys = [make_key(40), make_key(41)]
    if batched:
        assert await be.batched_put(list(zip(keys, srcs, strict=True))) == [True, True]
    else:
        assert [await be.put(k, o) for k, o in zip(keys, srcs, strict=True)] == [True, True]
    name = be.entry_name(keys[0])
    blob = _object(mooncake_store, name.record)
    hdr = decode_header(blob)
    assert hdr.seal is not None and hdr.seal.segments == 1 and hdr.header_len == header_room(name.key, sealed=True)
    assert len(blob) == hdr.header_len + srcs[0].nbytes + 16
    _plain_absent(srcs[0], blob)
    got = await be.batched_get(keys)
    for g, src in zip(got, srcs, strict=True):
        assert g is not None and same(g, src)
        g.ref_count_down()
    assert be.stats()["sealed"] and be.stats()["corrupt"] == 0
    for src in srcs:
        src.ref_count_down()


@pytest.mark.parametrize("shape", [(256, 256), (1,)], ids=["large", "shorter-than-a-sealed-header"])
async def test_records_of_another_key_no_key_or_plain_are_foreign_misses_and_kept(
    mooncake_store: MooncakeServers, open_backend: Any, src_pool: PoolAllocator, tmp_path: Path, prefix: str,
    shape: tuple[int, ...],
) -> None:  # fmt: skip
    a, b = _key_file(tmp_path, "a"), _key_file(tmp_path, "b")
    sealed = await open_backend(mooncake_store, key_file=a)
    other = await open_backend(mooncake_store, key_file=b)
    plain = await open_backend(mooncake_store, prefix=prefix + "-plain")
    plain_reader = await open_backend(mooncake_store, prefix=prefix + "-plain", key_file=a)
    src = make_obj(src_pool, shape, torch.float32, seed=42)
    assert await sealed.put(make_key(42), src)
    assert await plain.put(make_key(42), src)
    for reader in (other, await open_backend(mooncake_store), plain_reader):
        assert await reader.get(make_key(42)) is None
        assert reader.stats()["foreign_key"] == 1 and reader.stats()["corrupt"] == 0
    assert _exists(mooncake_store, sealed.entry_name(make_key(42)).record)
    assert _exists(mooncake_store, plain.entry_name(make_key(42)).record)
    for owner in (sealed, plain):
        got = await owner.get(make_key(42))
        assert got is not None and same(got, src)
        got.ref_count_down()
    src.ref_count_down()


@pytest.mark.parametrize("checksum", ["stale", "recomputed"])
async def test_a_flipped_byte_of_a_sealed_record_is_a_miss_and_removed(
    mooncake_store: MooncakeServers, open_backend: Any, src_pool: PoolAllocator, tmp_path: Path, checksum: str
) -> None:
    """With the payload checksum fixed up, the flip is caught by the tag alone."""
    from lmcache_async.records import payload_checksum
    from lmcache_async.remote.mooncake_record import write_header

    be = await open_backend(mooncake_store, key_file=_key_file(tmp_path, "a"))
    src = make_obj(src_pool, (64, 64), torch.float32, seed=43)
    key = make_key(43)
    assert await be.put(key, src)
    record = be.entry_name(key).record
    data = bytearray(_object(mooncake_store, record))
    hdr = decode_header(data)
    data[hdr.header_len + 100] ^= 0x01
    if checksum == "recomputed":
        write_header(memoryview(data), src, hdr.key, payload_checksum(data[hdr.header_len :]), hdr.seal)
    _replace_object(mooncake_store, record, bytes(data))
    assert await be.get(key) is None
    assert be.stats()["corrupt"] == 1 and be.stats()["foreign_key"] == 0
    assert not _exists(mooncake_store, record)
    src.ref_count_down()


async def test_sealed_puts_from_heap_buffers_and_reads_larger_than_the_staging_area_round_trip(
    mooncake_store: MooncakeServers, open_backend: Any, tmp_path: Path
) -> None:
    """A sealed record that does not fit the staging area goes through a heap block."""
    be = await open_backend(mooncake_store, key_file=_key_file(tmp_path, "a"))
    heap = HeapAllocator("mooncake-sealed-heap")
    src = heap.allocate((72 << 20,), torch.uint8)  # larger than the 64 MiB staging area
    src.tensor.random_(0, 256, generator=torch.Generator().manual_seed(44))
    assert await be.put(make_key(44), src)
    got = await be.get(make_key(44), lambda s, d, f: heap.allocate(s, d, f))
    assert got is not None and torch.equal(got.tensor, src.tensor)
    got.ref_count_down()
    src.ref_count_down()
