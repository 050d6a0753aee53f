"""A put of a key whose record file already exists keeps it only when it is a valid record of
that key; a damaged or foreign one is deleted (counted) and replaced, so the put leaves a
readable record — also when the damage happened before a restart, and when two writers race."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest

from lmcache_async.disk import store as disk_store
from lmcache_async.records import files as record_files

from .disk_testkit import dir_bytes, entry_files, key, make_entry, path_of, put_entry, same_bytes

N = 8192


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _damage(mode: str, path: Path, other: Path) -> None:
    if mode == "flip_last_payload_byte":
        _flip(path, path.stat().st_size - 1)
    elif mode == "flip_header":
        _flip(path, 20)
    elif mode == "truncate":
        os.truncate(path, path.stat().st_size - 100)
    elif mode == "trailing_bytes":
        with open(path, "ab") as f:
            f.write(b"junk")
    elif mode == "foreign_record":  # a valid record of another key at this key's name
        shutil.copyfile(other, path)
    else:  # pragma: no cover
        raise AssertionError(mode)


MODES = ["flip_last_payload_byte", "flip_header", "truncate", "trailing_bytes", "foreign_record"]


async def _get_same(be, i: int) -> bool:
    got = await be.get(key(i))
    if got is None:
        return False
    try:
        return same_bytes(got, i, N)
    finally:
        got.ref_count_down()


@pytest.mark.parametrize("mode", MODES)
async def test_a_put_over_a_damaged_record_replaces_it(make_disk, pool, tmp_path, mode):
    be = await make_disk(tmp_path / "d")
    assert await put_entry(be, pool, 0, N)
    assert await put_entry(be, pool, 1, N)
    _damage(mode, path_of(be.root, key(0)), path_of(be.root, key(1)))
    assert await put_entry(be, pool, 0, N)
    assert await _get_same(be, 0)
    assert await _get_same(be, 1)
    assert be.stats()["corrupt"] == 1
    assert be.accounted() == (dir_bytes(be.root), 2)


async def test_a_put_after_a_restart_replaces_a_record_damaged_while_stopped(make_disk, pool, tmp_path):
    first = await make_disk(tmp_path / "d")
    assert await put_entry(first, pool, 0, N)
    await first.close()
    _flip(path_of(first.root, key(0)), path_of(first.root, key(0)).stat().st_size - 1)
    again = await make_disk(tmp_path / "d")  # the start-up scan reads headers only
    assert await put_entry(again, pool, 0, N)
    assert await _get_same(again, 0)
    assert again.stats()["corrupt"] == 1
    assert again.accounted() == (dir_bytes(again.root), 1)


async def test_a_put_over_a_valid_record_keeps_it(make_disk, pool, tmp_path):
    be = await make_disk(tmp_path / "d")
    assert await put_entry(be, pool, 0, N)
    ino = path_of(be.root, key(0)).stat().st_ino
    other = make_entry(pool, 7, N)  # other bytes under the same key: the first valid writer wins
    try:
        assert await be.put(key(0), other)
    finally:
        other.ref_count_down()
    assert path_of(be.root, key(0)).stat().st_ino == ino
    assert await _get_same(be, 0)
    assert be.stats()["stored"] == 1 and be.stats()["corrupt"] == 0
    assert be.accounted() == (dir_bytes(be.root), 1)


async def test_concurrent_puts_over_a_damaged_record_leave_one_valid_accounted_file(make_disk, pool, tmp_path):
    a = await make_disk(tmp_path / "d")
    b = await make_disk(tmp_path / "d")  # another process on the same directory
    assert await put_entry(a, pool, 0, N)
    _damage("flip_last_payload_byte", path_of(a.root, key(0)), path_of(a.root, key(0)))
    oa, ob = make_entry(pool, 0, N), make_entry(pool, 0, N)
    try:
        assert list(await asyncio.gather(a.put(key(0), oa), b.put(key(0), ob))) == [True, True]
    finally:
        oa.ref_count_down()
        ob.ref_count_down()
    assert len(entry_files(a.root)) == 1
    assert await _get_same(a, 0) and await _get_same(b, 0)
    assert a.accounted() == (dir_bytes(a.root), 1)


async def test_a_damaged_record_published_first_by_another_writer_is_replaced(make_disk, pool, tmp_path, monkeypatch):
    be = await make_disk(tmp_path / "d")
    assert await put_entry(be, pool, 1, N)
    damaged = bytearray(path_of(be.root, key(1)).read_bytes())
    damaged[-1] ^= 0xFF  # a record of key 1 with a bad payload, planted at key 0's name below
    real = record_files.publish_noreplace  # the function the store imports
    planted: list[str] = []

    def another_writer_first(tmp: str, final: str) -> bool:
        if not planted:  # between this writer's check and its rename
            planted.append(final)
            Path(final).write_bytes(bytes(damaged))
        return real(tmp, final)

    monkeypatch.setattr(disk_store, "publish_noreplace", another_writer_first)
    assert await put_entry(be, pool, 0, N)
    assert planted == [str(path_of(be.root, key(0)))]
    assert await _get_same(be, 0)
    assert be.stats()["corrupt"] == 1
    assert be.accounted() == (dir_bytes(be.root), 2)
