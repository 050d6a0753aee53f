"""The tier contract as the manager uses it: declared capabilities, the `tiers:` section, removal
reports, one "cannot tell" sentinel, and the old import paths."""

from __future__ import annotations

import importlib
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from lmcache_async.config import LMCacheEngineConfig, load_engine_config
from lmcache_async.errors import ConfigError
from lmcache_async.testing import make_key
from lmcache_async.testing.declarations import declaration_problems
from lmcache_async.tiers import UNKNOWN, Presence, RemovalReason, TierSpec, configured_tiers, register_tier
from lmcache_async.tiers.registry import TIER_NAMES


def test_the_flat_keys_and_the_tiers_section_say_the_same(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"tiers:\n  disk: {{path: {tmp_path}/d, size_gib: 2}}\n  cpu: {{size_gib: 0.5}}\n")
    cfg = load_engine_config(path)
    assert cfg.local_disk == f"{tmp_path}/d" and cfg.max_local_disk_size == 2 and cfg.max_local_cpu_size == 0.5
    assert "tiers.disk.path" in cfg.source_of("local_disk")
    assert configured_tiers(cfg) == ["cpu", "disk"]


def test_an_unknown_builtin_setting_is_refused_naming_it() -> None:
    with pytest.raises(ConfigError, match=r"tiers\.disk\.colour"):
        LMCacheEngineConfig.from_dict({"tiers": {"disk": {"colour": "blue"}}})


def test_the_tiers_section_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMCACHE_TIERS", '{"remote": {"url": "redis://h:1"}}')
    assert LMCacheEngineConfig.from_env().remote_url == "redis://h:1"


def test_one_list_of_builtin_tier_names_is_the_default_order() -> None:
    assert tuple(LMCacheEngineConfig().tier_order) == TIER_NAMES


def test_the_cpu_tier_reports_evictions_and_removals(make_manager: Any) -> None:
    sm = make_manager(max_local_cpu_size=1 / 1024)  # 1 MiB
    heard: list[tuple[str, list[Any], RemovalReason]] = []
    sm.removals.add(lambda tier, keys, reason: heard.append((tier, list(keys), reason)))
    for i in range(6):
        assert sm.put_sync(make_key(i), torch.zeros(64 * 1024))  # 256 KiB each
    assert any(t == "cpu" and r is RemovalReason.EVICTED and make_key(0) in k for t, k, r in heard)
    assert sm.remove_sync(make_key(5))
    assert ("cpu", [make_key(5)], RemovalReason.DELETED) in heard


def test_the_disk_tier_reports_a_damaged_record(make_manager: Any, tmp_path: Path) -> None:
    from lmcache_async.disk.layout import entry_path, key_digest

    sm = make_manager(local_cpu=False, local_disk=str(tmp_path), max_local_disk_size=0.01, tier_order=["disk"])
    heard: list[tuple[str, list[Any], RemovalReason]] = []
    sm.removals.add(lambda tier, keys, reason: heard.append((tier, list(keys), reason)))
    key = make_key(1)
    assert sm.put_sync(key, torch.arange(1024.0))
    sm.flush_sync()
    path = entry_path(str(tmp_path), key_digest(key.to_string()))
    data = bytearray(Path(path).read_bytes())
    data[-1] ^= 0xFF
    Path(path).write_bytes(data)
    assert sm.get_sync(key) is None
    assert ("disk", [key], RemovalReason.DAMAGED) in heard


def test_a_registered_tier_gets_its_validated_settings(make_manager: Any) -> None:
    from pydantic import BaseModel

    from lmcache_async.testing.memory_backend import InMemoryBackend

    class Settings(BaseModel):
        capacity_bytes: int = 1

    seen: list[Any] = []

    def create(ctx: Any) -> InMemoryBackend:
        seen.append(ctx.settings)
        return InMemoryBackend(ctx, capacity_bytes=ctx.settings.capacity_bytes, name="settled")

    register_tier("settled", TierSpec(factory=create, settings=Settings), replace=True)
    sm = make_manager(tiers={"settled": {"capacity_bytes": 4096}})
    assert sm.tier_names == ["cpu", "settled"] and seen[0].capacity_bytes == 4096
    assert not declaration_problems(sm.backend("settled"))


def test_the_old_sentinels_are_the_one_sentinel() -> None:
    from lmcache_async._manager.tier_guard import NO_ANSWER
    from lmcache_async.sync_bridge import NOT_HERE

    assert NO_ANSWER is UNKNOWN and NOT_HERE is UNKNOWN
    assert Presence.UNKNOWN is UNKNOWN  # the tri-state presence's "cannot tell" is the same object
    assert not UNKNOWN and not Presence.ABSENT and Presence.PRESENT  # "cannot tell" is never "held"


def test_a_tier_answering_none_on_the_callers_thread_is_asked_on_the_loop(make_manager: Any) -> None:
    """A tier written for the contract's first release answers ``contains_nowait`` with None:
    the manager reads it as UNKNOWN (asks the loop), never as absent."""
    from lmcache_async.testing.memory_backend import InMemoryBackend

    class OldStyle(InMemoryBackend):
        def contains_nowait(self, key: Any) -> Any:
            return None

    register_tier("old-style", TierSpec(factory=lambda ctx: OldStyle(ctx, name="old-style")), replace=True)
    sm = make_manager(local_cpu=False, tiers={"old-style": {}}, tier_order=["old-style"])
    key = make_key(5)
    assert sm.put_sync(key, torch.arange(8.0))
    sm.flush_sync()
    assert sm.contains_sync(key) and sm.prefix_len_sync([key, make_key(6)]) == 1
    assert sm.locate_sync([key, make_key(6)]) == ["old-style", None]


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("lmcache_async.backend", "StorageBackend"),
        ("lmcache_async.backend", "register_backend"),
        ("lmcache_async._manager.put_path", "DirectPutTier"),
    ],
)
def test_an_old_import_path_still_works_and_warns(module: str, name: str) -> None:
    with pytest.warns(DeprecationWarning, match="moved to lmcache_async"):
        value = getattr(importlib.import_module(module), name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert value is not None


def test_batched_contains_is_a_deprecated_name_of_prefix_len(make_manager: Any) -> None:
    sm = make_manager()
    assert sm.put_sync(make_key(1), torch.zeros(4))
    assert sm.prefix_len_sync([make_key(1), make_key(2)]) == 1
    with pytest.warns(DeprecationWarning, match="prefix_len"):
        assert sm.batched_contains_sync([make_key(1)]) == 1
