"""Keys and source objects for the conformance classes: deterministic, distinct per seed."""

from __future__ import annotations

from typing import Any

import torch

from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import MemoryFormat, MemoryObj, PoolAllocator

__all__ = ["make_key", "make_obj", "same_entry"]


def make_key(i: int, model: str = "conformance/model", **kw: Any) -> CacheEngineKey:
    """A distinct key per ``i``."""
    return CacheEngineKey(
        model,
        kw.get("world_size", 1),
        kw.get("worker_id", 0),
        (i * 0x9E3779B97F4A7C15 + 1) & ((1 << 64) - 1),
        kw.get("dtype", torch.bfloat16),
        kw.get("request_configs"),
    )


def make_obj(
    pool: PoolAllocator,
    shape: tuple[int, ...] = (64, 128),
    dtype: torch.dtype = torch.float32,
    fmt: MemoryFormat = MemoryFormat.KV_2LTD,
    seed: int = 0,
) -> MemoryObj:
    """A pool block filled with deterministic data for ``seed``."""
    obj = pool.allocate(shape, dtype, fmt)
    assert obj is not None, "test pool exhausted"
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        obj.tensor.copy_(torch.randn(shape, generator=g).to(dtype))
    elif dtype == torch.bool:
        obj.tensor.copy_(torch.randint(0, 2, shape, generator=g).bool())
    else:
        info = torch.iinfo(dtype)
        lo, hi = max(info.min, -1000), min(info.max, 1000)
        obj.tensor.copy_(torch.randint(lo, hi, shape, generator=g).to(dtype))
    return obj


def same_entry(a: MemoryObj, b: MemoryObj) -> bool:
    """Same shape, dtype, format and payload bytes."""
    return a.shape == b.shape and a.dtype == b.dtype and a.fmt == b.fmt and bytes(a.byte_view()) == bytes(b.byte_view())
