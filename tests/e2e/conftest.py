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
    import tiny_llava

    target = os.environ.get("LMCACHE_E2E_MODEL") or str(
        Path.home() / ".cache" / "lmcache-async" / f"model-{tiny_llava.RECIPE}"
    )
    return tiny_llava.build(target)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Redis]:
    r = Redis(tmp_path_factory.mktemp("redis")).start()
    yield r
    r.kill()
