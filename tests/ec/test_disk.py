"""ECCacheEngine over a real disk tier (``local_disk``): eviction fall-through, sharing, restart."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from lmcache_async.engines.encoder_cache import ECCacheEngine

from .helpers import KiB, MiB, gib

MakeEngine = Callable[..., ECCacheEngine]
ENTRY = 256 * KiB  # bytes of one test tensor (float32)


def _tensor(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(ENTRY // 4, generator=g)


def _disk(path: Path) -> dict[str, object]:
    """Config keys of a disk tier in ``path`` (the engine takes its config as given)."""
    return {"local_disk": str(path), "max_local_disk_size": gib(64 * MiB)}


def _one_entry_engine(make_engine: MakeEngine, disk: Path, **kw: object) -> ECCacheEngine:
    """A CPU pool that holds exactly one test tensor, over the disk directory ``disk``."""
    return make_engine(
        max_local_cpu_size=gib(ENTRY + ENTRY // 2),
        staging_size=gib(1 * MiB),
        **_disk(disk),
        **kw,
    )


def test_entry_evicted_from_cpu_is_still_returned_from_disk(make_engine: MakeEngine, tmp_path: Path) -> None:
    engine = _one_entry_engine(make_engine, tmp_path / "ec")
    a, b = _tensor(1), _tensor(2)
    assert engine.put("A", a)
    engine.flush(timeout=30)  # A reaches the disk and is no longer held by the write-through
    assert engine.put("B", b)  # evicts A from the CPU tier
    cpu = engine.storage_manager.backend("cpu")
    assert cpu is not None and not cpu.contains_nowait(engine.key("A"))
    assert engine.contains("A")
    out = engine.get("A")
    assert out is not None
    assert out.dtype == a.dtype and out.shape == a.shape
    assert torch.equal(out, a)
    engine.flush(timeout=30)
    out_b = engine.get("B")
    assert out_b is not None and torch.equal(out_b, b)


def test_disk_hit_result_never_aliases_pool_or_staging(make_engine: MakeEngine, tmp_path: Path) -> None:
    engine = _one_entry_engine(make_engine, tmp_path / "ec")
    a = _tensor(3)
    engine.put("A", a)
    engine.flush(timeout=30)
    engine.put("B", _tensor(4))
    out = engine.get("A")
    assert out is not None
    sm = engine.storage_manager
    for pool in (sm.pool, sm.staging_pool):
        if pool is not None:
            assert not pool.base_ptr <= out.data_ptr() < pool.base_ptr + pool.capacity
    engine.close()
    assert torch.equal(out, a)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_disk_round_trip_keeps_dtype_and_shape_bit_exact(
    make_engine: MakeEngine, tmp_path: Path, dtype: torch.dtype
) -> None:
    disk = tmp_path / "ec"
    t = (torch.randn(7, 9, 11, dtype=torch.float64) * 100 + 1 / 3).to(dtype)
    first = make_engine(**_disk(disk), encoder_dtype=torch.bfloat16)
    assert first.put("x", t)
    first.close()
    second = make_engine(**_disk(disk), encoder_dtype=torch.bfloat16)
    out = second.get("x")
    assert out is not None and out.dtype == dtype and out.shape == t.shape
    assert torch.equal(out, t)


def test_engines_of_different_tp_ranks_share_entries_through_disk(make_engine: MakeEngine, tmp_path: Path) -> None:
    disk = tmp_path / "ec"
    rank0 = make_engine(**_disk(disk), world_size=2, worker_id=0)
    rank1 = make_engine(**_disk(disk), world_size=2, worker_id=1)
    t = _tensor(5)
    assert rank0.put("img", t)
    rank0.flush(timeout=30)
    assert rank1.contains("img")
    out = rank1.get("img")
    assert out is not None and torch.equal(out, t)
    assert rank1.put("img", _tensor(6))  # already there: not written again
    assert rank1.stats()["puts_existing"] == 1
    again = rank1.get("img")
    assert again is not None and torch.equal(again, t)


def test_kv_dtype_change_keeps_disk_entries_reachable(make_engine: MakeEngine, tmp_path: Path) -> None:
    disk = tmp_path / "ec"
    before = make_engine(**_disk(disk), kv_dtype=torch.bfloat16)
    t = _tensor(7)
    before.put("img", t)
    before.close()
    after = make_engine(**_disk(disk), kv_dtype=torch.float8_e4m3fn)
    out = after.get("img")
    assert out is not None and torch.equal(out, t)


def test_encoder_dtype_and_model_separate_disk_entries(make_engine: MakeEngine, tmp_path: Path) -> None:
    disk = tmp_path / "ec"
    bf16 = make_engine(**_disk(disk), encoder_dtype=torch.bfloat16)
    bf16.put("img", _tensor(8))
    bf16.flush(timeout=30)
    assert not make_engine(**_disk(disk), encoder_dtype=torch.float16).contains("img")
    assert not make_engine(**_disk(disk), model="other-model").contains("img")


def test_restarted_engine_reuses_the_directory(make_engine: MakeEngine, tmp_path: Path) -> None:
    disk = tmp_path / "ec"
    tensors = {f"h{i}": _tensor(100 + i) for i in range(5)}
    first = make_engine(**_disk(disk))
    for h, t in tensors.items():
        assert first.put(h, t)
    first.close()  # close flushes the write-through
    second = make_engine(**_disk(disk))
    for h, t in tensors.items():
        assert second.contains(h)
        out = second.get(h)
        assert out is not None and torch.equal(out, t)


def test_delete_removes_from_cpu_and_disk(make_engine: MakeEngine, tmp_path: Path) -> None:
    disk = tmp_path / "ec"
    engine = make_engine(**_disk(disk))
    engine.put("h", _tensor(9))
    engine.flush(timeout=30)
    assert engine.delete("h")
    assert not engine.contains("h")
    assert engine.get("h") is None
    other = make_engine(**_disk(disk))
    assert not other.contains("h")


def test_disk_only_engine_without_cpu_tier(ec_config: Callable[..., object], tmp_path: Path) -> None:
    from lmcache_async import LMCacheEngineMetadata

    cfg = ec_config(local_cpu=False, **_disk(tmp_path / "ec"))
    with ECCacheEngine(cfg, LMCacheEngineMetadata("m"), torch.bfloat16) as engine:  # type: ignore[arg-type]
        t = _tensor(10)
        assert engine.put("h", t)
        engine.flush(timeout=30)
        out = engine.get("h")
        assert out is not None and torch.equal(out, t)


async def test_async_get_falls_through_to_disk(make_engine: MakeEngine, tmp_path: Path) -> None:
    engine = _one_entry_engine(make_engine, tmp_path / "ec")
    a = _tensor(11)
    assert await engine.aput("A", a)
    await engine.aflush()
    assert await engine.aput("B", _tensor(12))
    assert await engine.acontains("A")
    out = await engine.aget("A")
    assert out is not None and torch.equal(out, a)
