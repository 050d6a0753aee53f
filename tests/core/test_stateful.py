"""Hypothesis stateful tests: the StorageManager against a dict model."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from support import membackend

from lmcache_async import LMCacheEngineConfig, LMCacheEngineMetadata, StorageManager
from lmcache_async.testing import make_key

KEYS = [make_key(i) for i in range(12)]
SIZES = [16, 1000, 40_000, 200_000]  # float32 elements: 64 B .. 800 KiB


def value(seed: int, size: int) -> torch.Tensor:
    return torch.full((size,), float(seed))


class _Base(RuleBasedStateMachine):
    lossless = True

    def __init__(self) -> None:
        super().__init__()
        membackend.register()
        cfg = LMCacheEngineConfig.from_defaults(
            max_local_cpu_size=2 / 1024,  # 2 MiB: evictions happen
            staging_size=4 / 1024,
            tier_order=["cpu", "testmem"] if self.lossless else ["cpu"],
        )
        self.sm = StorageManager(cfg, LMCacheEngineMetadata("stateful"), name="stateful")
        self.model: dict[int, tuple[int, int]] = {}

    def teardown(self) -> None:
        self.sm.close_sync()

    @rule(k=st.integers(0, len(KEYS) - 1), seed=st.integers(0, 1000), size=st.sampled_from(SIZES))
    def put(self, k: int, seed: int, size: int) -> None:
        # A key names its bytes (keys are content hashes), so a put of a key the model holds
        # carries that key's bytes again: the put must keep them readable (whichever tier holds
        # them). A put of an absent key (never put, removed, or evicted from a CPU-only cache)
        # stores these bytes.
        present = self.sm.contains_sync(KEYS[k])
        if self.lossless:
            assert present == (k in self.model)
        if present and k in self.model:
            seed, size = self.model[k]
        ok = self.sm.put_sync(KEYS[k], value(seed, size))
        if ok and not present:
            self.model[k] = (seed, size)

    @rule(k=st.integers(0, len(KEYS) - 1))
    def get(self, k: int) -> None:
        obj = self.sm.get_sync(KEYS[k])
        if k in self.model:
            if self.lossless:
                assert obj is not None, k
            if obj is not None:
                seed, size = self.model[k]
                assert obj.tensor.shape == (size,)
                assert bool(torch.all(obj.tensor == float(seed)))
        else:
            assert obj is None
        if obj is not None:
            assert obj.get_ref_count() >= 1
            obj.ref_count_down()
        if obj is None and k in self.model and not self.lossless:
            del self.model[k]  # evicted

    @rule(k=st.integers(0, len(KEYS) - 1))
    def contains(self, k: int) -> None:
        got = self.sm.contains_sync(KEYS[k])
        if self.lossless:
            assert got == (k in self.model)
        elif k not in self.model:
            assert not got

    @rule(k=st.integers(0, len(KEYS) - 1))
    def remove(self, k: int) -> None:
        removed = self.sm.remove_sync(KEYS[k])
        if self.lossless:
            assert removed == (k in self.model)
        self.model.pop(k, None)
        assert not self.sm.contains_sync(KEYS[k])

    @rule(n=st.integers(1, 6))
    def prefix(self, n: int) -> None:
        got = self.sm.prefix_len_sync(KEYS[:n])
        if self.lossless:
            expected = 0
            while expected < n and expected in self.model:
                expected += 1
            assert got == expected

    @rule()
    def flush(self) -> None:
        self.sm.flush_sync()

    @precondition(lambda self: len(self.model) > 0)
    @rule()
    def clear(self) -> None:
        self.sm.clear_sync()
        self.model.clear()
        assert self.sm.pool is not None
        assert self.sm.pool.used_bytes == 0

    @invariant()
    def pool_within_bounds(self) -> None:
        p = self.sm.pool
        assert p is not None
        assert 0 <= p.used_bytes <= p.capacity
        assert p.num_objects >= 0


class LosslessWithLowerTier(_Base):
    lossless = True


class CpuOnlyLossy(_Base):
    lossless = False


# 100 runs of 40 steps, or fewer under a smaller profile (``--hypothesis-profile=quick``).
_settings = settings(
    max_examples=min(100, settings().max_examples),
    stateful_step_count=min(40, settings().stateful_step_count),
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
TestLosslessWithLowerTier = LosslessWithLowerTier.TestCase
TestLosslessWithLowerTier.settings = _settings
TestCpuOnlyLossy = CpuOnlyLossy.TestCase
TestCpuOnlyLossy.settings = _settings
