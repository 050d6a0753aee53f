"""The s3:// tier against a real SeaweedFS on loopback: the conformance kit (plain and sealed,
one range and many), damage, foreign records, cancellation, a killed and a paused server."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import obstore
import pytest
import torch

from lmcache_async import StorageManager
from lmcache_async.config import LMCacheEngineConfig
from lmcache_async.encryption import RecordCipher, load_cipher, write_key_file
from lmcache_async.memory import MemoryObj, PoolAllocator
from lmcache_async.remote import RemoteBackend
from lmcache_async.remote import s3 as s3_connector
from lmcache_async.testing import PersistentBackendConformanceTests, make_key, make_obj
from lmcache_async.testing.servers import SeaweedServer
from lmcache_async.tiers import BackendContext, StorageBackend

from .manager_support import tensor as _tensor
from .manager_support import wait_recovered
from .s3_support import objects, raw_store, records

pytestmark = pytest.mark.s3


def same(a: MemoryObj, b: MemoryObj) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bytes(a.byte_view()) == bytes(b.byte_view())


# ---- the conformance kit ---------------------------------------------------------------------------
class TestS3(PersistentBackendConformanceTests):
    """Entries live in the bucket, so reopening the backend finds them (persistent)."""

    part_size = 4 << 20
    sealed = False

    @pytest.fixture(autouse=True)
    def _server(self, seaweed: SeaweedServer, tmp_path: Path) -> None:
        self.server = seaweed
        self.prefix = f"c{uuid.uuid4().hex[:12]}"
        self.key_file: str | None = None
        if self.sealed:
            self.key_file = str(tmp_path / "key")
            write_key_file(self.key_file)

    def make_config(self) -> LMCacheEngineConfig:
        return LMCacheEngineConfig.from_defaults(**self.server.config(), encryption_key_file=self.key_file)

    async def make_backend(self, ctx: BackendContext, location: Path) -> RemoteBackend:
        return RemoteBackend(ctx, self.server.url("kit"), prefix=self.prefix, part_size=self.part_size, timeout_s=30.0)

    def _records(self) -> dict[str, bytes]:
        cipher = load_cipher(self.key_file) if self.key_file else None
        return records(self.server, f"kit/{self.prefix}", cipher)

    def medium_keys(self, backend: StorageBackend, location: Path) -> set[str] | None:
        return set(self._records())

    def medium_bytes(self, backend: StorageBackend, location: Path, key: str) -> bytes | None:
        return self._records().get(key)

    def medium_items(self, backend: StorageBackend, location: Path) -> dict[str, bytes] | None:
        return self._records()


class TestS3SmallRanges(TestS3):
    """64 KiB parts and ranged GETs for every object: most entries of the suite are read in
    several concurrent ranged GETs."""

    part_size = 64 << 10

    @pytest.fixture(autouse=True)
    def _small_first_read(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(s3_connector, "WHOLE_GET_MAX", 0)


class TestS3Sealed(TestS3SmallRanges):
    """Records sealed under a key file; 64 KiB parts make most of them several segments, each
    read and opened alone."""

    sealed = True


# ---- tier specifics ---------------------------------------------------------------------------------
@pytest.fixture
def src_pool() -> PoolAllocator:
    return PoolAllocator(96 << 20, name="s3-src", pretouch=False)


@pytest.fixture
async def open_backend(make_ctx: Any, prefix: str) -> AsyncIterator[Callable[..., Any]]:
    """``await open_backend(srv, **config)``: a started s3:// RemoteBackend closed after the test."""
    made: list[RemoteBackend] = []

    async def make(srv: SeaweedServer, part_size: int = 4 << 20, timeout_s: float = 30.0, **cfg: Any) -> RemoteBackend:
        be = RemoteBackend(make_ctx(**srv.config(), **cfg), srv.url("t"), prefix=prefix, part_size=part_size,
                           timeout_s=timeout_s)  # fmt: skip
        made.append(be)
        await be.start()
        return be

    yield make
    for be in made:
        await be.close()


def key_file(tmp_path: Path, name: str = "key") -> str:
    path = str(tmp_path / name)
    write_key_file(path)
    return path


async def _stored(be: RemoteBackend, src_pool: PoolAllocator, i: int, size: int = 64 << 10) -> MemoryObj:
    src = make_obj(src_pool, seed=i, shape=(size // 4,), dtype=torch.float32)
    assert await be.put(make_key(i), src)
    return src


def _path(be: RemoteBackend, i: int) -> str:
    return f"t/{be.entry_name(make_key(i)).relpath}"


async def test_one_object_per_entry_named_by_prefix_model_and_digest(
    seaweed: SeaweedServer, open_backend: Any, src_pool: PoolAllocator, prefix: str
) -> None:
    be = await open_backend(seaweed)
    for i in range(3):
        (await _stored(be, src_pool, i, 6 << 20)).ref_count_down()  # above the 5 MiB multipart part
    names = set(objects(seaweed, f"t/{prefix}"))
    assert names == {_path(be, i) for i in range(3)}
    got = await be.get(make_key(1))
    assert got is not None and got.nbytes == 6 << 20
    got.ref_count_down()


async def test_entries_of_every_size_read_in_ranges_round_trip(
    seaweed: SeaweedServer, open_backend: Any, src_pool: PoolAllocator, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(s3_connector, "WHOLE_GET_MAX", 0)
    be = await open_backend(seaweed, part_size=100_000)
    for i, size in enumerate([4, 99_996, 100_000, 100_004, 1 << 20, (5 << 20) + 4]):
        src = make_obj(src_pool, seed=i, shape=(size // 4,), dtype=torch.float32)
        assert await be.put(make_key(i), src)
        got = await be.get(make_key(i))
        assert got is not None and same(got, src), size
        got.ref_count_down()
        src.ref_count_down()


async def test_garbage_over_an_object_is_a_counted_miss_and_removed(
    seaweed: SeaweedServer, open_backend: Any, src_pool: PoolAllocator
) -> None:
    be = await open_backend(seaweed)
    src = await _stored(be, src_pool, 1)
    store = raw_store(seaweed)
    obstore.put(store, _path(be, 1), os.urandom(70_000))
    assert await be.get(make_key(1)) is None
    assert be.stats()["corrupt"] == 1
    assert _path(be, 1) not in objects(seaweed, "t")
    assert await be.put(make_key(1), src)  # stored again
    got = await be.get(make_key(1))
    assert got is not None and same(got, src)
    got.ref_count_down()
    src.ref_count_down()


@pytest.mark.parametrize("where", ["header", "payload", "last byte"])
async def test_a_flipped_byte_is_a_counted_miss_and_removed(
    seaweed: SeaweedServer, open_backend: Any, src_pool: PoolAllocator, where: str
) -> None:
    be = await open_backend(seaweed, part_size=16 << 10)
    src = await _stored(be, src_pool, 2)
    store = raw_store(seaweed)
    data = bytearray(obstore.get(store, _path(be, 2)).bytes())
    pos = {"header": 20, "payload": len(data) // 2, "last byte": len(data) - 1}[where]
    data[pos] ^= 0x40
    obstore.put(store, _path(be, 2), bytes(data))
    assert await be.get(make_key(2)) is None
    assert be.stats()["corrupt"] == 1
    assert not (await be.batched_contains([make_key(2)]))[0]
    src.ref_count_down()


async def test_truncated_and_extended_objects_are_misses(
    seaweed: SeaweedServer, open_backend: Any, src_pool: PoolAllocator
) -> None:
    be = await open_backend(seaweed)
    store = raw_store(seaweed)
    for i, change in enumerate([lambda d: d[: len(d) // 2], lambda d: d + b"junk"], start=3):
        src = await _stored(be, src_pool, i)
        data = bytes(obstore.get(store, _path(be, i)).bytes())
        obstore.put(store, _path(be, i), change(data))
        assert await be.get(make_key(i)) is None
        src.ref_count_down()
    assert be.stats()["corrupt"] == 2


async def test_a_record_of_another_key_is_a_miss_and_kept(
    seaweed: SeaweedServer, open_backend: Any, src_pool: PoolAllocator
) -> None:
    be = await open_backend(seaweed)
    src = await _stored(be, src_pool, 8)
    store = raw_store(seaweed)
    obstore.put(store, _path(be, 9), bytes(obstore.get(store, _path(be, 8)).bytes()))  # as if digests collided
    assert await be.get(make_key(9)) is None
    assert be.stats()["foreign"] == 1
    assert _path(be, 9) in objects(seaweed, "t")
    src.ref_count_down()


async def test_batched_contains_answers_every_key_with_concurrent_heads(
    seaweed: SeaweedServer, open_backend: Any, src_pool: PoolAllocator
) -> None:
    be = await open_backend(seaweed, s3_max_concurrency=4)
    srcs = [await _stored(be, src_pool, i, 4096) for i in range(0, 40, 2)]
    before = be.stats()["requests"]
    flags = await be.batched_contains([make_key(i) for i in range(40)])
    assert flags == [i % 2 == 0 for i in range(40)]
    assert be.stats()["requests"] - before == 40  # one HEAD per key
    for s in srcs:
        s.ref_count_down()


async def test_cancelled_puts_publish_whole_entries_or_nothing(
    seaweed: SeaweedServer, open_backend: Any, src_pool: PoolAllocator
) -> None:
    be = await open_backend(seaweed)
    srcs = [make_obj(src_pool, seed=i, shape=((2 << 20) // 4,), dtype=torch.float32) for i in range(6)]
    tasks = [asyncio.ensure_future(be.put(make_key(i), s)) for i, s in enumerate(srcs)]
    await asyncio.sleep(0.01)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for s in srcs:
        s.ref_count_down()  # the pool block may be reused now: no upload may read it any more
    junk = make_obj(src_pool, seed=99, shape=((2 << 20) // 4,), dtype=torch.float32)
    await asyncio.sleep(0.5)
    for i in range(6):
        got = await be.get(make_key(i))
        if got is not None:
            ref = make_obj(src_pool, seed=i, shape=((2 << 20) // 4,), dtype=torch.float32)
            assert same(got, ref)
            ref.ref_count_down()
            got.ref_count_down()
    junk.ref_count_down()


async def test_ttl_expires_entries_by_last_modified(
    seaweed: SeaweedServer, open_backend: Any, src_pool: PoolAllocator, make_ctx: Any, prefix: str
) -> None:
    cfg = seaweed.config()
    be = RemoteBackend(make_ctx(**cfg), seaweed.url("t"), prefix=prefix, ttl_s=1.0, timeout_s=30.0)
    try:
        src = await _stored(be, src_pool, 4, 4096)
        assert (await be.batched_contains([make_key(4)]))[0]
        await asyncio.sleep(2.2)
        assert not (await be.batched_contains([make_key(4)]))[0]
        assert await be.get(make_key(4)) is None
        assert be.stats()["expired"] == 1
        src.ref_count_down()
    finally:
        await be.close()


# ---- encryption -------------------------------------------------------------------------------------
async def test_sealed_objects_hold_no_plaintext_of_the_tensor(
    seaweed: SeaweedServer, open_backend: Any, src_pool: PoolAllocator, tmp_path: Path, prefix: str
) -> None:
    be = await open_backend(seaweed, part_size=64 << 10, encryption_key_file=key_file(tmp_path))
    srcs = [await _stored(be, src_pool, i, 256 << 10) for i in range(3)]
    stored = objects(seaweed, f"t/{prefix}")
    assert len(stored) == 3
    for s in srcs:
        plain = bytes(s.byte_view())
        for blob in stored.values():
            for off in range(0, len(plain) - 32, 4096):  # any 32 bytes of the tensor
                assert plain[off : off + 32] not in blob
        s.ref_count_down()


async def test_a_record_under_another_key_file_is_a_miss_and_stays(
    seaweed: SeaweedServer, open_backend: Any, src_pool: PoolAllocator, tmp_path: Path, prefix: str
) -> None:
    writer = await open_backend(seaweed, encryption_key_file=key_file(tmp_path, "a"))
    src = await _stored(writer, src_pool, 5)
    other = await open_backend(seaweed, encryption_key_file=key_file(tmp_path, "b"))
    plain = await open_backend(seaweed)
    assert await other.get(make_key(5)) is None
    assert await plain.get(make_key(5)) is None
    assert other.stats()["foreign_key"] == 1 and plain.stats()["foreign_key"] == 1
    assert other.stats()["corrupt"] == 0
    assert _path(writer, 5) in objects(seaweed, f"t/{prefix}")
    got = await writer.get(make_key(5))  # the writer's key still opens it
    assert got is not None and same(got, src)
    got.ref_count_down()
    src.ref_count_down()


@pytest.mark.parametrize("ranged", [False, True])
async def test_a_sealed_record_with_a_flipped_byte_is_a_miss_and_goes(
    seaweed: SeaweedServer, open_backend: Any, src_pool: PoolAllocator, tmp_path: Path, prefix: str,
    monkeypatch: pytest.MonkeyPatch, ranged: bool,
) -> None:  # fmt: skip
    if ranged:  # each segment comes in a GET of its own and is opened alone
        monkeypatch.setattr(s3_connector, "WHOLE_GET_MAX", 0)
    be = await open_backend(seaweed, part_size=16 << 10, encryption_key_file=key_file(tmp_path))
    src = await _stored(be, src_pool, 6)
    store = raw_store(seaweed)
    data = bytearray(obstore.get(store, _path(be, 6)).bytes())
    data[len(data) // 2] ^= 1
    # keep the xxh3 right, so only the authentication tag can tell
    from lmcache_async.records import decode_header, encode_header, payload_checksum

    hdr = decode_header(bytes(data))
    body = memoryview(data)[hdr.header_len :]
    head = encode_header(hdr.key, hdr.shape, hdr.dtype, hdr.fmt, payload_checksum(body), seal=hdr.seal)
    obstore.put(store, _path(be, 6), head + bytes(body))
    assert await be.get(make_key(6)) is None
    assert be.stats()["corrupt"] == 1
    assert _path(be, 6) not in objects(seaweed, f"t/{prefix}")
    src.ref_count_down()


def test_a_key_file_readable_by_others_is_refused(tmp_path: Path) -> None:
    path = key_file(tmp_path)
    os.chmod(path, 0o640)
    with pytest.raises(ValueError, match="encryption_key_file"):
        load_cipher(path)
    with pytest.raises(FileExistsError):
        write_key_file(path)
    assert isinstance(load_cipher(key_file(tmp_path, "ok")), RecordCipher)


# ---- failures of the server, through the manager ---------------------------------------------------
@pytest.mark.chaos
def test_killed_server_gives_misses_then_the_tier_recovers_after_a_restart(
    own_seaweed: SeaweedServer, make_manager: Callable[..., StorageManager], prefix: str,
    record_property: Callable[[str, object], None],
) -> None:  # fmt: skip
    sm = make_manager(**own_seaweed.config("m"), remote_timeout_s=1.0, remote_key_prefix=prefix, local_cpu=False)
    k = make_key(1)
    assert sm.put_sync(k, _tensor(1))
    sm.flush_sync(30)
    got = sm.get_sync(k)
    assert got is not None
    got.ref_count_down()
    own_seaweed.kill()
    for i in range(4):
        assert sm.get_sync(make_key(100 + i)) is None
        assert sm.contains_sync(make_key(100 + i)) is False
    assert sm.put_sync(make_key(200), _tensor(200))  # accepted; its write-through fails quietly
    sm.flush_sync(30)
    remote = sm.stats()["tiers"]["remote"]
    assert remote["errors"] + remote["skipped"] + remote["timeouts"] > 0
    t0 = time.monotonic()
    own_seaweed.restart()
    up = time.monotonic() - t0
    wait_recovered(sm, 300, pause_s=0.1)
    recovered = time.monotonic() - t0
    record_property("server_restart_s", round(up, 2))
    record_property("tier_recovered_after_restart_s", round(recovered, 2))
    print(f"\nS3 server restart took {up:.2f} s; the tier served hits again {recovered:.2f} s after it began")
    assert sm.stats()["tiers"]["remote"]["circuit"] == "closed"
    got = sm.get_sync(k)  # written before the kill: SeaweedFS kept it on disk
    assert got is not None
    with got:
        assert torch.equal(got.tensor, _tensor(1))


@pytest.mark.chaos
def test_paused_server_calls_give_misses_then_recover(
    own_seaweed: SeaweedServer, make_manager: Callable[..., StorageManager], prefix: str
) -> None:
    sm = make_manager(**own_seaweed.config("m"), remote_timeout_s=0.5, remote_key_prefix=prefix, local_cpu=False)
    k = make_key(1)
    assert sm.put_sync(k, _tensor(1))
    sm.flush_sync(30)
    own_seaweed.pause()
    try:
        for i in range(4):
            assert sm.get_sync(make_key(10 + i)) is None
            assert sm.contains_sync(make_key(10 + i)) is False
        remote = sm.stats()["tiers"]["remote"]
        assert remote["timeouts"] + remote["skipped"] >= 4
    finally:
        own_seaweed.resume()
    wait_recovered(sm, 50, pause_s=0.1)
    got = sm.get_sync(k)  # written before the pause, still there
    assert got is not None
    with got:
        assert torch.equal(got.tensor, _tensor(1))


def test_two_managers_share_entries_through_one_bucket(
    seaweed: SeaweedServer, make_manager: Callable[..., StorageManager], prefix: str, tmp_path: Path
) -> None:
    kf = key_file(tmp_path)
    cfg = dict(seaweed.config("m"), remote_key_prefix=prefix, local_cpu=False, encryption_key_file=kf)
    a, b = make_manager(**cfg), make_manager(**cfg)
    t = _tensor(7)
    assert a.put_sync(make_key(7), t)
    a.flush_sync(30)
    got = b.get_sync(make_key(7))
    assert got is not None
    with got:
        assert torch.equal(got.tensor, t)


async def test_no_memory_for_a_read_is_a_counted_miss(
    seaweed: SeaweedServer, open_backend: Any, src_pool: PoolAllocator
) -> None:
    be = await open_backend(seaweed)
    src = await _stored(be, src_pool, 30, 4096)
    assert await be.get(make_key(30), lambda *_a: None) is None
    assert be.stats()["alloc_failed"] == 1
    got = await be.get(make_key(30))
    assert got is not None and same(got, src)
    got.ref_count_down()
    src.ref_count_down()
