"""Memory pool: allocation, exhaustion, coalescing, ref counts, sizing checks."""

from __future__ import annotations

import ctypes
import random
import threading
import time

import pytest
import torch

from lmcache_async import DoubleReleaseError, MemoryFormat, PoolSizeError
from lmcache_async.memory import (
    GiB,
    HeapAllocator,
    MemoryObj,
    PoolAllocator,
    memory_available_bytes,
    view_cache_limit,
)


def pool(size=1 << 20, **kw) -> PoolAllocator:
    return PoolAllocator(size, name="test", pretouch=False, **kw)


def alloc(p: PoolAllocator, shape: tuple[int, ...], dtype: torch.dtype) -> MemoryObj:
    """An allocation that the test's pool has room for."""
    obj = p.allocate(shape, dtype)
    assert obj is not None
    return obj


def test_allocation_is_a_typed_view_with_shape():
    p = pool()
    obj = p.allocate((3, 5, 7), torch.bfloat16, MemoryFormat.KV_2LTD)
    assert obj is not None
    assert obj.tensor.shape == (3, 5, 7) and obj.tensor.dtype == torch.bfloat16 and obj.tensor.is_contiguous()
    assert obj.nbytes == 3 * 5 * 7 * 2 and obj.fmt == MemoryFormat.KV_2LTD and obj.is_pooled
    obj.tensor.fill_(1.5)
    assert bytes(obj.byte_view()) == obj.tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
    obj.ref_count_down()
    assert p.used_bytes == 0


def test_a_pool_block_gets_its_view_on_first_use_and_keeps_it_until_released():
    p = pool()
    obj = p.allocate((4, 8), torch.float32)
    assert obj is not None and p.view_cache_entries == 0  # an allocation makes no tensor
    assert obj.host_address == obj.data_ptr and p.view_cache_entries == 0  # nor does its address
    src = torch.arange(32, dtype=torch.float32)
    ctypes.memmove(obj.data_ptr, src.data_ptr(), 128)  # bytes by address
    view = obj.tensor
    assert view is obj.tensor and torch.equal(view, src.view(4, 8))
    with torch.inference_mode():  # a view made inside inference mode is still writable outside it
        late = p.allocate((4, 8), torch.float32)
        assert late is not None
        inner = late.tensor
    inner.add_(1)
    assert obj.host_address == obj.data_ptr == view.data_ptr()
    view.t_()  # a holder changed the view's metadata in place: no longer one contiguous run
    assert obj.host_address is None
    obj.ref_count_down()
    late.ref_count_down()
    with pytest.raises(RuntimeError, match="released"):
        _ = obj.tensor
    assert p.used_bytes == 0


def test_blocks_do_not_overlap():
    p = pool(64 * 1024)
    objs = [alloc(p, (100,), torch.float32) for _ in range(20)]
    for i, o in enumerate(objs):
        o.tensor.fill_(i)
    for i, o in enumerate(objs):
        assert torch.all(o.tensor == i)


def test_exhaustion_returns_none_promptly():
    p = pool(1 << 20)
    held = []
    while (o := p.allocate((1024,), torch.float32)) is not None:
        held.append(o)
    assert len(held) == (1 << 20) // 4096
    best = min(_time(lambda: p.allocate((1024,), torch.float32)) for _ in range(20))
    assert best < 1e-3  # returns None at once: no sleeping, no spinning
    assert p.allocate((1,), torch.uint8) is None
    assert p.allocate((1 << 30,), torch.uint8) is None


def _time(fn) -> float:
    t0 = time.perf_counter()
    assert fn() is None
    return time.perf_counter() - t0


def test_fragmentation_churn_keeps_pool_allocatable():
    size = 8 << 20
    p = pool(size)
    rng = random.Random(0)
    live: list[MemoryObj] = []
    for _ in range(20_000):
        if live and (rng.random() < 0.5 or p.free_bytes < 512 << 10):
            live.pop(rng.randrange(len(live))).ref_count_down()
        else:
            n = rng.choice([256, 1000, 4096, 70_000, 300_000])
            o = p.allocate((n,), torch.uint8)
            if o is not None:
                live.append(o)
    for o in live:
        o.ref_count_down()
    assert p.used_bytes == 0
    assert p.largest_free_block() >= 0.9 * size  # coalesced back (in fact one block)
    big = p.allocate((int(0.9 * size),), torch.uint8)
    assert big is not None


def test_ref_counting_and_double_release():
    p = pool()
    o = alloc(p, (10,), torch.float32)
    o.ref_count_up()
    assert o.get_ref_count() == 2
    o.ref_count_down()
    assert p.used_bytes > 0
    o.ref_count_down()
    assert p.used_bytes == 0 and o.get_ref_count() == 0
    with pytest.raises(DoubleReleaseError):
        o.ref_count_down()
    with pytest.raises(DoubleReleaseError):
        o.ref_count_up()
    with pytest.raises(RuntimeError):
        _ = o.tensor


def test_context_manager_releases():
    p = pool()
    with alloc(p, (10,), torch.float32) as o:
        assert o.get_ref_count() == 1
    assert p.used_bytes == 0


def test_ref_counts_are_thread_safe():
    p = pool()
    o = alloc(p, (10,), torch.float32)

    def churn():
        for _ in range(20_000):
            o.ref_count_up()
            o.ref_count_down()

    ts = [threading.Thread(target=churn) for _ in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert o.get_ref_count() == 1
    o.ref_count_down()
    assert p.used_bytes == 0


def test_pool_larger_than_available_memory_is_refused():
    avail = memory_available_bytes()
    if avail is None:
        pytest.skip("MemAvailable not readable on this platform")
    with pytest.raises(PoolSizeError, match="does not fit"):
        PoolAllocator(avail + GiB, name="huge", pretouch=False)


def test_pretouch_never_changes_contents():
    p = PoolAllocator(64 << 20, name="touch", pretouch=True)
    o = alloc(p, (1 << 20,), torch.float32)
    o.tensor.fill_(3.0)
    assert p.wait_ready(30)
    assert torch.all(o.tensor == 3.0)
    o.ref_count_down()


def test_stopping_the_pretouch_ends_its_thread_and_lets_the_pool_go():
    import gc
    import weakref

    p = PoolAllocator(1 * GiB, name="stopped", pretouch=True)
    thread = p._pretouch_thread
    assert thread is not None
    p.stop_pretouch(timeout=10)
    assert not thread.is_alive() and p.wait_ready(0)  # stopped within a step, ready (pages fault on use)
    ref = weakref.ref(p)
    del p
    gc.collect()
    assert ref() is None  # nothing else held it
    PoolAllocator(1 << 20, name="never", pretouch=False).stop_pretouch()  # no thread: a no-op


def test_heap_allocator_for_oversized_reads():
    h = HeapAllocator("h", pin=False)
    o = h.allocate((5, 3), torch.float16)
    assert not o.is_pooled and o.tensor.shape == (5, 3)
    o.tensor.fill_(2)
    assert bytes(o.byte_view()) == o.tensor.numpy().tobytes()
    o.ref_count_down()
    assert h.used_bytes == 0


@pytest.mark.parametrize(("shape", "exc"), [((-1, 2), ValueError), ((1.5,), TypeError), ("ab", TypeError)])
def test_bad_shapes_raise(shape, exc):
    with pytest.raises(exc):
        pool().allocate(shape, torch.float32)


def test_heap_objects_report_their_real_address():
    h = HeapAllocator("h", pin=False)
    o = h.allocate((16,), torch.float32)
    assert o.data_ptr == o.tensor.data_ptr()
    o.ref_count_down()


def test_reused_block_gets_a_correct_view_even_after_in_place_metadata_changes():
    p = pool()
    o = alloc(p, (4, 4), torch.float32)
    o.tensor.t_()  # a holder reshapes its view in place
    o.ref_count_down()
    again = alloc(p, (4, 4), torch.float32)
    assert again.tensor.shape == (4, 4) and again.tensor.is_contiguous()
    again.ref_count_down()


# A cached view costs about 800 bytes (measured with the tensor, its key and its strides).
_VIEW_BYTES = 800


def _churn_distinct_views(p: PoolAllocator, n: int, seed: int) -> None:
    rng = random.Random(seed)
    held: list = []
    for i in range(n):
        shape = (rng.randrange(1, 64), rng.randrange(1, 64))
        o = p.allocate(shape, torch.float32)
        if o is None:
            while held:
                held.pop().ref_count_down()
            continue
        assert o.tensor.shape == shape and o.tensor.is_contiguous()
        assert o.tensor.data_ptr() == o.data_ptr
        held.append(o)
        if len(held) > 1 + i % 7:
            held.pop(rng.randrange(len(held))).ref_count_down()
    for o in held:
        o.ref_count_down()


def test_a_small_pools_view_cache_stays_a_small_fraction_of_the_pool():
    p = pool(1 << 20)
    _churn_distinct_views(p, 5_000, seed=3)
    assert len(p._view_cache) * _VIEW_BYTES <= p.capacity // 16, f"{len(p._view_cache)} views cached"
    assert p.view_cache_entries <= p.view_cache_limit
    assert p.used_bytes == 0


def test_the_view_cache_bound_holds_under_concurrent_allocations():
    p = pool(2 << 20)
    threads = [threading.Thread(target=_churn_distinct_views, args=(p, 2_000, s)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(p._view_cache) * _VIEW_BYTES <= p.capacity // 16, f"{len(p._view_cache)} views cached"
    assert len(p._view_cache) <= p.view_cache_limit
    assert p.used_bytes == 0


def test_the_view_cache_bound_grows_with_the_pool_but_stays_a_small_fraction():
    for capacity in (1 << 20, 64 << 20, 256 << 20, GiB, 64 * GiB):
        limit = view_cache_limit(capacity)
        assert limit >= 64
        assert limit * _VIEW_BYTES <= max(capacity // 32, 64 * _VIEW_BYTES)
    assert view_cache_limit(GiB) > view_cache_limit(64 << 20)


def test_views_of_reused_blocks_stay_correct_when_the_view_cache_is_full():
    p = pool(1 << 20)
    _churn_distinct_views(p, 3_000, seed=5)  # fills the cache past its limit, evicting and refreshing
    for _ in range(200):
        o = alloc(p, (16, 16), torch.float32)
        o.tensor.fill_(2.0)
        assert o.tensor.shape == (16, 16) and o.tensor.data_ptr() == o.data_ptr
        assert torch.all(o.tensor == 2.0)
        o.ref_count_down()
    assert len(p._view_cache) <= p.view_cache_limit


def test_a_process_exiting_while_its_pool_is_still_pretouched_exits_cleanly(tmp_path) -> None:
    """The exit hook stops the pre-touch thread between steps and waits for it (a daemon
    thread still in ``madvise`` when the interpreter finalizes aborts the process)."""
    import subprocess
    import sys

    script = tmp_path / "exit_early.py"
    script.write_text(
        "import threading\n"
        "from lmcache_async import memory\n"
        "pool = memory.PoolAllocator(512 << 20, name='early')\n"
        "t = [t for t in threading.enumerate() if t.name.startswith('lmcache-async-pretouch')]\n"
        "assert t and all(x in memory._PRETOUCH_THREADS for x in t), t\n"
        "assert not memory._PRETOUCH_STOP.is_set()\n"
    )
    for _ in range(3):
        proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False)
        assert proc.returncode == 0, proc.stderr
