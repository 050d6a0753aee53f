"""Entries the node-server tests put and check: key bytes, seeded payloads, a polling wait."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from lmcache_async.memory import MemoryFormat, PoolAllocator
from lmcache_async.server.client import ServerClient
from lmcache_async.testing.conformance import make_key, make_obj

__all__ = ["expected", "key_bytes", "put_entry", "wait_until"]


def key_bytes(i: int) -> bytes:
    """The wire key of test entry ``i``."""
    return make_key(i).to_string().encode()


def put_entry(client: ServerClient, pool: PoolAllocator, i: int, shape: tuple[int, ...] = (64, 64)) -> bool:
    """Put entry ``i`` (payload seeded by ``i``) through ``client``; True when stored."""
    obj = make_obj(pool, shape, torch.float32, MemoryFormat.KV_2LTD, seed=i)
    try:
        res = client.put([(key_bytes(i), obj)])
        return bool(res and res[0])
    finally:
        obj.ref_count_down()


def expected(i: int, shape: tuple[int, ...] = (64, 64)) -> torch.Tensor:
    """The payload :func:`put_entry` stores for entry ``i``."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(i))


def wait_until(pred: Callable[[], object], timeout: float = 30.0, step: float = 0.02) -> bool:
    """Poll ``pred`` until it is true or ``timeout`` seconds pass; its last answer as a bool."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return bool(pred())
