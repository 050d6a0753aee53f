"""Shared fixtures: small configs, metadata and managers that always close."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from lmcache_async import LMCacheEngineConfig, LMCacheEngineMetadata, StorageManager
from lmcache_async.token_database import ChunkedTokenDatabase

_CHAOS_DIR = Path(__file__).resolve().parent / "chaos"

# ``--hypothesis-profile=quick`` (the fast lane, ``nox -s quick``): few examples per property. Tests
# that choose their own counts cap them at the loaded profile's (``settings.default``), so without
# the option they run the counts written in them.
try:
    from hypothesis import settings
except ImportError:  # an environment without the test extra (its tests use no Hypothesis)
    pass
else:
    settings.register_profile("quick", max_examples=10, stateful_step_count=20)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Move everything alive after collection (torch, hypothesis, the test modules) to the
    permanent GC generation: the fixtures' ``gc.collect()`` then walks only what the tests made.
    Garbage is collected first, so nothing unreachable is kept; what tests create is collected
    as before."""
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Everything under ``tests/chaos`` is a chaos test (``-m "not chaos"`` leaves it out)."""
    chaos = pytest.mark.chaos
    for item in items:
        if _CHAOS_DIR in Path(str(item.path)).resolve().parents and item.get_closest_marker("chaos") is None:
            item.add_marker(chaos)


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test sees the developer's LMCACHE_* configuration variables (the test-suite switches
    ``LMCACHE_ASYNC_*`` stay)."""
    import os

    for var in list(os.environ):
        if var.startswith("LMCACHE_") and not var.startswith("LMCACHE_ASYNC_"):
            monkeypatch.delenv(var)


@pytest.fixture
def metadata() -> LMCacheEngineMetadata:
    return LMCacheEngineMetadata(model_name="test-model", world_size=1, worker_id=0, kv_dtype=torch.bfloat16)


@pytest.fixture
def small_config() -> Callable[..., LMCacheEngineConfig]:
    """Config factory with a 64 MiB CPU pool and a 16 MiB staging area by default."""

    def make(**overrides: Any) -> LMCacheEngineConfig:
        base: dict[str, Any] = {"max_local_cpu_size": 1 / 16, "staging_size": 1 / 64, "blocking_timeout_secs": 10}
        base.update(overrides)
        return LMCacheEngineConfig.from_defaults(**base)

    return make


@pytest.fixture
def make_manager(
    small_config: Callable[..., LMCacheEngineConfig], metadata: LMCacheEngineMetadata
) -> Iterator[Callable[..., StorageManager]]:
    """Factory of StorageManagers closed at the end of the test."""
    made: list[StorageManager] = []

    def make(config: LMCacheEngineConfig | None = None, **overrides: Any) -> StorageManager:
        sm = StorageManager(config if config is not None else small_config(**overrides), metadata)
        made.append(sm)
        return sm

    yield make
    for sm in made:
        if not sm.closed:
            sm.close_sync()
    gc.collect()


@pytest.fixture
def token_db(metadata: LMCacheEngineMetadata) -> ChunkedTokenDatabase:
    return ChunkedTokenDatabase(256, metadata=metadata)
