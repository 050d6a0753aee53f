"""SGLang's own host KV pool (``MHATokenToKVPoolHost``) built on a machine without a GPU.

SGLang builds its host pool from the device pool's buffer description (``MHABufferInfo``: the
per-layer K/V tensors and their pointer tables). On CPU the same description can be made from
CPU tensors: the pool's constructor then allocates its ``kv_buffer`` with the default allocator
(``pin_memory=False`` skips ``cudaHostRegister``) and never touches CUDA. The transfer methods
to and from the device pool are not used here. For benchmarks, tests and trying the backend on a
CPU-only host; a serving SGLang passes its own pool to ``register_mem_pool_host``.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["build_cpu_host_pool"]


def build_cpu_host_pool(
    layout: str,
    *,
    layer_num: int = 4,
    head_num: int = 2,
    head_dim: int = 16,
    page_size: int = 16,
    page_num: int = 64,
    dtype: torch.dtype = torch.bfloat16,
) -> Any:
    """A real ``MHATokenToKVPoolHost`` of ``page_num`` pages in ``layout`` (``layer_first``,
    ``page_first``, ``page_first_direct``, ``page_head``), in pageable CPU memory.

    Its ``kv_buffer`` is uninitialised (fill it before comparing bytes). ``ImportError`` without
    SGLang; SGLang's own ``ValueError`` for a layout or geometry it refuses.
    """
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    for name, value in (
        ("layer_num", layer_num),
        ("head_num", head_num),
        ("head_dim", head_dim),
        ("page_size", page_size),
        ("page_num", page_num),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    device = torch.device("cpu")
    # The device pool: one [tokens, heads, head_dim] tensor per layer for K and for V (one page
    # of padding, as SGLang's device pools have); small, the host pool is what is used.
    tokens = page_size * 2
    k = tuple(torch.zeros(tokens, head_num, head_dim, dtype=dtype) for _ in range(layer_num))
    v = tuple(torch.zeros(tokens, head_num, head_dim, dtype=dtype) for _ in range(layer_num))
    ptrs = (torch.tensor([t.data_ptr() for t in k], dtype=torch.uint64),)
    vptrs = (torch.tensor([t.data_ptr() for t in v], dtype=torch.uint64),)
    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs[0], v_data_ptrs=vptrs[0], layout=KVBufferLayout.NHD),
        page_size=page_size,
        head_num=head_num,
        head_dim=head_dim,
        v_head_dim=head_dim,
        dtype=dtype,
        device=device,
    )
    capacity = page_num * page_size
    nbytes = 2 * layer_num * head_num * head_dim * capacity * dtype.itemsize
    # SGLang sizes its pool against free host memory minus a 10 GiB reserve; a budget scope
    # books this pool against its own size instead, so a small pool builds on a small host.
    with host_memory_budget_scope(nbytes):
        pool = MHATokenToKVPoolHost(
            info,
            1.0,
            0,
            page_size,
            layout,
            pin_memory=False,
            device="cpu",
            device_capacity_tokens=page_size,
            start_layer=0,
            end_layer=layer_num - 1,
            host_token_capacity=capacity,
        )
    # Keep the device-side tensors alive as long as the pool (their pointers are in its tables).
    pool._lmcache_device_buffers = (k, v)
    return pool
