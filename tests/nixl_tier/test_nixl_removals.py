"""The NIXL tier's removal reports (real files through the real POSIX plugin): what it evicts,
deletes (``remove``, ``clear``) or finds damaged reaches a listener bound with
``bind_removals``, once, with its reason, and only once the key is no longer held."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from lmcache_async.encryption import RecordCipher, load_cipher, write_key_file
from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import MemoryFormat, MemoryObj
from lmcache_async.nixl.io import RECORD_SUFFIX
from lmcache_async.nixl.tier import NixlBackend, NixlSettings
from lmcache_async.testing import make_key
from lmcache_async.tiers import BackendContext, RemovalReason

pytestmark = pytest.mark.nixl

MiB = 1 << 20
LAYOUTS = [pytest.param(0, id="files"), pytest.param(8, id="slots")]


class Reports:
    """A listener that records each report and whether the tier still held a reported key at
    the moment of the report (it must not)."""

    def __init__(self, be: NixlBackend) -> None:
        self.be = be
        self.calls: list[tuple[str, list[CacheEngineKey], RemovalReason]] = []
        self.held_when_reported: list[CacheEngineKey] = []
        be.bind_removals(self)

    def __call__(self, tier: str, keys: Sequence[CacheEngineKey], reason: RemovalReason) -> None:
        self.calls.append((tier, list(keys), reason))
        # what a listener asking at once sees (a dict lookup, any thread)
        self.held_when_reported.extend(k for k in keys if self.be.contains_nowait(k) is True)

    def keys(self, reason: RemovalReason) -> list[CacheEngineKey]:
        return [k for _, keys, r in self.calls if r is reason for k in keys]


def _settings(root: Path, pool_size: int = 0, max_bytes: int = 256 * MiB, **kw) -> NixlSettings:
    return NixlSettings(plugin="POSIX", path=str(root), pool_size=pool_size, max_bytes=max_bytes, **kw)


async def _open(
    ctx: BackendContext, root: Path, pool_size: int = 0, max_bytes: int = 256 * MiB, cipher: RecordCipher | None = None
) -> NixlBackend:
    be = NixlBackend(ctx, _settings(root, pool_size, max_bytes), cipher=cipher)
    await be.start()
    return be


def _obj(ctx: BackendContext, fill, nbytes: int, seed: int) -> MemoryObj:
    assert ctx.pool is not None
    return fill(ctx.pool.allocate((nbytes // 4,), torch.float32, MemoryFormat.KV_2LTD), seed)


def _record_of(be: NixlBackend, key: CacheEngineKey) -> Path:
    entry = be._index[key]
    assert be.root is not None
    if isinstance(entry.location, int):
        return be.root / f"slot-{entry.location:06d}{RECORD_SUFFIX}"
    return be.root / f"{entry.location}{RECORD_SUFFIX}"


def _flip_payload_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 10)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))


def _cipher(tmp_path: Path, name: str) -> RecordCipher:
    path = tmp_path / name
    if not path.exists():
        write_key_file(path)
    return load_cipher(path)


async def test_it_declares_that_it_reports_removals(big_context, tmp_path) -> None:
    be = await _open(big_context(), tmp_path)
    assert be.reports_removals
    await be.close()


# ---- clear / remove ----------------------------------------------------------------------------
@pytest.mark.parametrize("pool_size", LAYOUTS)
async def test_clear_reports_every_key_it_drops_once_as_deleted(big_context, tmp_path, fill, pool_size) -> None:
    ctx = big_context()
    be = await _open(ctx, tmp_path, pool_size)
    keys = [make_key(900 + i) for i in range(4)]
    objs = [_obj(ctx, fill, 256 << 10, i) for i in range(4)]
    assert await be.batched_put(list(zip(keys, objs, strict=True))) == [True] * 4
    reports = Reports(be)
    await be.clear()
    assert reports.calls == [("nixl", keys, RemovalReason.DELETED)]  # one report, oldest first
    assert reports.held_when_reported == []
    assert [await be.contains(k) for k in keys] == [False] * 4
    await be.clear()  # nothing held: nothing reported again
    assert len(reports.calls) == 1
    for o in objs:
        o.ref_count_down()
    await be.close()


async def test_clear_of_an_empty_tier_reports_nothing(big_context, tmp_path) -> None:
    be = await _open(big_context(), tmp_path)
    reports = Reports(be)
    await be.clear()
    assert reports.calls == []
    await be.close()


@pytest.mark.parametrize("pool_size", LAYOUTS)
async def test_remove_reports_only_a_key_it_held(big_context, tmp_path, fill, pool_size) -> None:
    ctx = big_context()
    be = await _open(ctx, tmp_path, pool_size)
    key = make_key(910)
    src = _obj(ctx, fill, MiB, 1)
    assert await be.put(key, src)
    reports = Reports(be)
    assert not await be.remove(make_key(911))  # never held: no report
    assert reports.calls == []
    assert await be.remove(key)
    assert not await be.remove(key)  # held no more: no second report
    assert reports.calls == [("nixl", [key], RemovalReason.DELETED)]
    assert reports.held_when_reported == []
    src.ref_count_down()
    await be.close()


# ---- evictions ---------------------------------------------------------------------------------
@pytest.mark.parametrize("pool_size", LAYOUTS)
async def test_each_entry_pushed_out_to_make_room_is_reported_evicted(big_context, tmp_path, fill, pool_size) -> None:
    ctx = big_context()
    rec = MiB + 4096  # a 1 MiB payload plus its header, rounded up
    be = await _open(ctx, tmp_path, pool_size, max_bytes=3 * rec)
    reports = Reports(be)
    keys = [make_key(920 + i) for i in range(6)]
    objs = [_obj(ctx, fill, MiB, i) for i in range(6)]
    for k, o in zip(keys[:3], objs[:3], strict=True):
        assert await be.put(k, o)
    assert reports.calls == []
    assert await be.put(keys[3], objs[3])
    assert reports.calls == [("nixl", [keys[0]], RemovalReason.EVICTED)]
    big = _obj(ctx, fill, 2 * MiB, 9)  # needs two entries' room: both evicted in one report
    assert await be.put(keys[4], big)
    assert reports.calls[1:] == [("nixl", keys[1:3], RemovalReason.EVICTED)]
    assert reports.held_when_reported == []
    assert be.stats()["evictions"] == len(reports.keys(RemovalReason.EVICTED)) == 3
    assert [await be.contains(k) for k in keys[:5]] == [False, False, False, True, True]
    for o in (*objs, big):
        o.ref_count_down()
    await be.close()


async def test_an_entry_being_read_is_not_reported_evicted(big_context, tmp_path, fill) -> None:
    ctx = big_context()
    be = await _open(ctx, tmp_path, max_bytes=2 * (8 * MiB + 4096))
    reports = Reports(be)
    a, b, c = make_key(930), make_key(931), make_key(932)
    oa, ob, oc = (_obj(ctx, fill, 8 * MiB, i) for i in range(3))
    assert await be.put(a, oa) and await be.put(b, ob)
    reader = asyncio.ensure_future(be.get(a))
    await asyncio.sleep(0)  # the read has pinned `a`
    assert await be.put(c, oc)  # evicts `b`, not the entry being read
    got = await reader
    assert got is not None
    assert reports.calls == [("nixl", [b], RemovalReason.EVICTED)]
    for o in (got, oa, ob, oc):
        o.ref_count_down()
    await be.close()


async def test_a_restart_with_a_smaller_budget_reports_what_it_drops(big_context, tmp_path, fill) -> None:
    ctx = big_context()
    be = await _open(ctx, tmp_path)
    keys = [make_key(940 + i) for i in range(4)]
    for i, k in enumerate(keys):
        o = _obj(ctx, fill, MiB, i)
        assert await be.put(k, o)
        o.ref_count_down()
        time.sleep(0.02)  # distinct file ages: the scan orders by them
    await be.close()
    be = NixlBackend(ctx, _settings(tmp_path, max_bytes=2 * MiB + 16384))
    reports = Reports(be)
    await be.start()
    assert reports.calls == [("nixl", keys[:2], RemovalReason.EVICTED)]
    assert reports.held_when_reported == []
    assert [await be.contains(k) for k in keys] == [False, False, True, True]
    await be.close()


# ---- damaged records ---------------------------------------------------------------------------
@pytest.mark.parametrize("pool_size", LAYOUTS)
async def test_a_damaged_record_is_reported_once_it_is_dropped(big_context, tmp_path, fill, pool_size) -> None:
    ctx = big_context()
    be = await _open(ctx, tmp_path, pool_size)
    key, other = make_key(950), make_key(951)
    src, osrc = _obj(ctx, fill, 3 * MiB, 1), _obj(ctx, fill, MiB, 2)
    assert await be.put(key, src) and await be.put(other, osrc)
    _flip_payload_byte(_record_of(be, key))
    reports = Reports(be)
    got = await be.batched_get([key, other])
    assert got[0] is None and got[1] is not None  # a miss; the other read is not disturbed
    got[1].ref_count_down()
    assert reports.calls == [("nixl", [key], RemovalReason.DAMAGED)]
    assert reports.held_when_reported == []
    assert be.stats()["corrupt"] == 1
    assert await be.get(key) is None  # a later miss reports nothing more
    assert not await be.remove(key)
    assert len(reports.calls) == 1
    src.ref_count_down()
    osrc.ref_count_down()
    await be.close()


async def test_a_truncated_record_is_reported_damaged(big_context, tmp_path, fill) -> None:
    ctx = big_context()
    be = await _open(ctx, tmp_path)
    key = make_key(952)
    src = _obj(ctx, fill, MiB, 2)
    assert await be.put(key, src)
    os.truncate(_record_of(be, key), 100)
    reports = Reports(be)
    assert await be.get(key) is None
    assert reports.calls == [("nixl", [key], RemovalReason.DAMAGED)]
    src.ref_count_down()
    await be.close()


async def test_a_record_file_deleted_behind_its_back_is_reported_deleted(big_context, tmp_path, fill) -> None:
    ctx = big_context()
    be = await _open(ctx, tmp_path)
    key = make_key(953)
    src = _obj(ctx, fill, MiB, 3)
    assert await be.put(key, src)
    _record_of(be, key).unlink()
    reports = Reports(be)
    assert await be.get(key) is None
    assert reports.calls == [("nixl", [key], RemovalReason.DELETED)]
    assert reports.held_when_reported == []
    src.ref_count_down()
    await be.close()


async def test_a_record_removed_while_a_read_finds_it_damaged_is_reported_once(big_context, tmp_path, fill) -> None:
    ctx = big_context()
    be = await _open(ctx, tmp_path)
    key = make_key(954)
    src = _obj(ctx, fill, 2 * MiB, 4)
    assert await be.put(key, src)
    _flip_payload_byte(_record_of(be, key))
    reports = Reports(be)
    reader = asyncio.ensure_future(be.get(key))
    await asyncio.sleep(0)  # the read has pinned the entry
    assert be._index[key].readers == 1
    assert await be.remove(key)
    assert await reader is None  # the read then finds the record bad: already reported
    assert reports.calls == [("nixl", [key], RemovalReason.DELETED)]
    assert be.stats()["corrupt"] == 1
    src.ref_count_down()
    await be.close()


async def test_a_record_replaced_by_another_keys_sealed_record_is_reported_damaged(big_context, tmp_path, fill) -> None:
    """A record found sealed under another key (written over ours behind our back) is dropped
    from the index, its file kept: reported DAMAGED."""
    ctx = big_context()
    key = make_key(955)
    src = _obj(ctx, fill, MiB, 5)
    theirs = await _open(ctx, tmp_path / "theirs", cipher=_cipher(tmp_path, "b"))
    assert await theirs.put(key, src)
    foreign = _record_of(theirs, key)
    await theirs.close()
    be = await _open(ctx, tmp_path / "ours", cipher=_cipher(tmp_path, "a"))
    assert await be.put(key, src)
    ours = _record_of(be, key)
    shutil.copyfile(foreign, ours)  # the same size: only the seal tells them apart
    reports = Reports(be)
    assert await be.get(key) is None
    assert reports.calls == [("nixl", [key], RemovalReason.DAMAGED)]
    assert reports.held_when_reported == []
    st = be.stats()
    assert st["foreign_key"] == 1 and st["entries"] == 0 and ours.exists()
    src.ref_count_down()
    await be.close()
