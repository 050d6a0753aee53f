"""Lookups never report a record file deleted behind the tier's back (by hand, by another
process's eviction) as present, even when the index still holds it; the index entry goes and
the budget follows. And the tier says how large an entry it could ever hold."""

from __future__ import annotations

import pytest

from .disk_testkit import dir_bytes, key, path_of, put_entry


async def _lookup(be, how: str, i: int) -> bool | None:
    if how == "contains":
        return await be.contains(key(i))
    if how == "contains_nowait":
        return be.contains_nowait(key(i))
    return (await be.batched_contains([key(j) for j in range(3)]))[i]


@pytest.mark.parametrize("how", ["contains", "contains_nowait", "batched_contains"])
async def test_a_record_deleted_behind_the_tiers_back_is_not_present(make_disk, pool, tmp_path, how):
    be = await make_disk(tmp_path / "d")
    for i in range(3):
        assert await put_entry(be, pool, i)
    assert be.stats()["entries"] == 3
    path_of(be.root, key(1)).unlink()
    assert await _lookup(be, how, 1) is False
    assert await _lookup(be, how, 0) is True
    assert await be.batched_contains([key(j) for j in range(3)]) == [True, False, True]
    assert be.stats()["entries"] == 2 and be.stats()["vanished"] == 1
    await be.flush()  # the accounting repair runs on the executor
    assert be.accounted() == (dir_bytes(be.root), 2)


async def test_a_record_deleted_by_another_instance_is_not_present(make_disk, pool, tmp_path):
    a = await make_disk(tmp_path / "d")
    b = await make_disk(tmp_path / "d")
    assert await put_entry(a, pool, 0)
    got = await b.get(key(0))  # b indexes the entry
    assert got is not None
    got.ref_count_down()
    assert b.stats()["entries"] == 1
    assert await a.remove(key(0))
    assert b.contains_nowait(key(0)) is False
    assert await b.contains(key(0)) is False
    await b.flush()
    assert b.accounted() == a.accounted() == (dir_bytes(a.root), 0)


async def test_a_deleted_record_put_again_is_present(make_disk, pool, tmp_path):
    be = await make_disk(tmp_path / "d")
    assert await put_entry(be, pool, 0)
    path_of(be.root, key(0)).unlink()
    assert be.contains_nowait(key(0)) is False
    assert await put_entry(be, pool, 0)
    assert be.contains_nowait(key(0)) is True
    await be.flush()
    assert be.accounted() == (dir_bytes(be.root), 1)


async def test_max_entry_bytes_is_the_directory_budget(make_disk, tmp_path):
    be = await make_disk(tmp_path / "d", budget_bytes=3 << 20)
    assert be.max_entry_bytes == 3 << 20
