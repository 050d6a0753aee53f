"""The NIXL tier's capacity rules on real files through the real POSIX plugin: LRU and FIFO
eviction with exact accounting, slot pool exhaustion, slots freed by evictions and removals zeroed
off the loop, entries being read never evicted and entries larger than the budget refused."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from lmcache_async.nixl.io import EMPTY_MAGIC, RECORD_SUFFIX, SlotFileLayout
from lmcache_async.nixl.tier import NixlBackend
from lmcache_async.testing import make_key

from .nixl_backend_support import (
    LAYOUTS,
    MiB,
    _eq,
    _obj,
    _open,
    _records,
    _settle,
    _slot_of,
)

pytestmark = pytest.mark.nixl


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
