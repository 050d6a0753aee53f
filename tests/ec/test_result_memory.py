"""Recycled result memory: a CPU ``get`` result is the caller's alone while it is referenced.

The engine reuses the memory of results the caller dropped (``ResultBuffers``); these tests
prove that nothing — later gets, puts over the same hash, deletes, evictions — ever changes a
result (or a view of it) that is still held, and that reuse happens only after the last
reference is gone.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_async.engines._result_memory import MIN_RECYCLED_BYTES, ResultBuffers, size_class
from lmcache_async.engines.encoder_cache import ECCacheEngine

from .helpers import KiB, MiB, gib

MakeEngine = Callable[..., ECCacheEngine]

ROWS = 64  # bf16 [64, 2048]: 256 KiB, above MIN_RECYCLED_BYTES


def _entry(seed: int, rows: int = ROWS) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 2048, generator=g).to(torch.bfloat16)


# ---- ResultBuffers -----------------------------------------------------------------------------
def test_size_classes_round_up_by_at_most_a_quarter() -> None:
    for n in (1, 4095, 4096, 64 * KiB, 64 * KiB + 1, 300_000, MiB, 4 * MiB + 1, 5_000_000):
        c = size_class(n)
        assert c >= n and c % 4096 == 0
        assert c <= max(4096, n * 5 // 4 + 4096)


def test_a_dropped_result_is_reused_and_a_held_one_never_is() -> None:
    rb = ResultBuffers(64 * MiB)
    src = _entry(1)
    a = rb.copy_of(src)
    assert torch.equal(a, src) and a.is_contiguous() and a.data_ptr() % 64 == 0
    ptr = a.data_ptr()
    del a
    b = rb.copy_of(src)
    assert b.data_ptr() == ptr  # the dropped block came back
    c = rb.copy_of(_entry(2))
    assert c.data_ptr() != b.data_ptr()
    assert torch.equal(b, src)


@pytest.mark.parametrize("holder", ["view", "storage", "numpy"])
def test_a_view_or_storage_of_a_result_keeps_its_memory(holder: str) -> None:
    rb = ResultBuffers(64 * MiB)
    src = _entry(3)
    out = rb.copy_of(src)
    ptr = out.data_ptr()
    keep: object
    if holder == "view":
        keep = out[5:9]
    elif holder == "storage":
        keep = out.untyped_storage()
    else:
        keep = out.view(torch.int16).numpy()
    del out
    gc.collect()
    others = [rb.copy_of(_entry(10 + i)) for i in range(8)]
    assert all(o.data_ptr() != ptr for o in others)
    if holder == "view":
        assert isinstance(keep, torch.Tensor) and torch.equal(keep, src[5:9])
    del keep


def test_small_results_and_results_past_capacity_are_plain_memory() -> None:
    rb = ResultBuffers(2 * size_class(256 * KiB))
    small = rb.copy_of(torch.arange(MIN_RECYCLED_BYTES // 8 - 1, dtype=torch.int64))
    assert rb.held_bytes == 0 and small.numel() == MIN_RECYCLED_BYTES // 8 - 1
    held = [rb.copy_of(_entry(i)) for i in range(4)]
    assert rb.held_bytes == 2 * size_class(256 * KiB)  # two recycled, two plain
    assert all(torch.equal(h, _entry(i)) for i, h in enumerate(held))
    assert rb.copy_of(torch.empty(0)).numel() == 0


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.float64,
        torch.bfloat16,
        torch.float16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.complex64,
        torch.float8_e4m3fn,
        torch.int64,
    ],
)
def test_recycled_results_are_bit_exact_for_every_dtype(dtype: torch.dtype) -> None:
    rb = ResultBuffers(64 * MiB)
    raw = torch.randint(0, 256, (3, 128 * KiB // 3 + 7), dtype=torch.uint8)
    src = raw.view(torch.bool) if dtype == torch.bool else raw[:, : raw.shape[1] // 16 * 16].contiguous().view(dtype)
    if dtype == torch.bool:
        src = src & True  # canonical 0/1 bytes
    out = rb.copy_of(src)
    assert out.dtype == dtype and out.shape == src.shape and rb.held_bytes > 0
    assert torch.equal(out.view(torch.uint8), src.view(torch.uint8))


@pytest.mark.parametrize("rows", [64, 1024])  # 256 KiB (one memmove) and 4 MiB (torch's copy_)
def test_strided_conjugate_and_negative_sources_are_copied_by_value(rows: int) -> None:
    rb = ResultBuffers(64 * MiB)
    base = torch.randn(rows, 512, dtype=torch.complex64)
    for src in (base.t(), base.conj(), base.conj().imag, base[:, ::2]):
        out = rb.copy_of(src)
        assert out.is_contiguous() and not out.is_conj() and not out.is_neg()
        assert torch.equal(out, src.resolve_conj().resolve_neg())


def test_clear_leaves_held_results_intact() -> None:
    rb = ResultBuffers(64 * MiB)
    src = _entry(4)
    out = rb.copy_of(src)
    rb.clear()
    assert rb.held_bytes == 0
    again = [rb.copy_of(_entry(5)) for _ in range(3)]
    assert torch.equal(out, src) and all(a.data_ptr() != out.data_ptr() for a in again)


def test_threads_never_share_a_block() -> None:
    rb = ResultBuffers(256 * MiB)
    srcs = [_entry(i, rows=32) for i in range(4)]
    bad: list[str] = []

    def work(tid: int) -> None:
        for rnd in range(60):
            src = srcs[(tid + rnd) % len(srcs)]
            held = [rb.copy_of(src) for _ in range(3)]
            for h in held:
                if not torch.equal(h, src):
                    bad.append(f"thread {tid} round {rnd}")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad


# ---- through the engine ------------------------------------------------------------------------
def test_results_survive_overwrite_delete_and_later_gets(make_engine: MakeEngine) -> None:
    engine = make_engine()
    first = _entry(20)
    assert engine.put("h", first)
    kept = engine.get("h")
    view = kept[3:7] if kept is not None else None
    dropped = engine.get("h")
    del dropped  # its memory may serve the gets below, never `kept`'s
    assert engine.delete("h")
    second = _entry(21)
    assert engine.put("h", second)  # same hash, other bytes
    later = [engine.get("h") for _ in range(4)]
    assert kept is not None and view is not None
    assert torch.equal(kept, first) and torch.equal(view, first[3:7])
    assert all(x is not None and torch.equal(x, second) for x in later)
    assert all(x is not None and x.data_ptr() != kept.data_ptr() for x in later)


def test_results_survive_eviction_of_their_entries(make_engine: MakeEngine) -> None:
    engine = make_engine(max_local_cpu_size=gib(2 * MiB), staging_size=0)
    kept: dict[int, torch.Tensor] = {}
    for i in range(24):  # 6 MiB through a 2 MiB tier: every early entry is evicted
        t = _entry(100 + i)
        assert engine.put(f"h{i}", t)
        out = engine.get(f"h{i}")
        assert out is not None
        if i % 3 == 0:
            kept[i] = out
    assert not engine.contains("h0")
    for i, out in kept.items():
        assert torch.equal(out, _entry(100 + i))


def test_results_survive_close(make_engine: MakeEngine) -> None:
    engine = make_engine()
    assert engine.put("h", _entry(30))
    out = engine.get("h")
    assert engine.stats()["result_memory_bytes"] == size_class(256 * KiB)
    engine.close()
    assert engine.stats()["result_memory_bytes"] == 0
    gc.collect()
    assert out is not None and torch.equal(out, _entry(30))


@settings(max_examples=25, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["get", "drop", "put", "delete"]), st.integers(0, 3), st.integers(0, 9)),
        min_size=1,
        max_size=40,
    )
)
def test_held_results_never_change_under_any_sequence(ops: list[tuple[str, int, int]]) -> None:
    from lmcache_async import LMCacheEngineConfig, LMCacheEngineMetadata

    cfg = LMCacheEngineConfig.from_defaults(max_local_cpu_size=gib(MiB), staging_size=0.0)
    engine = ECCacheEngine(cfg, LMCacheEngineMetadata(model_name="m"), torch.bfloat16)
    try:
        versions: dict[str, int] = {}  # hash -> seed of the bytes the CPU tier holds
        held: list[tuple[torch.Tensor, torch.Tensor]] = []  # (result, snapshot)
        for op, h, seed in ops:
            name = f"h{h}"
            if op == "put":
                engine.delete(name)
                if engine.put(name, _entry(seed)):
                    versions[name] = seed
            elif op == "delete":
                engine.delete(name)
                versions.pop(name, None)
            elif op == "get":
                out = engine.get(name)
                if out is not None:
                    assert name in versions and torch.equal(out, _entry(versions[name]))
                    held.append((out, out.clone()))
            elif held:
                held.pop(seed % len(held))
            for out, snap in held:
                assert torch.equal(out, snap)
    finally:
        engine.close()
