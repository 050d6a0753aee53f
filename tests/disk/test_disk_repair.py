"""Repairs and races of the disk tier: files deleted behind its back, lookups that cannot tell,
reads racing a removal, accounting that fails after a publish, removals racing a write whose
caller gave up. Real files and real directories throughout; the only hooks wrap real functions
to hold a job at a chosen point."""

from __future__ import annotations

import asyncio
import os
import shutil
import struct
import threading
from pathlib import Path

import pytest

from lmcache_async.disk import store as disk_store
from lmcache_async.disk.layout import ACCT_NAME, key_digest
from lmcache_async.disk.tier import DiskBackend
from lmcache_async.memory import PoolAllocator
from lmcache_async.records import files as record_files
from lmcache_async.tiers import UNKNOWN, Presence

from .disk_testkit import dir_bytes, entry_files, key, make_entry, path_of, put_entry, same_bytes, tmp_files

N = 4096


def _shard_of(i: int) -> int:
    return key_digest(key(i).to_string())[0]


async def _entry_size(make_disk, tmp_path: Path, pool: PoolAllocator) -> int:
    probe = await make_disk(tmp_path / "probe")
    assert await put_entry(probe, pool, 0)
    return os.path.getsize(path_of(probe.root, key(0)))


# ---- files deleted behind the tier's back ----------------------------------------------------------
async def test_writes_go_on_after_every_file_was_deleted_behind_the_tiers_back(make_disk, pool, tmp_path):
    size = await _entry_size(make_disk, tmp_path, pool)
    be = await make_disk(tmp_path / "d", budget_bytes=10 * size)
    for i in range(12):
        assert await put_entry(be, pool, i)
    assert be.accounted() == (10 * size, 10)
    for f in entry_files(be.root):  # rm dir/*/*.lmc
        f.unlink()
    for i in range(100, 110):
        assert await put_entry(be, pool, i), i
    assert sorted(entry_files(be.root)) == sorted(path_of(be.root, key(i)) for i in range(100, 110))
    assert be.accounted() == (dir_bytes(be.root), 10)
    assert be.stats()["no_space"] == 0
    for i in range(100, 110):
        got = await be.get(key(i))
        assert got is not None and same_bytes(got, i, N)
        got.ref_count_down()


async def test_a_process_that_never_indexed_the_deleted_files_repairs_the_budget(make_disk, pool, tmp_path):
    size = await _entry_size(make_disk, tmp_path, pool)
    other = await make_disk(tmp_path / "d", budget_bytes=10 * size)  # indexes nothing: dir empty
    writer = await make_disk(tmp_path / "d", budget_bytes=10 * size)
    for i in range(10):
        assert await put_entry(writer, pool, i)
    await writer.close()
    for f in entry_files(other.root):
        f.unlink()
    for i in range(100, 105):
        assert await put_entry(other, pool, i), i
    assert len(entry_files(other.root)) == 5
    assert other.accounted() == (dir_bytes(other.root), 5)


async def test_eviction_never_deletes_real_entries_to_pay_for_deleted_ones(make_disk, pool, tmp_path):
    size = await _entry_size(make_disk, tmp_path, pool)
    a = await make_disk(tmp_path / "d", budget_bytes=10 * size)
    for i in range(5):
        assert await put_entry(a, pool, i)
    b = await make_disk(tmp_path / "d", budget_bytes=10 * size)  # indexes 0..4 at start
    for i in range(5, 10):
        assert await put_entry(a, pool, i)  # unknown to b
    for i in range(5):
        path_of(a.root, key(i)).unlink()
    for i in range(100, 105):  # fits once the five deleted files are no longer counted
        assert await put_entry(b, pool, i), i
    for i in range(5, 10):
        assert path_of(a.root, key(i)).exists(), i
    assert b.accounted() == (dir_bytes(b.root), 10)


# ---- tri-state lookups ----------------------------------------------------------------------------------
def _loop_shard(root: str, i: int) -> Path:
    """Turn the shard directory of key ``i`` into a symbolic link to itself (ELOOP on lookup)."""
    shard = Path(root) / f"{_shard_of(i):02x}"
    shutil.rmtree(shard)
    os.symlink(shard, shard)
    return shard


async def test_a_lookup_that_fails_is_unknown_not_absent(make_disk, pool, tmp_path):
    be = await make_disk(tmp_path / "d")
    shard = _loop_shard(be.root, 1)
    assert be.contains_nowait(key(1)) is UNKNOWN
    with pytest.raises(OSError):
        await be.contains(key(1))
    with pytest.raises(OSError):
        await be.batched_contains([key(1)])
    shard.unlink()
    shard.write_bytes(b"")  # a file where a shard directory belongs: ENOTDIR, plainly absent
    assert be.contains_nowait(key(1)) is False
    assert await be.contains(key(1)) is False
    await be.close()
    assert be.contains_nowait(key(1)) is UNKNOWN


def test_the_manager_reports_a_failed_disk_lookup_as_unknown_and_counts_it(make_manager, tmp_path):
    sm = make_manager(local_disk=str(tmp_path / "disk"), max_local_disk_size=0.05)
    be = sm.backend("disk")
    assert isinstance(be, DiskBackend)
    sm.loop_thread.run_sync(be.wait_ready(), timeout=30)
    _loop_shard(be.root, 1)
    assert sm.presence_sync(key(1)) is Presence.UNKNOWN
    assert sm.stats()["tiers"]["disk"]["errors"] >= 1


# ---- a read racing a removal ------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["remove", "evict", "behind_its_back"])
async def test_a_read_racing_a_removal_does_not_index_the_removed_entry(make_disk, staging, pool, tmp_path, how):
    size = await _entry_size(make_disk, tmp_path, pool)
    be = await make_disk(tmp_path / "d", budget_bytes=2 * size)
    assert await put_entry(be, pool, 1)
    digest = key_digest(key(1).to_string())

    def alloc(shape, dtype, fmt):  # runs inside the read job, with the file open
        if how == "remove":
            assert be.store.remove(digest)
        elif how == "evict":  # two younger entries push key 1 out of the budget
            for i in (2, 3):
                obj = make_entry(pool, i)
                assert be.store.write(key_digest(key(i).to_string()), key(i).to_string(), obj) == "stored"
                obj.ref_count_down()
        else:
            path_of(be.root, key(1)).unlink()
        return staging(shape, dtype, fmt)

    got = await be.get(key(1), alloc)
    assert got is not None and same_bytes(got, 1, N)  # the file was open: its bytes are good
    got.ref_count_down()
    assert not path_of(be.root, key(1)).exists()
    assert be.contains_nowait(key(1)) is False
    assert await be.contains(key(1)) is False


# ---- accounting that fails after the record was published ------------------------------------------------
async def test_a_publish_whose_accounting_fails_leaves_the_budget_right(make_disk, pool, tmp_path):
    be = await make_disk(tmp_path / "d")
    assert await put_entry(be, pool, 1)
    bad = next(s for s in range(256) if s not in (_shard_of(1), _shard_of(2)))
    shard = Path(be.root) / f"{bad:02x}"
    shutil.rmtree(shard)
    os.symlink(shard, shard)  # recounting this shard fails (ELOOP)
    with open(Path(be.root) / ACCT_NAME, "r+b") as f:  # as a process killed while changing it
        f.seek(12)
        f.write(struct.pack("<i", bad))
    assert not await put_entry(be, pool, 2)  # published, then the lock holder's repair failed
    assert be.stats()["write_errors"] >= 1
    shard.unlink()
    shard.mkdir(mode=0o700)
    assert be.accounted() == (dir_bytes(be.root), len(entry_files(be.root)))
    assert tmp_files(be.root) == []
    assert await put_entry(be, pool, 3)
    assert be.accounted() == (dir_bytes(be.root), len(entry_files(be.root)))


# ---- a removal racing a write whose caller gave up --------------------------------------------------------
@pytest.mark.parametrize("op", ["remove", "clear"])
async def test_remove_after_an_abandoned_put_wins_over_its_late_publish(make_disk, pool, tmp_path, monkeypatch, op):
    be = await make_disk(tmp_path / "d")
    gate = threading.Event()
    entered = threading.Event()
    real = record_files.publish_noreplace  # the function the store imports

    def held_publish(tmp: str, final: str) -> bool:  # a rename stalled on a busy journal
        entered.set()
        assert gate.wait(30)
        return real(tmp, final)

    monkeypatch.setattr(disk_store, "publish_noreplace", held_publish)
    obj = make_entry(pool, 1)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.2):  # the manager's per-tier timeout
            await be.put(key(1), obj)
    obj.ref_count_down()
    assert await asyncio.to_thread(entered.wait, 30)
    rm = asyncio.ensure_future(be.remove(key(1)) if op == "remove" else be.clear())
    await asyncio.sleep(0.05)
    gate.set()
    await rm
    await be.flush()
    assert not path_of(be.root, key(1)).exists()
    assert be.contains_nowait(key(1)) is False
    assert be.accounted() == (0, 0)
