"""A third-party tier, installed by entry point, as a user of the tier contract meets it: the
conformance kit, a YAML ``tiers:`` section, the StorageManager and ``lmcache-async serve``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from lmcache_async.config import LMCacheEngineConfig, load_engine_config
from lmcache_async.errors import ConfigError
from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import MemoryObj, PoolAllocator
from lmcache_async.storage_manager import StorageManager
from lmcache_async.testing import BackendConformanceTests, make_key
from lmcache_async.testing.declarations import declaration_problems
from lmcache_async.testing.eviction_conformance import KEY_BASE, eviction_problems
from lmcache_async.tiers import BackendContext, RemovalReason, StorageBackend, configured_tiers, known_backends

example_tier: Any = pytest.importorskip("example_tier", reason="install tests/third_party_tier (nox does)")


class TestExampleTierConformance(BackendConformanceTests):
    async def make_backend(self, ctx: BackendContext, location: Path) -> StorageBackend:
        return example_tier.ExampleTier(ctx, example_tier.ExampleSettings(capacity_bytes=256 << 20))

    async def make_bounded_backend(self, ctx: BackendContext, location: Path, capacity_bytes: int) -> StorageBackend:
        return example_tier.ExampleTier(ctx, example_tier.ExampleSettings(capacity_bytes=capacity_bytes))


def _yaml(tmp_path: Path, text: str) -> LMCacheEngineConfig:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return load_engine_config(path)


def test_the_entry_point_registers_it() -> None:
    assert "example" in known_backends()


def test_a_yaml_tiers_section_turns_it_on_with_its_settings(tmp_path: Path) -> None:
    cfg = _yaml(tmp_path, "max_local_cpu_size: 0.01\ntiers:\n  example: {capacity_bytes: 8192, label: shelf}\n")
    assert configured_tiers(cfg) == ["cpu", "example"]
    with StorageManager(cfg) as sm:
        assert sm.tier_names == ["cpu", "example"]
        assert sm.stats()["tiers"]["example"]["capacity_bytes"] == 8192


def test_an_invalid_setting_is_refused_naming_it(tmp_path: Path) -> None:
    cfg = _yaml(tmp_path, "tiers:\n  example: {capacity_bytes: -1}\n")
    with pytest.raises(ConfigError, match=r"tiers\.example\.capacity_bytes"):
        StorageManager(cfg).close_sync()


def test_the_manager_writes_through_reads_back_and_hears_its_evictions(tmp_path: Path) -> None:
    cfg = _yaml(tmp_path, "max_local_cpu_size: 0.01\ntiers:\n  example: {capacity_bytes: 8192}\n")
    heard: list[tuple[str, list[Any], RemovalReason]] = []
    with StorageManager(cfg) as sm:
        sm.removals.add(lambda tier, keys, reason: heard.append((tier, list(keys), reason)))
        keys = [make_key(i) for i in range(3)]
        for i, k in enumerate(keys):
            assert sm.put_sync(k, torch.full((512,), float(i)))  # 2 KiB each
        sm.flush_sync()
        sm.clear_sync()  # empties both tiers: the next get must come from a fresh write
        assert sm.put_sync(keys[0], torch.full((512,), 7.0))
        sm.flush_sync()
        assert sm.remove_sync(keys[0])
        assert ("example", [keys[0]], RemovalReason.DELETED) in heard
        for i in range(6):  # 12 KiB through an 8 KiB tier: the oldest are evicted
            assert sm.put_sync(make_key(100 + i), torch.full((512,), float(i)))
        sm.flush_sync()
        assert any(t == "example" and r is RemovalReason.EVICTED for t, _, r in heard)
        cpu = sm.backend("cpu")
        front = cpu.as_pool() if cpu is not None else None
        assert front is not None
        front.clear_nowait()  # the entry is then only in the example tier
        got = sm.get_sync(make_key(105))
        assert isinstance(got, MemoryObj) and torch.equal(got.tensor, torch.full((512,), 5.0))
        got.ref_count_down()


class _DeclaresLocal(example_tier.ExampleTier):
    """Declares a caller-thread reading side it does not have."""

    def as_local(self) -> Any:
        return self


def test_a_tier_declaring_a_capability_it_lacks_fails_the_kit_naming_it(backend_context: Any) -> None:
    tier = _DeclaresLocal(backend_context(), example_tier.ExampleSettings())
    problems = declaration_problems(tier)
    assert len(problems) == 1 and "capability 'local'" in problems[0] and "lookup" in problems[0]


class _EvictsSilently(example_tier.ExampleTier):
    """Declares reports_removals (as the example does) but drops its eviction reports."""

    def report_removed(self, keys: Sequence[CacheEngineKey], reason: RemovalReason) -> None:
        if reason is not RemovalReason.EVICTED:
            super().report_removed(keys, reason)


async def test_a_tier_evicting_without_reporting_fails_the_kit_naming_the_key(backend_context: Any) -> None:
    pool = PoolAllocator(8 << 20, name="src", pretouch=False)
    tier = _EvictsSilently(backend_context(), example_tier.ExampleSettings(capacity_bytes=64 << 10))
    problems = await eviction_problems(tier, pool, 64 << 10, wait_s=0.5)
    assert problems and f"no longer holds key {make_key(KEY_BASE)}" in problems[0], problems
    assert "EVICTED missing" in problems[0]
    assert await eviction_problems(example_tier.ExampleTier(backend_context(), tier.settings), pool, 64 << 10) == []


def test_lmcache_async_serve_uses_it_as_a_lower_tier(tmp_path: Path) -> None:
    from lmcache_async.testing.cache_server import CacheServerProcess

    server = CacheServerProcess(tmp_path / "srv", tiers={"example": {"capacity_bytes": 1 << 20}}).start()
    try:
        cfg = LMCacheEngineConfig.from_defaults(
            local_cpu=False, tier_order=["server"], cache_server_socket=server.socket
        )
        with StorageManager(cfg) as sm:
            assert sm.put_sync(make_key(1), torch.arange(256.0))
            sm.flush_sync()
        lower = server.status()["lower"]
        assert lower is not None and "example" in lower["tiers"]
        deadline_entries = lower["tiers"]["example"]["entries"]
        assert deadline_entries >= 0
    finally:
        server.stop()
