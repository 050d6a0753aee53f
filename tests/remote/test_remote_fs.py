"""fs:// specifics: atomic publish, verification of files, sharing, TTL and write failures."""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from lmcache_async import StorageManager
from lmcache_async.memory import MemoryObj, PoolAllocator
from lmcache_async.remote import RemoteBackend
from lmcache_async.testing import make_key, make_obj
from lmcache_async.tiers import UNKNOWN


def same(a: MemoryObj, b: MemoryObj) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bytes(a.byte_view()) == bytes(b.byte_view())


@pytest.fixture
def src_pool() -> PoolAllocator:
    return PoolAllocator(32 << 20, name="fs-src", pretouch=False)


@pytest.fixture
async def open_fs(make_ctx: Any, fs_root: str) -> AsyncIterator[Callable[..., Any]]:
    made: list[RemoteBackend] = []

    async def make(**kw: Any) -> RemoteBackend:
        query = kw.pop("query", "")
        be = RemoteBackend(make_ctx(), f"fs://{fs_root}{query}", prefix=kw.pop("prefix", "fs"), **kw)
        made.append(be)
        await be.start()
        return be

    yield make
    for be in made:
        await be.close()


def record_path(be: RemoteBackend, i: int) -> Path:
    conn: Any = be.connector
    return Path(conn.root) / be.entry_name(make_key(i)).relpath


async def test_put_publishes_one_record_file_and_no_temporaries(
    open_fs: Any, fs_root: str, src_pool: PoolAllocator
) -> None:
    be = await open_fs(query="?fsync=full")
    src = make_obj(src_pool, seed=1)
    assert await be.put(make_key(1), src)
    files = [p for p in Path(fs_root).rglob("*") if p.is_file()]
    assert files == [record_path(be, 1)]
    assert be.supports_delete and be.shared and be.persistent and be.is_remote
    assert be.contains_nowait(make_key(1)) is UNKNOWN  # a network filesystem may block: ask the loop
    src.ref_count_down()


async def test_corrupt_file_is_a_counted_miss_and_removed(open_fs: Any, src_pool: PoolAllocator) -> None:
    be = await open_fs()
    src = make_obj(src_pool, seed=2)
    await be.put(make_key(2), src)
    path = record_path(be, 2)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    assert await be.get(make_key(2)) is None
    assert be.stats()["corrupt"] == 1 and not path.exists()
    src.ref_count_down()


async def test_truncated_file_is_a_counted_miss_and_removed(open_fs: Any, src_pool: PoolAllocator) -> None:
    be = await open_fs()
    src = make_obj(src_pool, seed=3)
    await be.put(make_key(3), src)
    path = record_path(be, 3)
    os.truncate(path, path.stat().st_size // 2)
    assert await be.get(make_key(3)) is None
    assert be.stats()["corrupt"] == 1 and not path.exists()
    src.ref_count_down()


async def test_file_of_another_key_is_a_counted_miss_and_removed(open_fs: Any, src_pool: PoolAllocator) -> None:
    be = await open_fs()
    src = make_obj(src_pool, seed=4)
    await be.put(make_key(4), src)
    other = record_path(be, 5)
    other.parent.mkdir(parents=True, exist_ok=True)
    other.write_bytes(record_path(be, 4).read_bytes())  # as if the digests collided
    assert await be.get(make_key(5)) is None
    assert be.stats()["foreign"] == 1 and not other.exists()
    assert record_path(be, 4).exists()
    src.ref_count_down()


async def test_swapped_record_files_are_removed_and_the_keys_can_be_stored_again(
    open_fs: Any, src_pool: PoolAllocator
) -> None:
    be = await open_fs()
    objs = {i: make_obj(src_pool, seed=i) for i in (10, 11)}
    for i, o in objs.items():
        assert await be.put(make_key(i), o)
    a, b = record_path(be, 10), record_path(be, 11)
    data_a, data_b = a.read_bytes(), b.read_bytes()
    a.write_bytes(data_b)
    b.write_bytes(data_a)
    assert await be.get(make_key(10)) is None
    assert not a.exists() and be.stats()["foreign"] == 1
    assert await be.put(make_key(10), objs[10])
    got = await be.get(make_key(10))
    assert got is not None and same(got, objs[10])
    got.ref_count_down()
    for o in objs.values():
        o.ref_count_down()


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["flip_last_payload_byte", "truncate", "foreign_record"])
async def test_a_put_over_a_damaged_record_replaces_it(open_fs: Any, src_pool: PoolAllocator, damage: str) -> None:
    be = await open_fs()
    src, other = make_obj(src_pool, seed=20), make_obj(src_pool, seed=21)
    assert await be.put(make_key(20), src)
    assert await be.put(make_key(21), other)
    path = record_path(be, 20)
    if damage == "flip_last_payload_byte":
        _flip_last_byte(path)
    elif damage == "truncate":
        os.truncate(path, path.stat().st_size - 7)
    else:
        path.write_bytes(record_path(be, 21).read_bytes())
    assert await be.put(make_key(20), src)
    got = await be.get(make_key(20))
    assert got is not None and same(got, src)
    got.ref_count_down()
    st = be.stats()
    assert st["foreign" if damage == "foreign_record" else "corrupt"] == 1
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]
    src.ref_count_down()
    other.ref_count_down()


async def test_a_put_over_a_valid_record_keeps_it(open_fs: Any, src_pool: PoolAllocator) -> None:
    be = await open_fs()
    first, second = make_obj(src_pool, seed=22), make_obj(src_pool, seed=23)
    assert await be.put(make_key(22), first)
    ino = record_path(be, 22).stat().st_ino
    assert await be.put(make_key(22), second)  # the first valid writer wins
    assert record_path(be, 22).stat().st_ino == ino
    got = await be.get(make_key(22))
    assert got is not None and same(got, first)
    got.ref_count_down()
    assert be.stats()["corrupt"] == 0
    first.ref_count_down()
    second.ref_count_down()


async def test_a_damaged_record_published_first_by_another_writer_is_replaced(
    open_fs: Any, src_pool: PoolAllocator, monkeypatch: pytest.MonkeyPatch
) -> None:
    be = await open_fs()
    src = make_obj(src_pool, seed=24)
    assert await be.put(make_key(24), src)
    path = record_path(be, 24)
    damaged = bytearray(path.read_bytes())
    damaged[-1] ^= 0xFF
    path.unlink()
    real_link = os.link
    planted: list[str] = []

    def another_writer_first(src_path: Any, dst: Any, *args: Any, **kw: Any) -> None:
        if os.fspath(dst) == os.fspath(path) and not planted:  # between the check and the link
            planted.append(os.fspath(dst))
            path.write_bytes(bytes(damaged))
        real_link(src_path, dst, *args, **kw)

    monkeypatch.setattr(os, "link", another_writer_first)
    assert await be.put(make_key(24), src)
    monkeypatch.undo()
    assert planted
    got = await be.get(make_key(24))
    assert got is not None and same(got, src)
    got.ref_count_down()
    assert be.stats()["corrupt"] == 1
    src.ref_count_down()


async def test_a_record_published_between_the_read_and_the_removal_is_kept(
    open_fs: Any, src_pool: PoolAllocator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader finds a damaged record; before it deletes it, another process deletes it too and
    a writer publishes a fresh, valid record at the same name: that record must stay."""
    from lmcache_async.records import files as record_files

    be = await open_fs()
    src = make_obj(src_pool, seed=25)
    assert await be.put(make_key(25), src)
    path = record_path(be, 25)
    fresh = path.read_bytes()
    _flip_last_byte(path)
    real_read = record_files.read_exact_into
    raced: list[bool] = []

    def read_then_race(fd: int, dst: memoryview, offset: int) -> int:
        got = real_read(fd, dst, offset)
        if not raced:
            raced.append(True)
            path.unlink()  # another reader removed the damaged record ...
            tmp = path.with_name(".fresh.tmp")
            tmp.write_bytes(fresh)
            os.link(tmp, path)  # ... and another writer published a valid one
            tmp.unlink()
        return got

    monkeypatch.setattr(record_files, "read_exact_into", read_then_race)
    assert await be.get(make_key(25)) is None  # what this reader read was damaged
    monkeypatch.undo()
    assert raced and path.exists()
    got = await be.get(make_key(25))
    assert got is not None and same(got, src)
    got.ref_count_down()
    assert be.stats()["corrupt"] == 1
    src.ref_count_down()


async def test_two_backends_share_one_directory(open_fs: Any, src_pool: PoolAllocator) -> None:
    a = await open_fs()
    b = await open_fs()
    objs = [make_obj(src_pool, (32, 32), seed=i) for i in range(4)]
    for i, o in enumerate(objs):
        assert await a.put(make_key(i), o)
    assert await b.batched_contains([make_key(i) for i in range(5)]) == [True] * 4 + [False]
    for i, o in enumerate(objs):
        got = await b.get(make_key(i))
        assert got is not None and same(got, o)
        got.ref_count_down()
        o.ref_count_down()


async def test_ttl_is_honoured_by_file_age(open_fs: Any, src_pool: PoolAllocator) -> None:
    be = await open_fs(ttl_s=60.0)
    src = make_obj(src_pool, seed=6)
    await be.put(make_key(6), src)
    path = record_path(be, 6)
    assert await be.contains(make_key(6))
    old = time.time() - 3600
    os.utime(path, (old, old))
    assert not await be.contains(make_key(6))
    assert await be.get(make_key(6)) is None
    assert be.stats()["expired"] == 1 and not path.exists()
    assert await be.put(make_key(6), src)  # an expired entry can be written again
    assert await be.contains(make_key(6))
    src.ref_count_down()


async def test_clear_reaps_stale_temporaries_but_not_fresh_ones(open_fs: Any, src_pool: PoolAllocator) -> None:
    be = await open_fs()
    src = make_obj(src_pool, seed=7)
    await be.put(make_key(7), src)
    d = record_path(be, 7).parent
    stale, fresh = d / ".x.rec.host.1.aa.tmp", d / ".y.rec.host.2.bb.tmp"
    stale.write_bytes(b"x")
    fresh.write_bytes(b"y")
    old = time.time() - 7200
    os.utime(stale, (old, old))
    await be.clear()
    assert not record_path(be, 7).exists() and not stale.exists() and fresh.exists()
    src.ref_count_down()


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root ignores directory permissions")
async def test_unwritable_directory_makes_put_false_and_counted(
    open_fs: Any, fs_root: str, src_pool: PoolAllocator
) -> None:
    be = await open_fs()
    os.chmod(fs_root, 0o500)
    src = make_obj(src_pool, seed=8)
    try:
        assert await be.put(make_key(8), src) is False
        assert be.stats()["write_errors"] == 1
    finally:
        os.chmod(fs_root, 0o700)
        src.ref_count_down()


async def test_other_io_errors_propagate_to_the_manager(open_fs: Any, src_pool: PoolAllocator) -> None:
    be = await open_fs()
    # A file where the prefix directory belongs: mkdir fails with ENOTDIR, which is not a
    # "full or read-only" condition, so the manager sees the error (and its breaker counts it).
    conn: Any = be.connector
    blocked = Path(conn.root) / "fs"
    blocked.write_bytes(b"not a directory")
    src = make_obj(src_pool, seed=9)
    try:
        with pytest.raises(OSError):
            await be.put(make_key(9), src)
    finally:
        src.ref_count_down()


def test_fs_tier_serves_a_second_manager(fs_root: str, make_manager: Callable[..., StorageManager]) -> None:
    a = make_manager(remote_url=f"fs://{fs_root}", remote_key_prefix="m")
    b = make_manager(remote_url=f"fs://{fs_root}", remote_key_prefix="m")
    t = torch.randn(64, 64)
    assert a.put_sync(make_key(1), t)
    a.flush_sync(30)
    got = b.get_sync(make_key(1))
    assert got is not None
    with got:
        assert torch.equal(got.tensor, t)
