"""Helpers of the NIXL tier's backend tests (test_nixl_backend*.py): opening a tier on a
directory through the POSIX plugin, finding an entry's record file or slot, filling pool memory and
comparing bytes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from lmcache_async.memory import MemoryFormat, MemoryObj
from lmcache_async.nixl.io import RECORD_SUFFIX, KeyFileLayout
from lmcache_async.nixl.tier import NixlBackend, NixlSettings
from lmcache_async.tiers import BackendContext

MiB = 1 << 20
LAYOUTS = [pytest.param(0, id="files"), pytest.param(8, id="slots")]


async def _open(ctx: BackendContext, root: Path, pool_size: int = 0, max_bytes: int = 256 * MiB, **kw) -> NixlBackend:
    be = NixlBackend(ctx, NixlSettings(plugin="POSIX", path=str(root), pool_size=pool_size, max_bytes=max_bytes, **kw))
    await be.start()
    return be


def _records(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.name.endswith(RECORD_SUFFIX))


def _record_of(be: NixlBackend, key) -> Path:
    entry = be._index[key]
    assert be.root is not None
    if isinstance(entry.location, int):
        return be.root / f"slot-{entry.location:06d}{RECORD_SUFFIX}"
    return be.root / f"{entry.location}{RECORD_SUFFIX}"


def _key_files(be: NixlBackend) -> KeyFileLayout:
    """The tier's layout of one file a key (the default: no slot pool, a file path)."""
    layout = be._layout
    assert isinstance(layout, KeyFileLayout)
    return layout


def _slot_of(be: NixlBackend, key) -> int:
    """The slot of ``key`` in a tier with a slot pool."""
    location = be._index[key].location
    assert isinstance(location, int)
    return location


def _eq(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte equality (random bytes may be NaNs as floats)."""
    return a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


async def _reads_back(be: NixlBackend, key, obj: MemoryObj) -> None:
    """``key`` reads back with ``obj``'s bytes (the copy read is given back)."""
    got = await be.get(key)
    assert got is not None and _eq(got.tensor, obj.tensor)
    got.ref_count_down()


async def _settle(be: NixlBackend) -> None:
    while be._tasks:
        await asyncio.gather(*list(be._tasks), return_exceptions=True)


def _obj(ctx: BackendContext, fill, nbytes: int, seed: int) -> MemoryObj:
    assert ctx.pool is not None
    return fill(ctx.pool.allocate((nbytes // 4,), torch.float32, MemoryFormat.KV_2LTD), seed)
