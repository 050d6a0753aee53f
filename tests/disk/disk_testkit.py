"""Helpers shared by the disk-tier tests (imported by module name: pytest puts this directory on
``sys.path``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from lmcache_async.disk.layout import ENTRY_SUFFIX, TMP_SUFFIX, entry_path, key_digest
from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import MemoryFormat, MemoryObj, PoolAllocator


def entry_files(root: Path | str) -> list[Path]:
    """Every entry file under ``root``."""
    return sorted(Path(root).glob(f"*/*{ENTRY_SUFFIX}"))


def tmp_files(root: Path | str) -> list[Path]:
    """Every temporary file under ``root``."""
    return sorted(Path(root).glob(f"*/.*{TMP_SUFFIX}"))


def dir_bytes(root: Path | str) -> int:
    """Bytes of the entry files under ``root`` (what the shared budget must equal)."""
    return sum(p.stat().st_size for p in entry_files(root))


def key(i: int, model: str = "disk/model") -> CacheEngineKey:
    """A distinct key per ``i``."""
    return CacheEngineKey(model, 1, 0, i, torch.bfloat16)


def path_of(root: Path | str, k: CacheEngineKey) -> Path:
    """The file that holds ``k``."""
    return Path(entry_path(os.fspath(root), key_digest(k.to_string())))


def payload(i: int, nbytes: int) -> torch.Tensor:
    """Deterministic bytes for entry ``i`` (so any process can check what it reads)."""
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def make_entry(pool: PoolAllocator, i: int, nbytes: int = 4096) -> MemoryObj:
    """A pool block holding :func:`payload` ``(i, nbytes)``."""
    obj = pool.allocate((nbytes,), torch.uint8, MemoryFormat.BINARY)
    assert obj is not None, "test pool exhausted"
    obj.tensor.copy_(payload(i, nbytes))
    return obj


def same_bytes(obj: MemoryObj, i: int, nbytes: int) -> bool:
    """True when ``obj`` holds exactly :func:`payload` ``(i, nbytes)``."""
    return obj.nbytes == nbytes and bytes(obj.byte_view()) == payload(i, nbytes).numpy().tobytes()


async def put_entry(be: Any, pool: PoolAllocator, i: int, nbytes: int = 4096) -> bool:
    """Put entry ``i`` (``nbytes`` of :func:`payload`) into the disk backend ``be``; the source
    block is released whatever happens."""
    obj = make_entry(pool, i, nbytes)
    try:
        return bool(await be.put(key(i), obj))
    finally:
        obj.ref_count_down()
