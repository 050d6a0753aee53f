"""The in-memory reference backend passes the backend conformance suite, with the medium (its
dict) read directly."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmcache_async.testing import BackendConformanceTests, InMemoryBackend, make_key, make_obj
from lmcache_async.tiers import BackendContext, StorageBackend


class TestInMemoryConformance(BackendConformanceTests):
    async def make_backend(self, ctx: BackendContext, location: Path) -> InMemoryBackend:
        return InMemoryBackend(ctx)

    async def make_bounded_backend(self, ctx: BackendContext, location: Path, capacity_bytes: int) -> InMemoryBackend:
        return InMemoryBackend(ctx, capacity_bytes=capacity_bytes)  # refuses, never evicts

    def medium_keys(self, backend: StorageBackend, location: Path) -> set[str] | None:
        assert isinstance(backend, InMemoryBackend)
        return set(backend.snapshot())

    def medium_bytes(self, backend: StorageBackend, location: Path, key: str) -> bytes | None:
        assert isinstance(backend, InMemoryBackend)
        record = backend.snapshot().get(key)
        return None if record is None else record.payload


class TestBoundedInMemoryConformance(TestInMemoryConformance):
    """With a budget large enough for every entry the suite writes (the 9 MiB one included)."""

    async def make_backend(self, ctx: BackendContext, location: Path) -> InMemoryBackend:
        return InMemoryBackend(ctx, capacity_bytes=64 << 20)


async def test_put_over_capacity_is_refused_and_counted(backend_context, tmp_path) -> None:
    from lmcache_async.memory import PoolAllocator

    be = InMemoryBackend(backend_context(), capacity_bytes=40_000)
    pool = PoolAllocator(1 << 20, name="src", pretouch=False)
    a, b = make_obj(pool, (64, 128), seed=1), make_obj(pool, (64, 128), seed=2)  # 32 KiB each
    assert await be.put(make_key(1), a) is True
    assert await be.put(make_key(2), b) is False
    assert await be.contains(make_key(2)) is False
    assert be.stats()["rejected"] == 1 and be.max_entry_bytes == 40_000
    a.ref_count_down()
    b.ref_count_down()
    await be.close()


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_capacity_must_be_positive_int(backend_context, bad) -> None:
    with pytest.raises(ValueError, match="capacity_bytes"):
        InMemoryBackend(backend_context(), capacity_bytes=bad)


async def test_wrong_argument_types_raise_type_error(backend_context) -> None:
    be = InMemoryBackend(backend_context())
    with pytest.raises(TypeError, match="key"):
        await be.contains("not-a-key")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="obj"):
        await be.put(make_key(1), b"bytes")  # type: ignore[arg-type]
    await be.close()
