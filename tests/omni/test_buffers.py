"""PayloadBuffers: pre-touched blocks that become caller-owned tensors and come back when freed."""

from __future__ import annotations

import gc

import pytest
import torch

from lmcache_async.integration.omni.buffers import MIN_POOLED_BYTES, PayloadBuffers
from lmcache_async.memory import MemoryFormat, PoolAllocator

MiB = 1 << 20


@pytest.fixture
def buffers() -> PayloadBuffers:
    return PayloadBuffers(8 * MiB, "test payload buffers")


def test_a_taken_block_is_the_tensor_without_a_copy(buffers: PayloadBuffers) -> None:
    obj = buffers.allocate([MiB // 2], torch.bfloat16)
    obj.tensor.copy_(torch.arange(MiB // 2).to(torch.bfloat16))
    ptr = obj.data_ptr
    t = buffers.take(obj)
    assert t.data_ptr() == ptr
    assert t.dtype == torch.bfloat16 and tuple(t.shape) == (MiB // 2,)
    assert torch.equal(t, torch.arange(MiB // 2).to(torch.bfloat16))
    assert buffers.stats()["pooled"] == 1


def test_the_block_returns_only_when_the_last_sharer_of_its_storage_is_freed(buffers: PayloadBuffers) -> None:
    free0 = buffers.stats()["free"]
    t = buffers.empty([MiB], torch.float32)
    assert buffers.stats()["free"] == free0 - 4 * MiB
    view = t[10:20]
    arr = t.numpy()
    del t
    gc.collect()
    assert buffers.stats()["free"] == free0 - 4 * MiB
    del view
    gc.collect()
    assert buffers.stats()["free"] == free0 - 4 * MiB
    del arr
    gc.collect()
    assert buffers.stats()["free"] == free0


def test_a_freed_block_is_reused_by_the_next_get(buffers: PayloadBuffers) -> None:
    t = buffers.empty([MiB], torch.uint8)
    ptr = t.data_ptr()
    del t
    assert buffers.empty([MiB], torch.uint8).data_ptr() == ptr


def test_small_payloads_and_a_full_pool_get_fresh_memory(buffers: PayloadBuffers) -> None:
    small = buffers.empty([MIN_POOLED_BYTES // 8], torch.uint8)
    held = [buffers.empty([4 * MiB], torch.uint8) for _ in range(2)]  # the whole pool
    extra = buffers.empty([4 * MiB], torch.uint8)
    st = buffers.stats()
    assert st["pooled"] == 2 and st["fresh"] == 2 and st["free"] == 0
    extra.fill_(3)
    assert int(extra.sum()) == 3 * 4 * MiB
    del small, held


def test_a_block_of_another_allocator_is_copied_and_released(buffers: PayloadBuffers) -> None:
    other = PoolAllocator(2 * MiB, name="other", pretouch=False)
    obj = other.allocate([MiB], torch.uint8)
    assert obj is not None
    obj.tensor.fill_(7)
    t = buffers.take(obj)
    assert obj.get_ref_count() == 0 and other.free_bytes == other.capacity
    assert t.data_ptr() != obj.data_ptr and int(t[0]) == 7 and t.numel() == MiB


def test_tensors_are_not_inference_tensors_even_when_taken_in_inference_mode(buffers: PayloadBuffers) -> None:
    with torch.inference_mode():
        t = buffers.empty([MiB], torch.float32)
        small = buffers.empty([4], torch.float32)
    assert not t.is_inference() and not small.is_inference()
    t.add_(1)  # in-place outside inference mode works


def test_a_zero_size_pool_allocates_every_buffer_afresh() -> None:
    b = PayloadBuffers(0, "none")
    obj = b.allocate([MiB], torch.uint8, MemoryFormat.BINARY)
    assert b.capacity == 0 and b.stats()["fresh"] == 1
    t = b.take(obj)
    assert t.numel() == MiB


def test_a_negative_size_is_refused() -> None:
    with pytest.raises(ValueError, match="size_bytes"):
        PayloadBuffers(-1, "bad")
