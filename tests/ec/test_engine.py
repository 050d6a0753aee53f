"""ECCacheEngine on its CPU tier: keys, put/get/contains/delete, ownership, pressure, async twins."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest
import torch
from engines._data import UNSTORABLE_KINDS, unstorable

from lmcache_async import CacheEngineKey, LoopThreadCallError, ManagerClosedError, MemoryFormat, stable_u64_from_str
from lmcache_async.engines.encoder_cache import ECCacheEngine, ec_cache_key

from .helpers import KiB, MiB, gib

MakeEngine = Callable[..., ECCacheEngine]


def _pool_range(engine: ECCacheEngine) -> tuple[int, int]:
    pool = engine.storage_manager.pool
    assert pool is not None
    return pool.base_ptr, pool.base_ptr + pool.capacity


def _aliases_pool(engine: ECCacheEngine, t: torch.Tensor) -> bool:
    lo, hi = _pool_range(engine)
    return lo <= t.data_ptr() < hi


# ---- keys --------------------------------------------------------------------------------------
def test_key_uses_rank_sentinels_stable_hash_and_encoder_dtype(make_engine: MakeEngine) -> None:
    engine = make_engine(model="m/x", world_size=4, worker_id=3, encoder_dtype=torch.float16)
    key = engine.key("img-0001")
    assert key == CacheEngineKey("m/x", 1, 0, stable_u64_from_str("img-0001"), torch.float16)
    assert key == ec_cache_key("m/x", "img-0001", torch.float16)


def test_engines_of_different_tp_ranks_produce_equal_keys(make_engine: MakeEngine) -> None:
    a = make_engine(world_size=2, worker_id=0)
    b = make_engine(world_size=2, worker_id=1)
    c = make_engine(world_size=8, worker_id=5)
    assert a.key("h") == b.key("h") == c.key("h")


def test_changing_the_kv_dtype_never_changes_an_ec_key(make_engine: MakeEngine) -> None:
    bf16 = make_engine(kv_dtype=torch.bfloat16)
    fp8 = make_engine(kv_dtype=torch.float8_e4m3fn)
    fp32 = make_engine(kv_dtype=torch.float32)
    assert bf16.key("h") == fp8.key("h") == fp32.key("h")
    assert bf16.key("h").dtype == torch.bfloat16


def test_encoder_dtype_is_the_key_dtype_and_accepts_names(make_engine: MakeEngine) -> None:
    assert make_engine(encoder_dtype="float16").key("h").dtype == torch.float16
    assert make_engine(encoder_dtype="bfloat16").key("h") != make_engine(encoder_dtype=torch.float16).key("h")


def test_bad_encoder_dtype_is_rejected(make_engine: MakeEngine) -> None:
    with pytest.raises(ValueError, match="encoder_dtype"):
        make_engine(encoder_dtype="no-such-dtype")
    with pytest.raises(TypeError, match="encoder_dtype"):
        make_engine(encoder_dtype=3)


def test_bad_constructor_arguments_raise(ec_config: Callable[..., object]) -> None:
    with pytest.raises(TypeError, match="config"):
        ECCacheEngine({}, None, torch.bfloat16)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="metadata"):
        ECCacheEngine(ec_config(), "meta", torch.bfloat16)  # type: ignore[arg-type]


def test_engine_uses_its_config_as_given(make_engine: MakeEngine) -> None:
    engine = make_engine(max_local_cpu_size=gib(16 * MiB))
    pool = engine.storage_manager.pool
    assert pool is not None and pool.capacity == 16 * MiB
    assert engine.storage_manager.tier_names == ["cpu"]


# ---- put / get ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(17, 64),
        torch.randn(3, 5, 7).to(torch.bfloat16),
        torch.randn(2, 3, 4, 5).to(torch.float16),
        torch.tensor(2.5),
        torch.randn(0, 32),
        torch.arange(10, dtype=torch.int64),
        torch.tensor([True, False, True]),
        torch.randn(4, 4, dtype=torch.float64),
    ],
    ids=["2d-f32", "3d-bf16", "4d-f16", "scalar", "empty", "int64", "bool", "f64"],
)
def test_any_rank_shape_and_dtype_round_trips_exactly(make_engine: MakeEngine, tensor: torch.Tensor) -> None:
    engine = make_engine()
    assert engine.put("item", tensor)
    out = engine.get("item")
    assert out is not None
    assert out.dtype == tensor.dtype and out.shape == tensor.shape
    assert torch.equal(out, tensor)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_tensors_keep_their_own_dtype_bit_exact_in_a_bf16_engine(make_engine: MakeEngine, dtype: torch.dtype) -> None:
    engine = make_engine(encoder_dtype=torch.bfloat16)
    # Values bf16 cannot represent: a cast anywhere would change the bits.
    t = (torch.randn(33, 129, dtype=torch.float64) * 1e3 + 1 / 3).to(dtype)
    assert engine.put("img", t)
    out = engine.get("img")
    assert out is not None and out.dtype == dtype
    assert torch.equal(
        out.view(torch.int16 if dtype == torch.float16 else torch.int32),
        t.view(torch.int16 if dtype == torch.float16 else torch.int32),
    )


def test_stored_entry_is_ec_td_with_source_shape_and_dtype(make_engine: MakeEngine) -> None:
    engine = make_engine()
    t = torch.randn(5, 6, dtype=torch.float16)
    engine.put("h", t)
    obj = engine.storage_manager.get_sync(engine.key("h"))
    assert obj is not None
    with obj:
        assert obj.fmt == MemoryFormat.EC_TD
        assert obj.shape == (5, 6) and obj.dtype == torch.float16


def test_non_contiguous_source_is_stored_by_value(make_engine: MakeEngine) -> None:
    engine = make_engine()
    base = torch.randn(8, 16)
    t = base.t()[::2]
    assert not t.is_contiguous()
    engine.put("nc", t)
    out = engine.get("nc")
    assert out is not None and torch.equal(out, t) and out.is_contiguous()


def test_put_does_not_keep_the_callers_tensor(make_engine: MakeEngine) -> None:
    engine = make_engine()
    t = torch.ones(100)
    engine.put("h", t)
    t.fill_(7)
    out = engine.get("h")
    assert out is not None and torch.equal(out, torch.ones(100))


def test_tensor_requiring_grad_is_stored_without_joining_its_graph(make_engine: MakeEngine) -> None:
    engine = make_engine()
    w = torch.randn(4, 4, requires_grad=True)
    t = w * 2
    assert engine.put("g", t)
    out = engine.get("g")
    assert out is not None and not out.requires_grad and out.grad_fn is None
    assert torch.equal(out, t.detach())
    pool = engine.storage_manager.pool
    assert pool is not None and not pool.buffer.requires_grad


def test_inference_mode_tensors_round_trip(make_engine: MakeEngine) -> None:
    engine = make_engine()
    with torch.inference_mode():
        t = torch.randn(6, 8)
        assert engine.put("inf", t)
        inside = engine.get("inf")
    outside = engine.get("inf")
    assert inside is not None and outside is not None
    assert torch.equal(inside, t) and torch.equal(outside, t)


def test_non_tensor_put_raises_type_error(make_engine: MakeEngine) -> None:
    engine = make_engine()
    with pytest.raises(TypeError, match="tensor"):
        engine.put("h", [1.0, 2.0])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="tensor"):
        engine.put("h", None)  # type: ignore[arg-type]
    assert not engine.contains("h")


@pytest.mark.parametrize("kind", UNSTORABLE_KINDS)
async def test_put_of_a_tensor_without_dense_bytes_is_a_type_error_naming_tensor(
    make_engine: MakeEngine, kind: str
) -> None:
    engine = make_engine()
    with pytest.raises(TypeError, match=r"^tensor "):
        engine.put("h", unstorable(kind, (4, 8)))
    with pytest.raises(TypeError, match=r"^tensor "):
        await engine.aput("h", unstorable(kind, (4, 8)))
    assert not engine.contains("h")


@pytest.mark.parametrize("bad", [None, 12, b"bytes", ["list"]])
def test_non_str_mm_hash_raises_type_error(make_engine: MakeEngine, bad: object) -> None:
    engine = make_engine()
    for call in (
        lambda: engine.put(bad, torch.ones(1)),  # type: ignore[arg-type]
        lambda: engine.get(bad),  # type: ignore[arg-type]
        lambda: engine.contains(bad),  # type: ignore[arg-type]
        lambda: engine.delete(bad),  # type: ignore[arg-type]
    ):
        with pytest.raises(TypeError, match="mm_hash"):
            call()


def test_empty_mm_hash_raises_value_error(make_engine: MakeEngine) -> None:
    with pytest.raises(ValueError, match="mm_hash"):
        make_engine().put("", torch.ones(1))


def test_bad_device_raises(make_engine: MakeEngine) -> None:
    engine = make_engine()
    engine.put("h", torch.ones(2))
    with pytest.raises(ValueError, match="device"):
        engine.get("h", device="no-such-device")
    with pytest.raises(TypeError, match="device"):
        engine.get("h", device=1.5)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["\ud800", "img-\udfff-1"])
async def test_mm_hash_with_a_lone_surrogate_is_a_value_error_naming_it(make_engine: MakeEngine, bad: str) -> None:
    engine = make_engine()
    for call in (
        lambda: engine.put(bad, torch.ones(1)),
        lambda: engine.get(bad),
        lambda: engine.contains(bad),
        lambda: engine.delete(bad),
        lambda: engine.key(bad),
        lambda: ec_cache_key("m", bad, torch.bfloat16),
    ):
        with pytest.raises(ValueError, match="mm_hash"):
            call()
    with pytest.raises(ValueError, match="mm_hash"):
        await engine.aput(bad, torch.ones(1))
    with pytest.raises(ValueError, match="mm_hash"):
        await engine.aget(bad)
    with pytest.raises(ValueError, match="mm_hash"):
        await engine.acontains(bad)


@pytest.mark.parametrize(
    "device",
    [
        "meta",
        "cuda:4096",
        pytest.param("cuda:0", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available")),
    ],
)
async def test_get_to_a_device_this_machine_lacks_is_a_value_error_on_hit_and_miss(
    make_engine: MakeEngine, device: str
) -> None:
    engine = make_engine()
    engine.put("hit", torch.ones(2))
    for mm_hash in ("hit", "miss"):
        with pytest.raises(ValueError, match="device"):
            engine.get(mm_hash, device=device)
        with pytest.raises(ValueError, match="device"):
            await engine.aget(mm_hash, device=device)
    out = engine.get("hit")
    assert out is not None and torch.equal(out, torch.ones(2))


def test_get_of_a_missing_hash_is_none(make_engine: MakeEngine) -> None:
    engine = make_engine()
    assert engine.get("absent") is None
    assert not engine.contains("absent")
    assert engine.stats()["misses"] == 1


def test_get_accepts_a_torch_device(make_engine: MakeEngine) -> None:
    engine = make_engine()
    engine.put("h", torch.arange(4.0))
    out = engine.get("h", device=torch.device("cpu"))
    assert out is not None and out.device.type == "cpu"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_put_from_and_get_to_a_cuda_device() -> None:  # pragma: no cover - GPU hosts
    from lmcache_async import LMCacheEngineConfig, LMCacheEngineMetadata

    cfg = LMCacheEngineConfig.from_defaults(max_local_cpu_size=gib(64 * MiB), staging_size=0)
    with ECCacheEngine(cfg, LMCacheEngineMetadata("m"), torch.bfloat16) as engine:
        src = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
        assert engine.put("gpu", src)
        out = engine.get("gpu", device="cuda")
        assert out is not None and out.device.type == "cuda"
        assert torch.equal(out, src)
        cpu = engine.get("gpu")
        assert cpu is not None and torch.equal(cpu, src.cpu())


# ---- ownership ---------------------------------------------------------------------------------
def test_get_result_never_aliases_the_pool(make_engine: MakeEngine) -> None:
    engine = make_engine()
    engine.put("h", torch.randn(256, 256))
    a = engine.get("h")
    b = engine.get("h")
    assert a is not None and b is not None
    assert not _aliases_pool(engine, a) and not _aliases_pool(engine, b)
    assert a.data_ptr() != b.data_ptr()
    a.fill_(0)
    again = engine.get("h")
    assert again is not None and torch.equal(again, b)


def test_get_releases_its_pool_reference(make_engine: MakeEngine) -> None:
    engine = make_engine()
    engine.put("h", torch.randn(64))
    for _ in range(5):
        engine.get("h")
    obj = engine.storage_manager.get_sync(engine.key("h"))
    assert obj is not None
    with obj:
        assert obj.get_ref_count() == 2  # the index's and ours: get() kept none


def test_get_result_survives_delete_and_close(make_engine: MakeEngine) -> None:
    engine = make_engine()
    t = torch.randn(128, 64)
    engine.put("h", t)
    out = engine.get("h")
    assert engine.delete("h")
    engine.put("other", torch.zeros(128, 64))  # may reuse the freed block
    engine.close()
    assert out is not None and torch.equal(out, t)


def test_delete_removes_and_reports(make_engine: MakeEngine) -> None:
    engine = make_engine()
    engine.put("h", torch.ones(3))
    assert engine.delete("h")
    assert not engine.contains("h")
    assert engine.get("h") is None
    assert not engine.delete("h")


# ---- content addressing, pressure, concurrency -----------------------------------------------------
def test_re_putting_an_existing_hash_does_not_copy_again(make_engine: MakeEngine) -> None:
    engine = make_engine()
    first = torch.full((64, 64), 1.0)
    assert engine.put("h", first)
    pool = engine.storage_manager.pool
    assert pool is not None
    used = pool.used_bytes
    assert engine.put("h", torch.full((64, 64), 2.0))
    assert engine.put("h", torch.full((3,), 9.0))
    assert pool.used_bytes == used
    out = engine.get("h")
    assert out is not None and torch.equal(out, first)
    stats = engine.stats()
    assert stats["puts"] == 1 and stats["puts_existing"] == 2


def test_put_is_false_under_transient_pool_pressure(make_engine: MakeEngine) -> None:
    engine = make_engine(max_local_cpu_size=gib(1 * MiB), staging_size=0)
    a = torch.randn(192 * KiB)  # 768 KiB: the pool holds one
    assert engine.put("a", a)
    reader = engine.storage_manager.get_sync(engine.key("a"))  # a reader pins "a"
    assert reader is not None
    try:
        assert engine.put("b", torch.randn(192 * KiB)) is False
        assert engine.stats()["puts_rejected"] == 1
    finally:
        reader.ref_count_down()
    assert engine.put("b", torch.randn(192 * KiB))  # "a" is evictable again
    assert engine.contains("b") and not engine.contains("a")


def test_put_larger_than_the_pool_is_false(make_engine: MakeEngine) -> None:
    engine = make_engine(max_local_cpu_size=gib(1 * MiB), staging_size=0)
    assert engine.put("huge", torch.empty(2 * MiB, dtype=torch.uint8)) is False
    assert not engine.contains("huge")


def test_lru_eviction_keeps_the_newest_entries(make_engine: MakeEngine) -> None:
    engine = make_engine(max_local_cpu_size=gib(4 * MiB), staging_size=0)
    tensors = {f"h{i}": torch.full((256 * KiB // 4,), float(i)) for i in range(40)}
    for h, t in tensors.items():
        assert engine.put(h, t)
    assert engine.contains("h39") and not engine.contains("h0")
    out = engine.get("h39")
    assert out is not None and torch.equal(out, tensors["h39"])


def test_concurrent_puts_of_one_hash_make_one_entry_all_true(make_engine: MakeEngine) -> None:
    engine = make_engine()
    t = torch.randn(512, 128)
    barrier = threading.Barrier(8)
    results: list[bool] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def worker() -> None:
        try:
            barrier.wait(timeout=10)
            ok = engine.put("same", t)
            with lock:
                results.append(ok)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=30)
    assert not errors
    assert results == [True] * 8
    sm = engine.storage_manager
    assert sm.stats()["tiers"]["cpu"]["entries"] == 1
    pool = sm.pool
    assert pool is not None and pool.num_objects == 1
    out = engine.get("same")
    assert out is not None and torch.equal(out, t)


def test_concurrent_mixed_operations_stay_consistent(make_engine: MakeEngine) -> None:
    engine = make_engine(max_local_cpu_size=gib(8 * MiB))
    tensors = {f"k{i}": torch.full((16 * KiB,), float(i)) for i in range(32)}
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            for r in range(50):
                h = f"k{(seed * 7 + r) % 32}"
                engine.put(h, tensors[h])
                out = engine.get(h)
                if out is not None and not torch.equal(out, tensors[h]):
                    raise AssertionError(f"{h} returned another entry's values")
                if r % 5 == 0:
                    engine.delete(h)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not errors


# ---- lifecycle and stats ---------------------------------------------------------------------------
def test_close_is_idempotent_and_later_calls_raise(make_engine: MakeEngine) -> None:
    engine = make_engine()
    engine.put("h", torch.ones(1))
    engine.close()
    engine.close()
    assert engine.closed
    with pytest.raises(ManagerClosedError):
        engine.put("h2", torch.ones(1))
    with pytest.raises(ManagerClosedError):
        engine.get("h")
    with pytest.raises(ManagerClosedError):
        engine.contains("h")


def test_close_on_its_loop_thread_raises_and_leaves_the_engine_closable(make_engine: MakeEngine) -> None:
    engine = make_engine()
    sm = engine.storage_manager

    async def close_on_the_loop() -> None:
        engine.close()

    with pytest.raises(LoopThreadCallError):
        sm.loop_thread.run_sync(close_on_the_loop(), timeout=10)
    assert not engine.closed
    assert engine.put("h", torch.ones(1))  # still open
    engine.close()
    assert engine.closed and sm.pool is None


def test_context_manager_closes(ec_config: Callable[..., object]) -> None:
    from lmcache_async import LMCacheEngineMetadata

    with ECCacheEngine(ec_config(), LMCacheEngineMetadata("m"), "bfloat16") as engine:  # type: ignore[arg-type]
        engine.put("h", torch.ones(2))
    assert engine.closed


def test_stats_report_engine_counters_and_tiers(make_engine: MakeEngine) -> None:
    engine = make_engine(model="vis")
    engine.put("a", torch.ones(4))
    engine.get("a")
    engine.get("b")
    s = engine.stats()
    assert s["model_name"] == "vis" and s["encoder_dtype"] == "bfloat16"
    assert (s["puts"], s["hits"], s["misses"]) == (1, 1, 1)
    assert s["storage"]["tiers"]["cpu"]["entries"] == 1
    assert "ECCacheEngine" in repr(engine)


def test_loop_thread_is_named_for_the_encoder_cache(make_engine: MakeEngine) -> None:
    engine = make_engine()
    assert engine.storage_manager.loop_thread.name == "lmcache-async-ec"


# ---- async twins -----------------------------------------------------------------------------------
async def test_async_twins_from_a_foreign_loop(make_engine: MakeEngine) -> None:
    engine = make_engine()
    t = torch.randn(32, 16, dtype=torch.float16)
    assert await engine.aput("a", t)
    assert await engine.aput("a", torch.zeros(1))  # already present: not copied again
    assert await engine.acontains("a")
    out = await engine.aget("a")
    assert out is not None and torch.equal(out, t) and out.dtype == torch.float16
    assert not _aliases_pool(engine, out)
    assert await engine.aget("missing") is None
    assert await engine.adelete("a")
    assert not await engine.acontains("a")
    await engine.aflush()
    await engine.aclose()
    assert engine.closed
    assert torch.equal(out, t)


async def test_async_twins_run_concurrently(make_engine: MakeEngine) -> None:
    engine = make_engine()
    tensors = [torch.full((1024,), float(i)) for i in range(16)]
    oks = await asyncio.gather(*(engine.aput(f"h{i}", t) for i, t in enumerate(tensors)))
    assert all(oks)
    outs = await asyncio.gather(*(engine.aget(f"h{i}") for i in range(16)))
    for t, out in zip(tensors, outs, strict=True):
        assert out is not None and torch.equal(out, t)


async def test_async_context_manager(ec_config: Callable[..., object]) -> None:
    from lmcache_async import LMCacheEngineMetadata

    async with ECCacheEngine(ec_config(), LMCacheEngineMetadata("m"), "float16") as engine:  # type: ignore[arg-type]
        assert await engine.aput("h", torch.ones(3))
    assert engine.closed


def test_sync_calls_from_the_engines_loop_thread_raise(make_engine: MakeEngine) -> None:
    from lmcache_async import LoopThreadCallError

    engine = make_engine()

    async def on_loop() -> None:
        engine.get("h")

    with pytest.raises(LoopThreadCallError):
        engine.storage_manager.loop_thread.run_sync(on_loop(), timeout=10)
