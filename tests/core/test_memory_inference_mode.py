"""Blocks allocated inside ``torch.inference_mode()`` (a vLLM worker) stay writable outside it."""

from __future__ import annotations

import torch

from lmcache_async.memory import HeapAllocator, PoolAllocator


def test_pool_view_made_in_inference_mode_is_writable_outside_it() -> None:
    pool = PoolAllocator(1 << 20, name="t", pretouch=False)
    with torch.inference_mode():
        obj = pool.allocate((4, 8), torch.float32)
        assert obj is not None
        obj.tensor.copy_(torch.ones(4, 8))
    obj.ref_count_down()
    # The same offset and shape come back from the view cache: a write outside inference mode
    # must work on it.
    again = pool.allocate((4, 8), torch.float32)
    assert again is not None
    src = torch.randn(4, 8)
    again.tensor.copy_(src)
    assert torch.equal(again.tensor, src)
    assert not again.tensor.is_inference()
    again.ref_count_down()


def test_heap_buffer_made_in_inference_mode_is_writable_outside_it() -> None:
    heap = HeapAllocator()
    with torch.inference_mode():
        obj = heap.allocate((3, 5), torch.float16)
    src = torch.randn(3, 5).half()
    obj.tensor.copy_(src)
    assert torch.equal(obj.tensor, src)
    obj.ref_count_down()
