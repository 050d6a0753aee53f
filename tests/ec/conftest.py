"""Fixtures of the encoder-cache tests: engines that always close, disk-tier availability."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest
import torch

from lmcache_async import LMCacheEngineConfig, LMCacheEngineMetadata
from lmcache_async.engines.encoder_cache import ECCacheEngine

from .helpers import MiB, gib

if TYPE_CHECKING:
    from lmcache_async.integration.vllm import LMCacheECConnectorImpl


@pytest.fixture
def ec_config() -> Callable[..., LMCacheEngineConfig]:
    """Config factory: a 32 MiB CPU pool and an 8 MiB staging area unless overridden."""

    def make(**overrides: Any) -> LMCacheEngineConfig:
        base: dict[str, Any] = {
            "max_local_cpu_size": gib(32 * MiB),
            "staging_size": gib(8 * MiB),
            "blocking_timeout_secs": 10,
        }
        base.update(overrides)
        return LMCacheEngineConfig.from_defaults(**base)

    return make


@pytest.fixture
def make_engine(
    ec_config: Callable[..., LMCacheEngineConfig],
) -> Iterator[Callable[..., ECCacheEngine]]:
    """Factory of ECCacheEngines closed at the end of the test.

    ``make_engine(config=None, *, model="vl-model", worker_id=0, world_size=1,
    kv_dtype=torch.bfloat16, encoder_dtype=torch.bfloat16, **config_overrides)``.
    """
    made: list[ECCacheEngine] = []

    def make(
        config: LMCacheEngineConfig | None = None,
        *,
        model: str = "vl-model",
        worker_id: int = 0,
        world_size: int = 1,
        kv_dtype: torch.dtype = torch.bfloat16,
        encoder_dtype: torch.dtype | str = torch.bfloat16,
        **overrides: Any,
    ) -> ECCacheEngine:
        cfg = config if config is not None else ec_config(**overrides)
        meta = LMCacheEngineMetadata(model_name=model, world_size=world_size, worker_id=worker_id, kv_dtype=kv_dtype)
        engine = ECCacheEngine(cfg, meta, encoder_dtype)
        made.append(engine)
        return engine

    yield make
    for e in made:
        if not e.closed:
            e.close()
    gc.collect()


@pytest.fixture
def connectors() -> Iterator[list[LMCacheECConnectorImpl]]:
    """The vLLM connector tests' connectors (test_connector_impl*.py), closed at the end of the test."""
    made: list[LMCacheECConnectorImpl] = []
    yield made
    for c in made:
        c.close()
