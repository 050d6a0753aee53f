"""Fixtures of the NIXL tier's tests.

Tests marked ``nixl`` need the NIXL wheel (``pip install 'lmcache-async[nixl]'``). Without it
they are skipped with the reason, unless ``LMCACHE_ASYNC_REQUIRE_NIXL=1`` is set (CI), in which
case they fail. The variable is read at import: the shared ``_isolated_env`` fixture hides
``LMCACHE_*`` variables from tests.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from collections.abc import AsyncIterator, Callable, Sequence

import pytest
import torch

from lmcache_async.config import LMCacheEngineConfig
from lmcache_async.errors import BackendUnavailableError
from lmcache_async.memory import HeapAllocator, MemoryFormat, MemoryObj, PoolAllocator
from lmcache_async.metadata import LMCacheEngineMetadata
from lmcache_async.nixl.agent import load_nixl
from lmcache_async.tiers import BackendContext

REQUIRE_NIXL = os.environ.get("LMCACHE_ASYNC_REQUIRE_NIXL") == "1"


def _nixl_problem() -> str | None:
    try:
        load_nixl()
    except BackendUnavailableError as exc:
        return str(exc)
    return None


@pytest.fixture(autouse=True)
def _needs_nixl(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("nixl") is None:
        return
    problem = _nixl_problem()
    if problem is None:
        return
    if REQUIRE_NIXL:
        pytest.fail(f"LMCACHE_ASYNC_REQUIRE_NIXL=1 but NIXL is not importable: {problem}")
    pytest.skip(f"NIXL is not importable: {problem}")


@pytest.fixture
async def big_context() -> AsyncIterator[Callable[..., BackendContext]]:
    """A context factory like the conformance one, with a larger registered pool and staging."""
    loop = asyncio.get_running_loop()
    executor = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="lmcache-async-test-io")
    made: list[PoolAllocator] = []

    def make(config: LMCacheEngineConfig | None = None, pool_mib: int = 320, staging_mib: int = 64) -> BackendContext:
        pool = PoolAllocator(pool_mib << 20, name="nixl-test-pool", pretouch=False)
        staging = PoolAllocator(staging_mib << 20, name="nixl-test-staging", pretouch=False)
        heap = HeapAllocator("nixl-test-heap")
        made.extend([pool, staging])

        def alloc(shape: Sequence[int], dtype: torch.dtype, fmt: MemoryFormat) -> MemoryObj | None:
            return staging.allocate(shape, dtype, fmt) or heap.allocate(shape, dtype, fmt)

        return BackendContext(
            config=config or LMCacheEngineConfig(),
            metadata=LMCacheEngineMetadata("nixl-test"),
            cache_name="test",
            loop=loop,
            executor=executor,
            staging=alloc,
            staging_pool=staging,
            pool=pool,
        )

    yield make
    executor.shutdown(wait=True)


def _fill(obj: MemoryObj | None, seed: int) -> MemoryObj:
    assert obj is not None, "test pool exhausted"
    g = torch.Generator().manual_seed(seed)
    raw = obj.tensor.reshape(-1).view(torch.uint8)
    n = raw.numel()
    block = torch.randint(0, 256, (min(n, 1 << 20),), generator=g, dtype=torch.uint8)
    whole, rest = divmod(n, block.numel()) if n else (0, 0)
    if whole:  # big objects repeat one random MiB (filling 256 MiB at random is slow)
        raw[: whole * block.numel()].view(whole, -1).copy_(block)
    if rest:
        raw[whole * block.numel() :].copy_(block[:rest])
    return obj


def _same_bytes(a: MemoryObj, b: MemoryObj) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and a.fmt == b.fmt
        and torch.equal(a.tensor.reshape(-1).view(torch.uint8), b.tensor.reshape(-1).view(torch.uint8))
    )


@pytest.fixture
def fill() -> Callable[[MemoryObj | None, int], MemoryObj]:
    """``fill(obj, seed)``: deterministic bytes in ``obj`` (which must not be None)."""
    return _fill


@pytest.fixture
def same_bytes() -> Callable[[MemoryObj, MemoryObj], bool]:
    """``same_bytes(a, b)``: equal shape, dtype, format and bytes."""
    return _same_bytes
