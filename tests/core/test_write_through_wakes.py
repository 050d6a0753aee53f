"""A batch of puts wakes the write-through once; single puts still reach the lower tiers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from lmcache_async.keys import CacheEngineKey
from lmcache_async.storage_manager import StorageManager


def key(i: int) -> CacheEngineKey:
    return CacheEngineKey("m", 1, 0, i, torch.float32)


def count_wakes(sm: StorageManager, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Record the write-through's wake-ups of the loop (they still happen)."""
    wt = sm._wt
    calls: list[Any] = []
    real = wt._lt.call_soon

    def counting(fn: Callable[..., Any], *args: Any) -> None:
        if getattr(fn, "__name__", "") == "_drain":
            calls.append(fn)
        real(fn, *args)

    monkeypatch.setattr(wt._lt, "call_soon", counting)
    return calls


def read_back(make_manager: Callable[..., StorageManager], disk: Path, keys: list[CacheEngineKey]) -> list[Any]:
    """The values of ``keys`` read by a fresh manager from the disk directory alone."""
    fresh = make_manager(local_disk=str(disk), max_local_disk_size=0.1)
    got = fresh.batched_get_sync(keys)
    out = [None if obj is None else obj.tensor.clone() for obj in got]
    for obj in got:
        if obj is not None:
            obj.ref_count_down()
    return out


def test_a_batched_put_wakes_the_loop_once_and_every_entry_reaches_disk(
    make_manager: Callable[..., StorageManager], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sm = make_manager(local_disk=str(tmp_path), max_local_disk_size=0.1)
    wakes = count_wakes(sm, monkeypatch)
    keys = [key(i) for i in range(12)]
    values = [torch.full((256,), float(i)) for i in range(12)]
    assert sm.batched_put_sync(keys, values) == [True] * 12
    assert len(wakes) == 1
    sm.flush_sync()
    back = read_back(make_manager, tmp_path, keys)
    for i, t in enumerate(back):
        assert t is not None and torch.equal(t, values[i])


def test_the_wake_of_a_batch_that_raises_is_not_lost(
    make_manager: Callable[..., StorageManager], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sm = make_manager(local_disk=str(tmp_path), max_local_disk_size=0.1)
    wakes = count_wakes(sm, monkeypatch)
    obj = sm.allocate((64,), torch.float32)
    assert obj is not None
    obj.tensor.fill_(3.0)
    with pytest.raises(RuntimeError, match="caller"), sm._wt.deferred_wake():
        assert sm._put.put(key(1), obj, obj.fmt)
        assert wakes == []  # deferred ...
        raise RuntimeError("a caller's error inside the batch")
    obj.ref_count_down()
    assert len(wakes) == 1  # ... and sent on the way out
    sm.flush_sync()
    (back,) = read_back(make_manager, tmp_path, [key(1)])
    assert back is not None and torch.equal(back, torch.full((64,), 3.0))


def test_puts_inside_batched_writes_wake_the_write_through_once_when_the_block_ends(
    make_manager: Callable[..., StorageManager], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sm = make_manager(local_disk=str(tmp_path), max_local_disk_size=0.1)
    wakes = count_wakes(sm, monkeypatch)
    keys = [key(20 + i) for i in range(6)]
    with sm.batched_writes():
        for i, k in enumerate(keys[:3]):
            assert sm.put_sync(k, torch.full((64,), float(i)))
        assert sm.batched_put_sync(keys[3:], [torch.full((64,), float(i)) for i in range(3, 6)]) == [True] * 3
        assert wakes == []  # neither the single puts nor the nested batch woke the loop
        assert sm.contains_sync(keys[0])  # readable at once all the same
    assert len(wakes) == 1
    sm.flush_sync()
    back = read_back(make_manager, tmp_path, keys)
    assert all(t is not None and torch.equal(t, torch.full((64,), float(i))) for i, t in enumerate(back))
