"""Fixtures of the real-engine tests: the tiny model and a redis server (see test_vllm_engine.py
for when these tests run, skip or fail)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from .engines import ROOT, Redis


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The tiny LLaVA (built once, cached under ~/.cache/lmcache-async unless
    ``LMCACHE_E2E_MODEL`` names a directory)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import tiny_llava  # type: ignore[import-not-found]  # found on sys.path at run time

    target = os.environ.get("LMCACHE_E2E_MODEL") or str(
        Path.home() / ".cache" / "lmcache-async" / f"model-{tiny_llava.RECIPE}"
    )
    return tiny_llava.build(target)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Redis]:
    r = Redis(tmp_path_factory.mktemp("redis")).start()
    yield r
    r.kill()


KV_MODEL_SIZES = {"layers": 4, "hidden": 512, "heads": 8, "kv_heads": 4}
"""The KV-connector tests' model: small enough to start quickly, large enough that an uncached
prefill of the test prompt is clearly slower than a restored one."""


@pytest.fixture(scope="session")
def kv_model_dir() -> Path:
    """The tiny float32 Llama of the KV-connector tests (``scripts/tiny_llama.py``; built once,
    cached under ~/.cache/lmcache-async unless ``LMCACHE_E2E_KV_MODEL`` names a directory)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import tiny_llama  # type: ignore[import-not-found]  # found on sys.path at run time

    sizes = "-".join(f"{k}{v}" for k, v in KV_MODEL_SIZES.items())
    target = os.environ.get("LMCACHE_E2E_KV_MODEL") or str(
        Path.home() / ".cache" / "lmcache-async" / f"model-{tiny_llama.RECIPE}-{sizes}"
    )
    return Path(tiny_llama.build(target, **KV_MODEL_SIZES))
