"""Fixtures of the SGLang backend tests: SGLang's real classes, no stand-ins.

Without SGLang the tests skip with the reason, unless ``LMCACHE_ASYNC_REQUIRE_SGLANG=1`` (its
nox session), which turns the skip into a failure. ``scripts/sglang_env.sh`` builds a venv with
SGLang and this project.
"""

from __future__ import annotations

import gc
import importlib.util
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

REQUIRE_ENV = "LMCACHE_ASYNC_REQUIRE_SGLANG"
# Read at import: the suite-wide fixture that isolates tests from LMCACHE_* variables removes it.
REQUIRE_SGLANG = os.environ.get(REQUIRE_ENV) == "1"
LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")


def _sglang_missing() -> str | None:
    if importlib.util.find_spec("sglang") is None:
        return "sglang is not installed (bash scripts/sglang_env.sh builds a venv with it)"
    import warnings

    try:
        # Imported once here: SGLang's import chain warns about GPU-only features on a CPU host,
        # which the suite's warnings-as-errors filter would turn into failures inside a test.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import sglang.srt.mem_cache.hicache_storage  # noqa: F401
            import sglang.srt.mem_cache.pool_host.mha  # noqa: F401
            import sglang.srt.mem_cache.storage.backend_factory  # noqa: F401
    except Exception as exc:  # an import that fails for a missing dependency
        return f"SGLang's HiCache modules do not import: {type(exc).__name__}: {exc}"
    return None


_MISSING = _sglang_missing()


@pytest.fixture(autouse=True)
def _needs_sglang() -> None:
    """Skip (or, with LMCACHE_ASYNC_REQUIRE_SGLANG=1, fail) every test here without SGLang."""
    if _MISSING is not None:
        if REQUIRE_SGLANG:
            pytest.fail(f"{_MISSING} ({REQUIRE_ENV}=1 requires it)")
        pytest.skip(_MISSING)


def storage_config(extra: dict[str, Any], **overrides: Any) -> Any:
    """SGLang's own HiCacheStorageConfig for one MHA TP rank, with ``extra`` as extra config."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    fields: dict[str, Any] = {
        "tp_rank": 0,
        "tp_size": 1,
        "pp_rank": 0,
        "pp_size": 1,
        "attn_cp_rank": 0,
        "attn_cp_size": 1,
        "is_mla_model": False,
        "enable_storage_metrics": False,
        "is_page_first_layout": False,
        "model_name": "test/model",
        "extra_config": extra,
    }
    fields.update(overrides)
    return HiCacheStorageConfig(**fields)


FACTORY_KEYS = {
    "backend_name": "lmcache_async",
    "module_path": "lmcache_async.integration.sglang",
    "class_name": "LMCacheHiCacheStorage",
    "interface_v1": 1,
}


def fill_random(pool: Any, seed: int) -> None:
    """Fill the pool's kv_buffer with seeded random bits (every bit pattern, NaNs included)."""
    buf = pool.kv_buffer
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(1 << 15), 1 << 15, buf.shape, generator=g, dtype=torch.int16)
    buf.view(torch.int16).copy_(bits)


def page_bytes(pool: Any, host_index: int) -> torch.Tensor:
    """One page of the pool as raw bytes (SGLang's own get_data_page), for bit-exact checks."""
    return pool.get_data_page(host_index, flat=True).contiguous().view(torch.uint8).clone()


@pytest.fixture
def cpu_config() -> dict[str, Any]:
    """Extra config of a small CPU-only backend (64 MiB pool)."""
    return {**FACTORY_KEYS, "max_local_cpu_size": 1 / 16, "staging_size": 1 / 64, "blocking_timeout_secs": 10}


@pytest.fixture
def make_backend() -> Iterator[Callable[..., Any]]:
    """Factory building backends through SGLang's own storage factory; closed at the end."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    made: list[Any] = []

    def make(extra: dict[str, Any], pool: Any = None, **overrides: Any) -> Any:
        backend = StorageBackendFactory.create_backend("dynamic", storage_config(extra, **overrides), pool)
        made.append(backend)
        if pool is not None:
            backend.register_mem_pool_host(pool)
        return backend

    yield make
    for b in made:
        b.close()
    gc.collect()


@pytest.fixture
def make_pool() -> Callable[..., Any]:
    from lmcache_async.integration.sglang.cpu_pool import build_cpu_host_pool

    return build_cpu_host_pool


@pytest.fixture
def sgl() -> Any:
    """The helpers above, for test modules (``conftest`` itself is not importable by name here)."""
    import types

    return types.SimpleNamespace(
        storage_config=storage_config,
        fill_random=fill_random,
        page_bytes=page_bytes,
        FACTORY_KEYS=FACTORY_KEYS,
    )
