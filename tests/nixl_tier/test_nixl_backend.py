"""The NIXL tier's own rules on real files through the real POSIX plugin: verification of every
record, hand-offs of concurrent single calls, record files kept open between reads and restart
reuse. Capacity is tested in test_nixl_backend_capacity.py; unregistered memory, cancellation, the
loop's responsiveness and the directory's ownership in test_nixl_backend_transfers.py."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from lmcache_async.nixl import transfer as nixl_transfer
from lmcache_async.nixl import work as nixl_work
from lmcache_async.nixl.io import EMPTY_MAGIC, RECORD_SUFFIX, TMP_SUFFIX
from lmcache_async.testing import make_key

from .nixl_backend_support import (
    LAYOUTS,
    MiB,
    _eq,
    _key_files,
    _obj,
    _open,
    _reads_back,
    _record_of,
    _records,
    _settle,
)

pytestmark = pytest.mark.nixl


# ---- verification ------------------------------------------------------------------------------
@pytest.mark.parametrize("pool_size", LAYOUTS)
async def test_corrupted_payload_is_a_counted_miss_and_removed(big_context, tmp_path, fill, pool_size) -> None:
    ctx = big_context()
    be = await _open(ctx, tmp_path, pool_size)
    key = make_key(1)
    src = _obj(ctx, fill, 3 * MiB, 1)
    assert await be.put(key, src)
    path = _record_of(be, key)
    with open(path, "r+b") as f:  # flip one payload byte near the end
        f.seek(os.path.getsize(path) - 10)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    assert await be.get(key) is None
    # Gone when the miss is returned: a restart or another reader never meets it again.
    if pool_size:
        with open(path, "rb") as f:
            assert f.read(8) == EMPTY_MAGIC  # the slot was invalidated for a restart
    else:
        assert not path.exists()
    st = be.stats()
    assert st["corrupt"] == 1 and st["entries"] == 0 and st["bytes"] == 0
    assert not await be.contains(key)
    await _settle(be)
    assert ctx.staging_pool is not None and ctx.staging_pool.used_bytes == 0  # read buffer returned
    src.ref_count_down()
    await be.close()


@pytest.mark.parametrize("pool_size", LAYOUTS)
async def test_truncated_record_is_a_miss(big_context, tmp_path, fill, pool_size) -> None:
    ctx = big_context()
    be = await _open(ctx, tmp_path, pool_size)
    key = make_key(2)
    src = _obj(ctx, fill, MiB, 2)
    assert await be.put(key, src)
    os.truncate(_record_of(be, key), 100)
    assert await be.get(key) is None
    assert be.stats()["corrupt"] == 1 and not await be.contains(key)
    src.ref_count_down()
    await be.close()


async def test_record_of_another_key_is_never_returned(big_context, tmp_path, fill) -> None:
    ctx = big_context()
    be = await _open(ctx, tmp_path)
    a, b = make_key(3), make_key(4)
    oa, ob = _obj(ctx, fill, MiB, 3), _obj(ctx, fill, MiB, 4)
    assert await be.put(a, oa) and await be.put(b, ob)
    shutil.copyfile(_record_of(be, b), _record_of(be, a))  # a's file now holds b's record
    assert await be.get(a) is None
    assert be.stats()["corrupt"] == 1
    got = await be.get(b)
    assert got is not None and _eq(got.tensor, ob.tensor)
    for o in (got, oa, ob):
        o.ref_count_down()
    await be.close()


async def test_vanished_file_is_a_miss(big_context, tmp_path, fill) -> None:
    ctx = big_context()
    be = await _open(ctx, tmp_path)
    key = make_key(5)
    src = _obj(ctx, fill, MiB, 5)
    assert await be.put(key, src)
    _record_of(be, key).unlink()
    assert await be.get(key) is None
    assert be.stats()["read_failures"] == 1 and be.stats()["entries"] == 0
    src.ref_count_down()
    await be.close()


async def test_write_errors_become_false_and_counters(big_context, tmp_path, fill, caplog) -> None:
    ctx = big_context()
    root = tmp_path / "store"
    be = await _open(ctx, root)
    shutil.rmtree(root)  # storage disappears under the tier
    src = _obj(ctx, fill, MiB, 6)
    with caplog.at_level(logging.WARNING):
        results = [await be.put(make_key(100 + i), src) for i in range(5)]
    assert results == [False] * 5
    st = be.stats()
    assert st["write_failures"] == 5 and st["io_errors"] == 5 and st["reserved_bytes"] == 0
    assert len([r for r in caplog.records if "nixl: write" in r.getMessage()]) == 1  # rate-limited
    assert src.get_ref_count() == 1  # the tier kept no reference
    src.ref_count_down()
    await be.close()


# ---- hand-offs ---------------------------------------------------------------------------------
@pytest.mark.parametrize("pool_size", LAYOUTS)
async def test_concurrent_single_calls_share_one_hand_off(big_context, tmp_path, fill, pool_size) -> None:
    """Single puts/gets started in the same loop iteration go to the workers together: one job
    per worker at most, and every caller still gets its own result."""
    ctx = big_context()
    be = await _open(ctx, tmp_path, pool_size=16 if pool_size else 0)
    workers = be.settings.workers
    keys = [make_key(700 + i) for i in range(12)]
    objs = [_obj(ctx, fill, 256 * 1024, 700 + i) for i in range(12)]
    jobs = be.stats()["jobs"]
    assert all(await asyncio.gather(*(be.put(k, o) for k, o in zip(keys, objs, strict=True))))
    assert 1 <= be.stats()["jobs"] - jobs <= workers
    jobs = be.stats()["jobs"]
    got = await asyncio.gather(*(be.get(k) for k in [*keys, make_key(799)]))
    assert 1 <= be.stats()["jobs"] - jobs <= workers
    assert got[-1] is None
    for g, o in zip(got, objs, strict=False):
        assert g is not None and _eq(g.tensor, o.tensor)
        g.ref_count_down()
    jobs = be.stats()["jobs"]
    for k, o in zip(keys, objs, strict=True):  # one at a time: one job each
        g = await be.get(k)
        assert g is not None and _eq(g.tensor, o.tensor)
        g.ref_count_down()
        o.ref_count_down()
    assert be.stats()["jobs"] - jobs == len(keys)
    await be.close()


# ---- kept record files (one file per entry) -------------------------------------------------------
def _fds_under(root: Path) -> int:
    """How many of this process's descriptors name a record file under ``root`` (deleted
    ones included)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(str(root)) and RECORD_SUFFIX in target:
                n += 1
    return n


async def test_record_files_stay_open_for_the_next_read_within_the_cap(
    big_context, tmp_path, fill, monkeypatch
) -> None:
    ctx = big_context()
    be = await _open(ctx, tmp_path)
    layout = _key_files(be)
    layout.open_files._cap = 2
    registered: list[int] = []
    assert be._agent is not None
    real = be._agent.register_target

    def counting(*args, **kwargs):
        registered.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(be._agent, "register_target", counting)
    keys = [make_key(800 + i) for i in range(3)]
    objs = [_obj(ctx, fill, MiB, 800 + i) for i in range(3)]
    for k, o in zip(keys, objs, strict=True):
        assert await be.put(k, o)
    assert len(registered) == 3 and len(layout.open_files) == 2 and _fds_under(tmp_path) == 2
    for k, o in zip(keys[1:], objs[1:], strict=True):  # kept: no open, no registration
        got = await be.get(k)
        assert got is not None and _eq(got.tensor, o.tensor)
        got.ref_count_down()
    assert len(registered) == 3
    got = await be.get(keys[0])  # not kept any more: opened again, and kept
    assert got is not None and _eq(got.tensor, objs[0].tensor)
    got.ref_count_down()
    assert len(registered) == 4 and len(layout.open_files) == 2
    assert await be.remove(keys[0])
    await _settle(be)
    assert len(layout.open_files) == 1 and _fds_under(tmp_path) == 1  # closed with its record
    await be.close()
    assert _fds_under(tmp_path) == 0
    for o in objs:
        o.ref_count_down()


async def test_a_kept_file_damaged_or_deleted_meanwhile_is_a_miss(big_context, tmp_path, fill) -> None:
    ctx = big_context()
    be = await _open(ctx, tmp_path)
    a, b, c = make_key(810), make_key(811), make_key(812)
    objs = [_obj(ctx, fill, MiB, 810 + i) for i in range(3)]
    for k, o in zip((a, b, c), objs, strict=True):
        assert await be.put(k, o)
    assert len(_key_files(be).open_files) == 3
    _record_of(be, a).unlink()  # the kept descriptor still reads the old inode
    with open(_record_of(be, b), "ab") as f:  # garbage appended
        f.write(b"x" * 10)
    path = _record_of(be, c)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # payload bit rot, seen through the kept descriptor (same inode)
    path.write_bytes(bytes(data))
    assert [await be.get(k) for k in (a, b, c)] == [None, None, None]
    st = be.stats()
    assert st["read_failures"] == 3 and st["entries"] == 0
    await _settle(be)
    assert len(_key_files(be).open_files) == 0 and _fds_under(tmp_path) == 0
    await be.close()
    for o in objs:
        o.ref_count_down()


async def test_a_file_kept_by_a_read_is_reopened_for_writing_when_recycled(big_context, tmp_path, fill) -> None:
    ctx = big_context()
    rec = MiB + 4096
    be = await _open(ctx, tmp_path, max_bytes=rec)
    a, b = make_key(820), make_key(821)
    oa, ob = _obj(ctx, fill, MiB, 820), _obj(ctx, fill, MiB, 821)
    assert await be.put(a, oa)
    await be.close()
    be = await _open(ctx, tmp_path, max_bytes=rec)  # after a restart, reads open read-only
    got = await be.get(a)
    assert got is not None and _eq(got.tensor, oa.tensor)
    got.ref_count_down()
    kept = next(iter(_key_files(be).open_files._files.values()))
    assert not kept.writable
    a_location = be._index[a].location
    a_inode = (tmp_path / f"{a_location}{RECORD_SUFFIX}").stat().st_ino
    assert await be.put(b, ob)  # evicts `a`: its file is reused, opened again for writing
    # overwritten in place under its name: same file, no temporary name, no rename
    assert be._index[b].location == a_location
    assert [p.stat().st_ino for p in _records(tmp_path)] == [a_inode]
    await _reads_back(be, b, ob)
    assert be.stats()["evictions"] == 1 and len(_records(tmp_path)) == 1
    await be.close()
    assert _fds_under(tmp_path) == 0
    be = await _open(ctx, tmp_path, max_bytes=rec)  # the restart finds `b` under `a`'s old name
    assert not await be.contains(a)
    await _reads_back(be, b, ob)
    await be.close()
    for o in (oa, ob):
        o.ref_count_down()


async def test_a_recycled_file_deleted_while_kept_open_is_not_written_into(big_context, tmp_path, fill) -> None:
    ctx = big_context()
    be = await _open(ctx, tmp_path, max_bytes=MiB + 4096)
    a, b = make_key(830), make_key(831)
    oa, ob = _obj(ctx, fill, MiB, 830), _obj(ctx, fill, MiB, 831)
    assert await be.put(a, oa)
    _record_of(be, a).unlink()  # removed from outside while the tier keeps it open for writing
    assert await be.put(b, ob)  # evicts `a`: its file is gone, so `b` goes into a new one
    assert _records(tmp_path) == [_record_of(be, b)]
    await _reads_back(be, b, ob)
    await be.close()
    be = await _open(ctx, tmp_path, max_bytes=MiB + 4096)
    await _reads_back(be, b, ob)
    await be.close()
    for o in (oa, ob):
        o.ref_count_down()


async def test_an_in_place_write_zeroes_the_evicted_magic_first(big_context, tmp_path, fill, monkeypatch) -> None:
    # A kill during the write must not leave the evicted key's header in the file: a restart
    # would prefer that newer, torn file over a good copy of the key written meanwhile.
    ctx = big_context()
    be = await _open(ctx, tmp_path, max_bytes=MiB + 4096)
    a, b = make_key(840), make_key(841)
    oa, ob = _obj(ctx, fill, MiB, 840), _obj(ctx, fill, MiB, 841)
    assert await be.put(a, oa)
    a_file = _record_of(be, a)
    magic_when_written: list[bytes] = []
    real_write = nixl_transfer.write_record  # the function the tier's work module imports

    def write(agent, slot, loc, *args, **kwargs) -> None:
        magic_when_written.append(a_file.read_bytes()[:8])
        real_write(agent, slot, loc, *args, **kwargs)

    monkeypatch.setattr(nixl_work, "write_record", write)
    assert await be.put(b, ob)
    assert magic_when_written == [EMPTY_MAGIC]
    assert _record_of(be, b) == a_file  # written in place, under the evicted entry's name
    await be.close()
    for o in (oa, ob):
        o.ref_count_down()


# ---- restart -----------------------------------------------------------------------------------
@pytest.mark.parametrize("pool_size", LAYOUTS)
async def test_restart_reuses_entries_in_lru_order(big_context, tmp_path, fill, pool_size) -> None:
    ctx = big_context()
    be = await _open(ctx, tmp_path, pool_size)
    objs = [_obj(ctx, fill, MiB, i) for i in range(4)]
    keys = [make_key(200 + i) for i in range(4)]
    for k, o in zip(keys, objs, strict=True):
        assert await be.put(k, o)
        time.sleep(0.02)  # distinct modification times (file times tick with the kernel clock)
    await be.close()
    be = await _open(ctx, tmp_path, pool_size)
    assert be.stats()["scanned"] == 4
    assert list(be._index) == keys  # oldest first
    for k, o in zip(keys, objs, strict=True):
        got = await be.get(k)
        assert got is not None and _eq(got.tensor, o.tensor)
        got.ref_count_down()
        o.ref_count_down()
    await be.close()


async def test_restart_with_a_smaller_budget_drops_the_oldest(big_context, tmp_path, fill) -> None:
    ctx = big_context()
    be = await _open(ctx, tmp_path)
    keys = [make_key(300 + i) for i in range(4)]
    for i, k in enumerate(keys):
        o = _obj(ctx, fill, MiB, i)
        assert await be.put(k, o)
        o.ref_count_down()
        time.sleep(0.02)
    await be.close()
    be = await _open(ctx, tmp_path, max_bytes=2 * MiB + 16384)
    # Once started, storage holds what the index says: the dropped files are already gone.
    assert len(_records(tmp_path)) == 2 and be.stats()["bytes"] <= 2 * MiB + 16384
    assert [await be.contains(k) for k in keys] == [False, False, True, True]
    await be.close()


async def test_start_keeps_the_newer_of_two_records_of_a_key(big_context, tmp_path, fill) -> None:
    ctx = big_context()
    key = make_key(310)
    old, new = _obj(ctx, fill, MiB, 1), _obj(ctx, fill, MiB, 2)
    elsewhere, here = tmp_path / "elsewhere", tmp_path / "here"
    for root, obj in ((elsewhere, old), (here, new)):
        be = await _open(ctx, root)
        assert await be.put(key, obj)
        await be.close()
    # An older record of the same key under another name, as a crash between writes can leave.
    stale = here / f"stale-copy{RECORD_SUFFIX}"
    shutil.copyfile(_records(elsewhere)[0], stale)
    t = os.stat(_records(here)[0]).st_mtime - 60
    os.utime(stale, (t, t))
    be = await _open(ctx, here)
    # Once started, the superseded file is already gone and the newer record is served.
    assert not stale.exists() and _records(here) == [_record_of(be, key)]
    assert be.stats()["reaped"] == 1 and be.stats()["entries"] == 1
    await _reads_back(be, key, new)
    for o in (old, new):
        o.ref_count_down()
    await be.close()


async def test_start_removes_leftovers_and_garbage(big_context, tmp_path, fill) -> None:
    ctx = big_context()
    (tmp_path / f"abc.123{TMP_SUFFIX}").write_bytes(b"half-written")
    (tmp_path / f"garbage{RECORD_SUFFIX}").write_bytes(b"not a record" * 100)
    (tmp_path / "unrelated.txt").write_text("left alone")
    be = await _open(ctx, tmp_path)
    assert be.stats()["reaped"] == 2 and be.stats()["entries"] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "unrelated.txt"]
    await be.close()


async def test_manager_restart_reuses_the_nixl_tier(tmp_path, make_manager) -> None:
    kw = {"nixl_path": str(tmp_path), "staging_size": 1 / 16}
    sm = make_manager(**kw)
    assert "nixl" in sm.tier_names
    assert sm.backend("nixl").is_remote
    key = make_key(7, model="test-model")
    t = torch.randn(64, 1024)
    assert sm.put_sync(key, t)
    sm.flush_sync()
    assert sm.stats()["tiers"]["nixl"]["entries"] == 1
    sm.close_sync()
    assert (tmp_path / "kv-0").is_dir()
    sm2 = make_manager(**kw)
    assert sm2.contains_sync(key)
    got = sm2.get_sync(key)
    assert got is not None and _eq(got.tensor, t)
    got.ref_count_down()
    assert sm2.stats()["tiers"]["nixl"]["hits"] == 1
