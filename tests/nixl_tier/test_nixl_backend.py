"""The NIXL tier's own rules on real files through the real POSIX plugin: verification of every
record, restart reuse, capacity and LRU, registered-memory fallbacks, cancellation safety and
a loop that stays responsive during big transfers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import statistics
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from lmcache_async import LMCacheEngineConfig
from lmcache_async.memory import HeapAllocator, MemoryFormat, MemoryObj
from lmcache_async.metadata import LMCacheEngineMetadata
from lmcache_async.nixl import transfer as nixl_transfer
from lmcache_async.nixl import work as nixl_work
from lmcache_async.nixl.io import EMPTY_MAGIC, RECORD_SUFFIX, TMP_SUFFIX, KeyFileLayout, SlotFileLayout
from lmcache_async.nixl.tier import DirectoryInUseError, NixlBackend, NixlSettings, create
from lmcache_async.testing import make_key
from lmcache_async.tiers import BackendContext

pytestmark = pytest.mark.nixl

MiB = 1 << 20
LAYOUTS = [pytest.param(0, id="files"), pytest.param(8, id="slots")]


async def _open(ctx: BackendContext, root: Path, pool_size: int = 0, max_bytes: int = 256 * MiB, **kw) -> NixlBackend:
    be = NixlBackend(ctx, NixlSettings(plugin="POSIX", path=str(root), pool_size=pool_size, max_bytes=max_bytes, **kw))
    await be.start()
    return be


def _records(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.name.endswith(RECORD_SUFFIX))


def _record_of(be: NixlBackend, key) -> Path:
    entry = be._index[key]
    assert be.root is not None
    if isinstance(entry.location, int):
        return be.root / f"slot-{entry.location:06d}{RECORD_SUFFIX}"
    return be.root / f"{entry.location}{RECORD_SUFFIX}"


def _key_files(be: NixlBackend) -> KeyFileLayout:
    """The tier's layout of one file a key (the default: no slot pool, a file path)."""
    layout = be._layout
    assert isinstance(layout, KeyFileLayout)
    return layout


def _slot_of(be: NixlBackend, key) -> int:
    """The slot of ``key`` in a tier with a slot pool."""
    location = be._index[key].location
    assert isinstance(location, int)
    return location


def _eq(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte equality (random bytes may be NaNs as floats)."""
    return a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


async def _reads_back(be: NixlBackend, key, obj: MemoryObj) -> None:
    """``key`` reads back with ``obj``'s bytes (the copy read is given back)."""
    got = await be.get(key)
    assert got is not None and _eq(got.tensor, obj.tensor)
    got.ref_count_down()


async def _settle(be: NixlBackend) -> None:
    while be._tasks:
        await asyncio.gather(*list(be._tasks), return_exceptions=True)


def _obj(ctx: BackendContext, fill, nbytes: int, seed: int) -> MemoryObj:
    assert ctx.pool is not None
    return fill(ctx.pool.allocate((nbytes // 4,), torch.float32, MemoryFormat.KV_2LTD), seed)


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


# ---- capacity ----------------------------------------------------------------------------------
@pytest.mark.parametrize("pool_size", LAYOUTS)
async def test_lru_eviction_is_accounted_on_every_removal(big_context, tmp_path, fill, pool_size) -> None:
    ctx = big_context()
    rec = MiB + 4096  # a 1 MiB payload plus its header, rounded up
    be = await _open(ctx, tmp_path, pool_size, max_bytes=3 * rec)
    keys = [make_key(400 + i) for i in range(5)]
    objs = [_obj(ctx, fill, MiB, i) for i in range(5)]
    for k, o in zip(keys[:3], objs[:3], strict=True):
        assert await be.put(k, o)
    got = await be.get(keys[0])  # touch: keys[1] is now the least recently used
    assert got is not None
    got.ref_count_down()
    assert await be.put(keys[3], objs[3])
    assert [await be.contains(k) for k in keys[:4]] == [True, False, True, True]
    st = be.stats()
    assert st["evictions"] == 1 and st["entries"] == 3
    assert st["bytes"] == sum(e.size for e in be._index.values())
    assert await be.remove(keys[2])
    assert be.stats()["bytes"] == sum(e.size for e in be._index.values())
    await be.clear()
    await _settle(be)
    assert be.stats()["bytes"] == 0 and be.stats()["entries"] == 0
    if pool_size:
        assert be.stats()["free_slots"] == pool_size
    else:
        assert _records(tmp_path) == []
    for o in objs:
        o.ref_count_down()
    await be.close()


async def test_fifo_ignores_reads(big_context, tmp_path, fill) -> None:
    ctx = big_context()
    be = await _open(ctx, tmp_path, max_bytes=2 * (MiB + 4096), policy="FIFO")
    keys = [make_key(450 + i) for i in range(3)]
    for i, k in enumerate(keys):
        if i == 2:
            got = await be.get(keys[0])
            assert got is not None
            got.ref_count_down()
        o = _obj(ctx, fill, MiB, i)
        assert await be.put(k, o)
        o.ref_count_down()
    assert [await be.contains(k) for k in keys] == [False, True, True]
    await be.close()


async def test_slot_pool_exhaustion_evicts_the_oldest(big_context, tmp_path, fill) -> None:
    ctx = big_context()
    be = await _open(ctx, tmp_path, pool_size=2)
    keys = [make_key(500 + i) for i in range(3)]
    for i, k in enumerate(keys):
        o = _obj(ctx, fill, 64 * 1024, i)
        assert await be.put(k, o)
        o.ref_count_down()
    assert [await be.contains(k) for k in keys] == [False, True, True]
    assert be.stats()["evictions"] == 1 and be.stats()["free_slots"] == 0
    await be.close()


def _record_zeroing(monkeypatch, be: NixlBackend) -> list[tuple[int, bool]]:
    """From now on, every slot the tier zeroes: ``(slot, whether on the loop's thread)``."""
    layout = be._layout
    assert isinstance(layout, SlotFileLayout)
    calls: list[tuple[int, bool]] = []
    real_delete = layout.delete
    loop_thread = threading.get_ident()

    def delete(location: str | int) -> None:  # a slot number, as the layout reads it
        calls.append((int(location), threading.get_ident() == loop_thread))
        real_delete(location)

    monkeypatch.setattr(layout, "delete", delete)
    return calls


def _slot_magic(root: Path, slot: int) -> bytes:
    with open(root / f"slot-{slot:06d}{RECORD_SUFFIX}", "rb") as f:
        return f.read(8)


async def test_slots_freed_by_a_put_are_invalidated_by_its_job_off_the_loop(
    big_context, tmp_path, fill, monkeypatch
) -> None:
    """A put that evicts two entries writes into the first victim's slot and invalidates the
    other one on the worker thread (an invalidation may wait for writeback: never on the loop)."""
    ctx = big_context()
    rec = MiB + 4096
    be = await _open(ctx, tmp_path, pool_size=4, max_bytes=2 * rec)
    a, b, c = make_key(520), make_key(521), make_key(522)
    objs = [_obj(ctx, fill, MiB, 520), _obj(ctx, fill, MiB, 521), _obj(ctx, fill, MiB + MiB // 2, 522)]
    assert await be.put(a, objs[0]) and await be.put(b, objs[1])
    slot_a, slot_b = _slot_of(be, a), _slot_of(be, b)
    assert be.stats()["free_slots"] == 2
    invalidated = _record_zeroing(monkeypatch, be)
    assert await be.put(c, objs[2])  # needs both victims' bytes
    monkeypatch.undo()
    assert sorted(loc for loc, _ in invalidated) == sorted([slot_a, slot_b])
    assert not any(on_loop for _, on_loop in invalidated)
    assert be._index[c].location == slot_a
    assert be.stats()["free_slots"] == 3 and be.stats()["evictions"] == 2
    assert _slot_magic(tmp_path, slot_b) == EMPTY_MAGIC
    got = await be.get(c)
    assert got is not None and _eq(got.tensor, objs[2].tensor)
    got.ref_count_down()
    await be.close()
    again = await _open(ctx, tmp_path, pool_size=4, max_bytes=2 * rec)  # a restart finds only `c`
    assert [await again.contains(k) for k in (a, b, c)] == [False, False, True]
    await again.close()
    for o in objs:
        o.ref_count_down()


async def test_removed_slots_are_zeroed_off_the_loop_and_freed_after(big_context, tmp_path, fill, monkeypatch) -> None:
    ctx = big_context()
    be = await _open(ctx, tmp_path, pool_size=2)
    a, b, c = make_key(540), make_key(541), make_key(542)
    objs = [_obj(ctx, fill, 256 * 1024, 540 + i) for i in range(3)]
    assert await be.put(a, objs[0]) and await be.put(b, objs[1])
    slot_a = _slot_of(be, a)
    zeroed = _record_zeroing(monkeypatch, be)
    assert await be.remove(a)
    assert be.stats()["free_slots"] == 0  # not reusable before it was zeroed
    await _settle(be)
    assert [on_loop for _, on_loop in zeroed] == [False] and be.stats()["free_slots"] == 1
    assert _slot_magic(tmp_path, slot_a) == EMPTY_MAGIC
    await be.clear()  # every slot is being zeroed: a put right away waits for that, not fails
    assert await be.put(c, objs[2])
    monkeypatch.undo()
    assert not any(on_loop for _, on_loop in zeroed)
    await _settle(be)
    assert be.stats()["entries"] == 1 and be.stats()["free_slots"] == 1
    await be.close()
    again = await _open(ctx, tmp_path, pool_size=2)
    assert [await again.contains(k) for k in (a, b, c)] == [False, False, True]
    await again.close()
    for o in objs:
        o.ref_count_down()


async def test_failed_write_into_an_evicted_slot_invalidates_and_frees_it(
    big_context, tmp_path, fill, monkeypatch
) -> None:
    ctx = big_context()
    rec = MiB + 4096
    be = await _open(ctx, tmp_path, pool_size=2, max_bytes=2 * rec)
    a, b, c = make_key(530), make_key(531), make_key(532)
    objs = [_obj(ctx, fill, MiB, 530 + i) for i in range(3)]
    assert await be.put(a, objs[0]) and await be.put(b, objs[1])
    monkeypatch.setattr("lmcache_async.nixl.work.write_record", _fail_write)
    assert await be.put(c, objs[2]) is False  # evicted `a`, then the write failed
    monkeypatch.undo()
    await _settle(be)
    assert be.stats()["free_slots"] == 1 and be.stats()["entries"] == 1
    assert await be.put(c, objs[2])  # the slot is usable again
    await be.close()
    again = await _open(ctx, tmp_path, pool_size=2, max_bytes=2 * rec)
    assert [await again.contains(k) for k in (a, b, c)] == [False, True, True]
    await again.close()
    for o in objs:
        o.ref_count_down()


def _fail_write(*args, **kwargs) -> None:
    raise OSError("injected write failure")


async def test_entry_being_read_is_never_evicted(big_context, tmp_path, fill) -> None:
    ctx = big_context()
    be = await _open(ctx, tmp_path, max_bytes=2 * (8 * MiB + 4096))
    a, b, c = make_key(600), make_key(601), make_key(602)
    oa, ob, oc = (_obj(ctx, fill, 8 * MiB, i) for i in range(3))
    assert await be.put(a, oa) and await be.put(b, ob)
    reader = asyncio.ensure_future(be.get(a))
    await asyncio.sleep(0)  # the read has pinned `a`
    assert be._index[a].readers == 1
    assert await be.put(c, oc)  # needs room: evicts `b`, not the entry being read
    assert await be.contains(a) and not await be.contains(b)
    got = await reader
    assert got is not None and _eq(got.tensor, oa.tensor)
    for o in (got, oa, ob, oc):
        o.ref_count_down()
    await be.close()


async def test_entry_larger_than_the_budget_is_refused(big_context, tmp_path, fill) -> None:
    ctx = big_context()
    be = await _open(ctx, tmp_path, max_bytes=MiB)
    o = _obj(ctx, fill, 2 * MiB, 0)
    assert await be.put(make_key(700), o) is False
    assert be.stats()["too_large"] == 1
    o.ref_count_down()
    await be.close()


# ---- memory that is not registered ---------------------------------------------------------------
async def test_unregistered_source_and_destination_go_through_the_bounce_area(big_context, tmp_path, fill) -> None:
    ctx = big_context()
    ctx.staging_pool = None  # the tier then has nothing registered to stage reads in but the pool
    heap = HeapAllocator("test-heap")
    be = await _open(ctx, tmp_path)
    src = fill(heap.allocate((9 * MiB // 4,), torch.float32, MemoryFormat.HS_TD), 9)  # > one piece
    key = make_key(800)
    assert await be.put(key, src)

    def heap_alloc(shape: Sequence[int], dtype: torch.dtype, fmt: MemoryFormat) -> MemoryObj | None:
        return heap.allocate(shape, dtype, fmt)

    got = await be.get(key, heap_alloc)
    assert got is not None and got.allocator is heap and _eq(got.tensor, src.tensor)
    assert be.stats()["bounced"] == 2
    got.ref_count_down()
    src.ref_count_down()
    await be.close()


async def test_unregistered_read_buffer_is_swapped_for_staging(big_context, tmp_path, fill) -> None:
    ctx = big_context()
    heap = HeapAllocator("test-heap")
    be = await _open(ctx, tmp_path)
    key = make_key(801)
    src = _obj(ctx, fill, MiB, 1)
    assert await be.put(key, src)
    got = await be.get(key, lambda s, d, f: heap.allocate(s, d, f))
    assert got is not None and got.allocator is ctx.staging_pool
    assert heap.used_bytes == 0 and be.stats()["bounced"] == 0
    got.ref_count_down()
    src.ref_count_down()
    await be.close()


# ---- cancellation ----------------------------------------------------------------------------------
async def test_cancelled_get_releases_its_buffer_only_after_the_transfer(big_context, tmp_path, fill) -> None:
    ctx = big_context()
    be = await _open(ctx, tmp_path)
    key = make_key(900)
    src = _obj(ctx, fill, 64 * MiB, 1)
    assert await be.put(key, src)
    assert ctx.pool is not None
    used = ctx.pool.used_bytes
    for _ in range(5):
        try:
            got = await asyncio.wait_for(be.get(key, lambda s, d, f: ctx.pool.allocate(s, d, f)), 0.001)
        except TimeoutError:
            continue
        assert got is not None
        got.ref_count_down()
    await _settle(be)
    assert ctx.pool.used_bytes == used  # every read buffer came back, none while being written
    assert be._index[key].readers == 0
    src.ref_count_down()
    await be.close()


async def test_cancelled_put_still_writes_the_original_bytes(big_context, tmp_path, fill) -> None:
    ctx = big_context()
    be = await _open(ctx, tmp_path)
    key = make_key(901)
    src = _obj(ctx, fill, 64 * MiB, 2)
    expect = src.tensor.clone()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(be.put(key, src), 0.0005)
    src.ref_count_down()  # the caller gives its reference back at once
    other = _obj(ctx, fill, 64 * MiB, 3)  # reuses free pool memory, never the block being written
    await _settle(be)
    got = await be.get(key)
    assert got is not None and _eq(got.tensor, expect)
    got.ref_count_down()
    other.ref_count_down()
    await be.close()


# ---- the loop stays responsive -----------------------------------------------------------------------
@pytest.mark.parametrize("op", ["put", "get"])
async def test_loop_answers_contains_during_a_256_mib_transfer(big_context, tmp_path, fill, op) -> None:
    ctx = big_context(pool_mib=576)
    be = await _open(ctx, tmp_path, max_bytes=1024 * MiB)
    big = make_key(1000)
    src = _obj(ctx, fill, 256 * MiB, 1)
    probe = make_key(1001)
    small = _obj(ctx, fill, 4096, 2)
    assert await be.put(probe, small)
    work: asyncio.Future[MemoryObj | bool | None]
    if op == "get":
        assert await be.put(big, src)
        work = asyncio.ensure_future(be.get(big, lambda s, d, f: ctx.pool.allocate(s, d, f)))
    else:
        work = asyncio.ensure_future(be.put(big, src))
    await asyncio.sleep(0)
    latencies: list[float] = []
    while not work.done():
        t0 = time.perf_counter()
        assert await be.contains(probe)
        latencies.append(time.perf_counter() - t0)
        await asyncio.sleep(0.001)
    result = await work
    # Run on the loop, the transfer would end before a second contains were asked.
    assert len(latencies) >= 3, "the transfer ended before contains could be asked"
    # Run on the loop in pieces, every answer would wait for a piece. A preemption of the loop
    # thread (2 cores, busy workers) may delay a few answers: the bound is on the 90th
    # percentile; the worst only has to stay far from a stall.
    latencies.sort()
    p90, worst, median = latencies[int(0.9 * (len(latencies) - 1))], latencies[-1], statistics.median(latencies)
    assert p90 < 0.005, f"90% of contains within {p90 * 1e3:.2f} ms (median {median * 1e6:.0f} µs)"
    assert worst < 0.1, f"contains took {worst * 1e3:.2f} ms"
    if isinstance(result, MemoryObj):
        assert _eq(result.tensor, src.tensor)
        result.ref_count_down()
    else:
        assert result is True
    src.ref_count_down()
    small.ref_count_down()
    await be.close()


# ---- ownership of the directory ---------------------------------------------------------------------
async def test_a_directory_serves_one_tier_at_a_time(big_context, tmp_path) -> None:
    ctx = big_context()
    be = await _open(ctx, tmp_path)
    with pytest.raises(DirectoryInUseError, match=str(os.getpid())):
        NixlBackend(ctx, NixlSettings(plugin="POSIX", path=str(tmp_path)))
    await be.close()
    again = await _open(ctx, tmp_path)  # released on close
    await again.close()


async def test_factory_leaves_the_tier_out_when_the_directory_is_taken(tmp_path, caplog) -> None:
    import concurrent.futures

    from lmcache_async.memory import PoolAllocator

    pool = PoolAllocator(16 * MiB, name="p", pretouch=False)
    ex = concurrent.futures.ThreadPoolExecutor(1)
    ctx = BackendContext(
        config=LMCacheEngineConfig.from_defaults(nixl_path=str(tmp_path)),
        metadata=LMCacheEngineMetadata("m"),
        cache_name="kv",
        loop=asyncio.get_running_loop(),
        executor=ex,
        staging=lambda s, d, f: pool.allocate(s, d, f),
        staging_pool=None,
        pool=pool,
    )
    first = create(ctx)
    assert first is not None
    with caplog.at_level(logging.WARNING):
        assert create(ctx) is None
    assert "disabled" in caplog.text
    await first.close()
    ex.shutdown()


async def test_close_is_idempotent_and_later_calls_miss(big_context, tmp_path, fill) -> None:
    ctx = big_context()
    be = await _open(ctx, tmp_path)
    o = _obj(ctx, fill, MiB, 0)
    assert await be.put(make_key(1100), o)
    await be.close()
    await be.close()
    assert await be.put(make_key(1101), o) is False
    assert await be.get(make_key(1100)) is None
    assert await be.contains(make_key(1100)) is False
    assert be.contains_nowait(make_key(1100)) is False
    o.ref_count_down()


async def test_batched_calls_answer_per_key(big_context, tmp_path, fill) -> None:
    ctx = big_context()
    be = await _open(ctx, tmp_path)
    keys = [make_key(1200 + i) for i in range(16)]
    objs = [_obj(ctx, fill, 3 * MiB, i) for i in range(16)]
    assert await be.batched_put(list(zip(keys[::2], objs[::2], strict=True))) == [True] * 8
    got = await be.batched_get(keys)
    for i, g in enumerate(got):
        if i % 2:
            assert g is None
        else:
            assert g is not None and _eq(g.tensor, objs[i].tensor)
            g.ref_count_down()
    assert be.contains_nowait(keys[0]) is True and be.contains_nowait(keys[1]) is False
    for o in objs:
        o.ref_count_down()
    await be.close()


@pytest.mark.parametrize("pool_size", LAYOUTS)
async def test_empty_tensor_round_trips(big_context, tmp_path, pool_size) -> None:
    ctx = big_context()
    be = await _open(ctx, tmp_path, pool_size)
    assert ctx.pool is not None
    src = ctx.pool.allocate((0, 7), torch.bfloat16, MemoryFormat.EC_TD)
    assert src is not None
    assert await be.put(make_key(1300), src)
    got = await be.get(make_key(1300))
    assert got is not None and got.shape == (0, 7) and got.dtype == torch.bfloat16 and got.fmt == MemoryFormat.EC_TD
    got.ref_count_down()
    src.ref_count_down()
    await be.close()
