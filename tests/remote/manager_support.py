"""Helpers of the tests that fail a remote store under a manager (Redis, Mooncake, S3): a seeded
tensor, the remote tier's hit count, and waiting until the tier serves again."""

from __future__ import annotations

import time

import torch

from lmcache_async import StorageManager
from lmcache_async.testing import make_key


def tensor(seed: int) -> torch.Tensor:
    """A 128 × 256 float tensor, the same for the same seed."""
    return torch.randn(128, 256, generator=torch.Generator().manual_seed(seed))


def remote_hits(sm: StorageManager) -> int:
    """The remote tier's hit count."""
    return int(sm.stats()["tiers"]["remote"]["hits"])


def wait_recovered(sm: StorageManager, start: int, deadline_s: float = 60.0, pause_s: float = 0.2) -> int:
    """Put/flush/get fresh keys (seeds from ``start``) until the remote tier serves one again;
    returns the next seed. Raises ``AssertionError`` with the tier's counters at the deadline."""
    deadline = time.monotonic() + deadline_s
    i = start
    while time.monotonic() < deadline:
        key = make_key(i)
        t = tensor(i)
        assert sm.put_sync(key, t)
        sm.flush_sync(30)
        hits = remote_hits(sm)
        got = sm.get_sync(key)
        i += 1
        if got is not None:
            with got:
                assert torch.equal(got.tensor, t)
            if remote_hits(sm) > hits:
                return i
        time.sleep(pause_s)
    raise AssertionError(f"remote tier did not recover: {sm.stats()['tiers']['remote']}")
