"""The disk tier reports every removal it makes with the key it was given and the reason:
budget evictions (its own entries, entries found by the start-up scan, other processes'
records), files deleted behind its back, damaged records, ``remove`` and ``clear``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import PoolAllocator
from lmcache_async.tiers import RemovalReason

from .disk_testkit import entry_files, key, path_of, put_entry

Report = tuple[str, list[CacheEngineKey], RemovalReason]


def _listen(be: Any) -> list[Report]:
    reports: list[Report] = []
    be.bind_removals(lambda tier, keys, reason: reports.append((tier, list(keys), reason)))
    return reports


def _keys(reports: list[Report], reason: RemovalReason) -> list[CacheEngineKey]:
    return [k for tier, keys, why in reports if why is reason and tier == "disk" for k in keys]


async def _entry_size(make_disk: Any, tmp_path: Path, pool: PoolAllocator) -> int:
    probe = await make_disk(tmp_path / "probe")
    assert await put_entry(probe, pool, 0)
    return os.path.getsize(path_of(probe.root, key(0)))


async def test_every_budget_eviction_is_reported_with_its_key(make_disk: Any, pool: PoolAllocator, tmp_path: Path):
    size = await _entry_size(make_disk, tmp_path, pool)
    be = await make_disk(tmp_path / "d", budget_bytes=4 * size)
    reports = _listen(be)
    for i in range(20):
        assert await put_entry(be, pool, i)
    evicted = _keys(reports, RemovalReason.EVICTED)
    assert be.stats()["evictions"] == 16 == len(evicted)
    assert evicted == [key(i) for i in range(16)]  # LRU order, each key exactly once
    assert all(type(k) is CacheEngineKey for k in evicted)
    on_disk = {p.name for p in entry_files(be.root)}
    assert on_disk == {path_of(be.root, key(i)).name for i in range(16, 20)}
    assert [r for r in reports if r[2] is not RemovalReason.EVICTED] == []


async def test_evictions_of_scanned_and_foreign_records_name_their_keys(
    make_disk: Any, pool: PoolAllocator, tmp_path: Path
):
    """Entries this process never wrote (another process's records it never indexed, or
    records its start-up scan indexed) are named from their record headers."""
    size = await _entry_size(make_disk, tmp_path, pool)
    root = tmp_path / "d"
    be = await make_disk(root, budget_bytes=6 * size)  # an empty directory: indexes nothing
    other = await make_disk(root, budget_bytes=6 * size)
    for i in range(6):
        assert await put_entry(other, pool, i)
    reports = _listen(be)
    assert await put_entry(be, pool, 100)
    foreign = _keys(reports, RemovalReason.EVICTED)
    assert len(foreign) == 1 and foreign[0] in {key(i) for i in range(6)}
    assert not path_of(root, foreign[0]).exists()
    scanned = await make_disk(root, budget_bytes=6 * size)  # its scan indexes all six
    reports = _listen(scanned)
    for i in range(200, 206):
        assert await put_entry(scanned, pool, i)
    evicted = _keys(reports, RemovalReason.EVICTED)
    assert len(evicted) == len(set(evicted)) == scanned.stats()["evictions"] == 6
    before = {key(i) for i in [*range(6), 100]} - set(foreign)
    assert set(evicted) == before
    assert all(not path_of(root, k).exists() for k in evicted)


async def test_vanished_damaged_removed_and_cleared_entries_are_reported(
    make_disk: Any, pool: PoolAllocator, tmp_path: Path
):
    be = await make_disk(tmp_path / "d")
    reports = _listen(be)
    for i in range(6):
        assert await put_entry(be, pool, i)
    path_of(be.root, key(0)).unlink()  # deleted behind the tier's back: a lookup finds it gone
    assert not await be.contains(key(0))
    path_of(be.root, key(1)).unlink()  # ... or a read does
    assert await be.get(key(1)) is None
    with open(path_of(be.root, key(2)), "r+b") as f:  # one payload byte flipped
        f.seek(-3, os.SEEK_END)
        b = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))
    assert await be.get(key(2)) is None
    assert await be.remove(key(3))
    assert _keys(reports, RemovalReason.DELETED) == [key(0), key(1), key(3)]
    assert _keys(reports, RemovalReason.DAMAGED) == [key(2)]
    reports.clear()
    await be.clear()
    assert sorted(_keys(reports, RemovalReason.DELETED), key=str) == [key(4), key(5)]
    assert entry_files(be.root) == []


async def test_a_vanished_file_is_reported_once(make_disk: Any, pool: PoolAllocator, tmp_path: Path):
    be = await make_disk(tmp_path / "d")
    reports = _listen(be)
    assert await put_entry(be, pool, 7)
    path_of(be.root, key(7)).unlink()
    for _ in range(3):
        assert not await be.contains(key(7))
        assert await be.get(key(7)) is None
    assert reports == [("disk", [key(7)], RemovalReason.DELETED)]
