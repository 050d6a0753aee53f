"""Disk-tier behaviour beyond the conformance suite: layout, LRU by bytes, the shared budget on
every removal path, index rebuild, temporary files, cancellation."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from lmcache_async.disk.budget import DirBudget
from lmcache_async.disk.layout import (
    HOST_TAG,
    NUM_SHARDS,
    key_digest,
    process_start_time,
    tmp_name,
)
from lmcache_async.disk.tier import DiskBackend
from lmcache_async.memory import MemoryFormat, PoolAllocator
from lmcache_async.records import MAGIC, decode_header

from .disk_testkit import dir_bytes, entry_files, key, make_entry, path_of, put_entry, same_bytes, tmp_files

N = 4096  # payload bytes per entry in these tests


def _file_size(be: DiskBackend, nbytes: int = N) -> int:
    return os.path.getsize(entry_files(be.root)[0]) if entry_files(be.root) else nbytes + 128


# ---- layout ----------------------------------------------------------------------------------------
async def test_one_self_describing_file_per_entry_in_a_shard(make_disk, pool, tmp_path):
    be = await make_disk(tmp_path / "d")
    assert await put_entry(be, pool, 1)
    files = entry_files(tmp_path / "d")
    assert files == [path_of(tmp_path / "d", key(1))]
    f = files[0]
    assert f.parent.name == f.name[:2] and len(f.stem) == 32
    data = f.read_bytes()
    assert data.startswith(MAGIC)
    hdr = decode_header(data, expect_key=key(1).to_string())
    assert hdr.shape == (N,) and hdr.dtype == torch.uint8 and hdr.fmt == MemoryFormat.BINARY
    assert len(data) == hdr.total_len


async def test_files_0600_and_directories_0700(make_disk, pool, tmp_path):
    be = await make_disk(tmp_path / "d")
    await put_entry(be, pool, 2)
    f = path_of(tmp_path / "d", key(2))
    assert stat.S_IMODE(f.stat().st_mode) == 0o600
    assert stat.S_IMODE(f.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "d").stat().st_mode) == 0o700


async def test_no_key_names_a_path_outside_the_directory(make_disk, pool, tmp_path):
    root = tmp_path / "deep" / "d"
    be = await make_disk(root)
    for i, model in enumerate(["../../escape", "/abs/olute", "..", "a/../../b", "%2e%2e"]):
        obj = make_entry(pool, i)
        assert await be.put(key(i, model), obj)
        obj.ref_count_down()
    assert not any(p.name not in ("deep",) for p in tmp_path.iterdir())
    assert sorted(p.name for p in (tmp_path / "deep").iterdir()) == ["d"]
    assert len(entry_files(root)) == 5


# ---- LRU and the budget ------------------------------------------------------------------------------
async def test_lru_by_bytes_evicts_least_recently_used(make_disk, pool, tmp_path):
    probe = await make_disk(tmp_path / "probe")
    await put_entry(probe, pool, 0)
    size = _file_size(probe)
    be = await make_disk(tmp_path / "d", budget_bytes=4 * size)
    for i in range(4):
        assert await put_entry(be, pool, i)
    got = await be.get(key(0))  # 0 becomes the most recent
    assert got is not None
    got.ref_count_down()
    assert await put_entry(be, pool, 4)
    present = [await be.contains(key(i)) for i in range(5)]
    assert present == [True, False, True, True, True]
    assert be.stats()["evictions"] == 1
    assert be.accounted() == (dir_bytes(be.root), 4)


async def test_entry_larger_than_budget_is_refused(make_disk, pool, tmp_path):
    be = await make_disk(tmp_path / "d", budget_bytes=N)
    assert await put_entry(be, pool, 1) is False
    assert be.stats()["no_space"] == 1
    assert entry_files(be.root) == [] and tmp_files(be.root) == []


async def test_remove_and_clear_give_the_bytes_back(make_disk, pool, tmp_path):
    be = await make_disk(tmp_path / "d")
    for i in range(6):
        await put_entry(be, pool, i)
    assert be.accounted() == (dir_bytes(be.root), 6)
    assert await be.remove(key(0))
    assert be.accounted() == (dir_bytes(be.root), 5)
    await be.clear()
    assert be.accounted() == (0, 0)
    assert entry_files(be.root) == []
    assert be.stats()["entries"] == 0


async def test_external_deletion_is_noticed_on_read_and_accounted(make_disk, pool, tmp_path):
    be = await make_disk(tmp_path / "d")
    for i in range(3):
        await put_entry(be, pool, i)
    path_of(be.root, key(1)).unlink()
    assert await be.get(key(1)) is None
    assert be.stats()["vanished"] == 1
    assert be.accounted() == (dir_bytes(be.root), 2)


async def test_two_backends_on_one_directory_share_one_budget(make_disk, pool, tmp_path):
    probe = await make_disk(tmp_path / "probe")
    await put_entry(probe, pool, 0)
    size = _file_size(probe)
    a = await make_disk(tmp_path / "d", budget_bytes=5 * size)
    b = await make_disk(tmp_path / "d", budget_bytes=5 * size)
    for i in range(5):
        assert await put_entry(a, pool, i)
    for i in range(100, 108):  # b has not seen a's entries: it evicts its own LRU, then by file age
        assert await put_entry(b, pool, i)
        assert dir_bytes(a.root) <= 5 * size
    assert a.accounted() == b.accounted() == (dir_bytes(a.root), 5)
    assert await b.contains(key(107))


async def test_startup_counts_existing_bytes_and_evicts_down_to_budget(make_disk, pool, tmp_path):
    be = await make_disk(tmp_path / "d")
    for i in range(10):
        await put_entry(be, pool, i)
    size = _file_size(be)
    await be.close()
    small = await make_disk(tmp_path / "d", budget_bytes=4 * size)
    assert len(entry_files(small.root)) == 4
    assert small.accounted() == (4 * size, 4)
    assert small.stats()["bytes"] == dir_bytes(small.root)


async def test_a_crash_between_file_change_and_accounting_is_repaired(make_disk, pool, tmp_path):
    be = await make_disk(tmp_path / "d")
    for i in range(3):
        await put_entry(be, pool, i)
    # What a writer killed mid-change leaves: the shard marked dirty, figures not updated.
    victim = path_of(be.root, key(1))
    budget = DirBudget(be.root)
    with budget.locked() as led:
        led._set_dirty(key_digest(key(1).to_string())[0])
        victim.unlink()
    budget.close()
    other = DirBudget(be.root)
    assert other.snapshot() == (dir_bytes(be.root), 2)
    assert other.recovered_shards == 1
    other.close()


@pytest.mark.parametrize("when", ["before_rename", "after_rename"])
async def test_a_recount_racing_a_publish_is_never_counted_twice(make_disk, pool, tmp_path, monkeypatch, when):
    from lmcache_async.disk import store as disk_store
    from lmcache_async.records import files as record_files

    be = await make_disk(tmp_path / "d")
    await put_entry(be, pool, 1)  # maps the accounting file
    real = record_files.publish_noreplace  # the function the store imports

    def recount(final: str) -> None:  # another process recounting the shard (its start-up scan)
        other = DirBudget(be.root)
        with other.locked() as led:
            led.recount(int(Path(final).parent.name, 16))
        other.close()

    def racing_publish(tmp: str, final: str) -> bool:
        if when == "before_rename":
            recount(final)
        ok = real(tmp, final)
        if when == "after_rename":
            recount(final)
        return ok

    monkeypatch.setattr(disk_store, "publish_noreplace", racing_publish)
    for i in range(2, 6):
        assert await put_entry(be, pool, i)
    assert be.accounted() == (dir_bytes(be.root), 5)


# ---- index and visibility ------------------------------------------------------------------------------
async def test_index_is_rebuilt_from_headers_at_start(make_disk, pool, tmp_path):
    be = await make_disk(tmp_path / "d")
    for i in range(20):
        await put_entry(be, pool, i)
    await be.close()
    again = await make_disk(tmp_path / "d")
    st = again.stats()
    assert st["rebuild_done"] and st["rebuild_entries"] == 20 and st["entries"] == 20
    for i in range(20):
        got = await again.get(key(i))
        assert got is not None and same_bytes(got, i, N)
        got.ref_count_down()


async def test_lookups_answer_while_the_rebuild_runs(make_disk, pool, tmp_path):
    be = await make_disk(tmp_path / "d")
    for i in range(50):
        await put_entry(be, pool, i)
    await be.close()
    again = await make_disk(tmp_path / "d", ready=False)
    assert again.contains_nowait(key(7))
    got = await again.get(key(7))
    assert got is not None and same_bytes(got, 7, N)
    got.ref_count_down()
    await again.wait_ready()
    assert again.stats()["entries"] == 50


async def test_a_miss_looks_at_the_file_written_by_another_instance(make_disk, pool, tmp_path):
    reader = await make_disk(tmp_path / "d")  # started before the writer wrote anything
    writer = await make_disk(tmp_path / "d")
    assert not reader.contains_nowait(key(5))
    await put_entry(writer, pool, 5)
    assert reader.contains_nowait(key(5))
    got = await reader.get(key(5))
    assert got is not None and same_bytes(got, 5, N)
    got.ref_count_down()


async def test_concurrent_puts_of_one_key_from_two_instances_leave_one_accounted_file(make_disk, pool, tmp_path):
    a = await make_disk(tmp_path / "d")
    b = await make_disk(tmp_path / "d")
    objs = [make_entry(pool, 9) for _ in range(8)]
    res = await asyncio.gather(*(be.put(key(9), o) for be in (a, b) for o in objs))
    assert all(res)
    for o in objs:
        o.ref_count_down()
    assert len(entry_files(a.root)) == 1 and tmp_files(a.root) == []
    assert a.accounted() == (dir_bytes(a.root), 1)


async def test_contains_nowait_is_safe_from_other_threads(make_disk, pool, tmp_path):
    be = await make_disk(tmp_path / "d")
    for i in range(10):
        await put_entry(be, pool, i)
    answers: list[list[bool]] = [[] for _ in range(4)]

    def worker(out: list[bool]) -> None:
        out.extend(be.contains_nowait(key(i)) for i in range(20))

    threads = [threading.Thread(target=worker, args=(a,)) for a in answers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert answers == [[True] * 10 + [False] * 10] * 4


# ---- temporary files ---------------------------------------------------------------------------------
def _dead_pid() -> tuple[int, int]:
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.2)"])
    start = process_start_time(p.pid) or 0
    p.wait(10)
    return p.pid, start


def _write_tmp(root: Path, digest_hex: str, host: str, pid: int, start: int, age_s: float = 0.0) -> Path:
    shard = root / digest_hex[:2]
    shard.mkdir(parents=True, exist_ok=True)
    p = shard / f".{digest_hex}.{host}.{pid}.{start}.0badcafe.tmp"
    p.write_bytes(b"partial")
    if age_s:
        t = time.time() - age_s
        os.utime(p, (t, t))
    return p


async def test_leftover_temp_files_are_reaped_only_when_their_writer_is_gone(make_disk, tmp_path):
    root = tmp_path / "d"
    root.mkdir()
    dead_pid, dead_start = _dead_pid()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live_start = process_start_time(sleeper.pid) or 0
        dead = _write_tmp(root, "aa" * 16, HOST_TAG, dead_pid, dead_start)
        live = _write_tmp(root, "bb" * 16, HOST_TAG, sleeper.pid, live_start)
        live_old = _write_tmp(root, "bc" * 16, HOST_TAG, sleeper.pid, live_start, age_s=7200)
        reused = _write_tmp(root, "cc" * 16, HOST_TAG, sleeper.pid, live_start + 12345)
        (root / "dd").mkdir()
        mine = root / "dd" / tmp_name(bytes.fromhex("dd" * 16))
        mine.write_bytes(b"in flight")
        foreign_new = _write_tmp(root, "ee" * 16, "0f0f0f0f", 1, 1)
        foreign_old = _write_tmp(root, "ef" * 16, "0f0f0f0f", 1, 1, age_s=7200)
        be = await make_disk(root)
        assert not dead.exists() and not reused.exists() and not foreign_old.exists()
        assert live.exists() and live_old.exists() and mine.exists() and foreign_new.exists()
        assert be.stats()["tmp_reaped"] == 3
    finally:
        sleeper.kill()
        sleeper.wait(10)


def test_temp_names_always_carry_the_writer_identity_even_on_first_use_from_many_threads(monkeypatch):
    from lmcache_async.disk import layout as disk_layout
    from lmcache_async.records import files as record_files

    for _ in range(20):
        monkeypatch.setattr(record_files, "_my_pid", -1)  # as in a freshly forked writer
        per_thread: list[list[str]] = [[] for _ in range(4)]

        def make(out: list[str]) -> None:
            out.extend(tmp_name(b"\x01" * 16) for _ in range(50))

        threads = [threading.Thread(target=make, args=(out,)) for out in per_thread]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        names = [n for out in per_thread for n in out]
        parsed = {disk_layout.parse_tmp_name(n) for n in names}
        assert parsed == {(HOST_TAG, os.getpid(), process_start_time(os.getpid()))}
        assert len(set(names)) == len(names) == 200


async def test_an_old_temp_file_of_unknown_form_is_reaped(make_disk, tmp_path):
    root = tmp_path / "d"
    (root / "ab").mkdir(parents=True)
    odd = root / "ab" / f".{'ab' * 16}deadbeef.tmp"
    odd.write_bytes(b"x")
    t = time.time() - 7200
    os.utime(odd, (t, t))
    fresh = root / "ab" / f".{'ab' * 16}cafebabe.tmp"
    fresh.write_bytes(b"x")
    not_ours = root / "ab" / ".editor-swap.tmp"
    not_ours.write_bytes(b"x")
    os.utime(not_ours, (t, t))
    await make_disk(root)
    assert not odd.exists() and fresh.exists() and not_ours.exists()


# ---- cancellation -------------------------------------------------------------------------------------
async def test_cancelled_get_releases_its_buffer_when_the_read_ends(make_disk, pool, tmp_path):
    big = 24 << 20
    src_pool = PoolAllocator(big + (1 << 20), name="big-src", pretouch=False)
    be = await make_disk(tmp_path / "d")
    obj = make_entry(src_pool, 1, big)
    assert await be.put(key(1), obj)
    obj.ref_count_down()
    dest = PoolAllocator(big + (1 << 20), name="dest", pretouch=False)

    def alloc(shape, dtype, fmt):
        return dest.allocate(shape, dtype, fmt)

    for delay in (0.0, 0.001, 0.005, 0.02):
        task = asyncio.ensure_future(be.get(key(1), alloc))
        await asyncio.sleep(delay)
        task.cancel()
        try:
            got = await task
        except asyncio.CancelledError:
            pass
        else:
            assert got is not None
            got.ref_count_down()
        await be.flush()
        assert dest.used_bytes == 0


async def test_cancelled_put_keeps_the_source_alive_and_leaves_no_partial_file(make_disk, pool, tmp_path):
    big = 24 << 20
    src_pool = PoolAllocator(big + (1 << 20), name="big-src", pretouch=False)
    be = await make_disk(tmp_path / "d")
    for i, delay in enumerate((0.0, 0.001, 0.005)):
        obj = make_entry(src_pool, i, big)
        task = asyncio.ensure_future(be.put(key(i), obj))
        await asyncio.sleep(delay)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert obj.get_ref_count() >= 1
        await be.flush()
        assert obj.get_ref_count() == 1
        obj.ref_count_down()
        assert tmp_files(be.root) == []
        got = await be.get(key(i))
        if got is not None:  # the write finished although the caller gave up
            assert same_bytes(got, i, big)
            got.ref_count_down()
    assert be.accounted() == (dir_bytes(be.root), len(entry_files(be.root)))


# ---- misc ---------------------------------------------------------------------------------------------
async def test_caller_mistakes_raise(make_disk, pool, tmp_path):
    be = await make_disk(tmp_path / "d")
    with pytest.raises(TypeError):
        await be.put("not-a-key", make_entry(pool, 1))
    with pytest.raises(TypeError):
        await be.put(key(1), torch.zeros(4))
    with pytest.raises(TypeError):
        await be.get("k")
    with pytest.raises(ValueError):
        DiskBackend(tmp_path / "x", 0, executor=None, staging=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        DiskBackend(tmp_path / "x", 1, executor=None, staging=None, fsync="sometimes")  # type: ignore[arg-type]


async def test_close_is_idempotent_and_later_calls_miss(make_disk, pool, tmp_path):
    be = await make_disk(tmp_path / "d")
    await put_entry(be, pool, 1)
    await be.close()
    await be.close()
    assert await be.get(key(1)) is None
    assert await put_entry(be, pool, 2) is False
    assert len(entry_files(tmp_path / "d")) == 1


def test_every_shard_is_a_two_hex_digit_directory():
    assert NUM_SHARDS == 256
    assert key_digest("a") != key_digest("b") and len(key_digest("a")) == 16
