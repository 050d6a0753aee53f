"""The backend conformance suite.

Every backend's tests subclass :class:`BackendConformanceTests` and implement
:meth:`~BackendConformanceTests.make_backend`; pytest then runs the whole contract of
:mod:`lmcache_async.tiers` against it. Third-party backends use it the same way (the
package registers a pytest plugin providing the ``backend_context`` fixture)::

    from lmcache_async.testing import BackendConformanceTests

    class TestMyBackend(BackendConformanceTests):
        async def make_backend(self, ctx, location):
            return MyBackend(ctx, root=location)

Backends whose entries survive a restart subclass :class:`PersistentBackendConformanceTests`
instead: it also reopens the backend on the same location and expects every entry back.

A tier with a byte budget also implements ``make_bounded_backend(ctx, location, capacity_bytes)``
(the tier built small): if it declares ``reports_removals``, the suite then checks that what it
evicts it reports, and holds no more (:mod:`lmcache_async.testing.eviction_conformance`).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from lmcache_async.memory import MemoryFormat, PoolAllocator
from lmcache_async.testing.declarations import declaration_problems
from lmcache_async.testing.eviction_conformance import EvictionConformanceTests
from lmcache_async.testing.hooks import flush_backend
from lmcache_async.testing.medium_conformance import MediumConformanceTests
from lmcache_async.testing.objects import make_key, make_obj, same_entry
from lmcache_async.tiers import RemovalReason, StorageBackend

__all__ = ["BackendConformanceTests", "PersistentBackendConformanceTests", "make_key", "make_obj"]


class BackendConformanceTests(MediumConformanceTests, EvictionConformanceTests):
    """Generic tests every backend must pass. Subclass and implement :meth:`make_backend`
    (and the medium hooks where the medium can be read directly). Includes the medium checks
    and the Hypothesis state machine of :class:`MediumConformanceTests`, and the eviction check
    of :class:`~lmcache_async.testing.eviction_conformance.EvictionConformanceTests` (a tier
    with a byte budget implements its ``make_bounded_backend`` hook)."""

    # ---- capabilities --------------------------------------------------------------------------
    async def test_capabilities_are_bools(self, backend: StorageBackend) -> None:
        for cap in ("persistent", "shared", "supports_delete", "is_remote", "reports_removals", "evicted_elsewhere"):
            assert isinstance(getattr(backend, cap), bool), cap
        assert isinstance(backend.name, str) and backend.name
        assert isinstance(backend.stats(), dict)

    async def test_declared_capabilities_are_implemented(self, backend: StorageBackend) -> None:
        problems = declaration_problems(backend)
        assert not problems, "\n".join(problems)

    async def test_a_removal_it_reports_names_the_key_and_the_reason(
        self, backend: StorageBackend, src_pool: PoolAllocator
    ) -> None:
        reports: list[tuple[str, list[Any], RemovalReason]] = []
        backend.bind_removals(lambda tier, keys, reason: reports.append((tier, list(keys), reason)))
        key = make_key(31)
        src = make_obj(src_pool, (16,), torch.float32, MemoryFormat.UNDEFINED, seed=3)
        try:
            assert await backend.put(key, src) is True
        finally:
            src.ref_count_down()
        await flush_backend(backend)
        if not backend.supports_delete:  # a declared property of the tier, not a runtime accident
            pytest.skip(f"tier {backend.name!r} declares supports_delete = False")
        assert await backend.remove(key), "a tier that supports delete must remove an entry it just took"
        if backend.reports_removals:
            assert (backend.name, [key], RemovalReason.DELETED) in reports, reports
        backend.bind_removals(None)

    # ---- single-key semantics --------------------------------------------------------------------
    @pytest.mark.parametrize(
        ("shape", "dtype", "fmt"),
        [
            ((64, 128), torch.float32, MemoryFormat.KV_2LTD),
            ((2, 3, 17, 8), torch.bfloat16, MemoryFormat.KV_2LTD),
            ((1000,), torch.uint8, MemoryFormat.BINARY),
            ((3, 5), torch.int64, MemoryFormat.EC_TD),
            ((), torch.float16, MemoryFormat.UNDEFINED),
            ((2, 1, 1, 1, 1, 3), torch.float64, MemoryFormat.HS_TD),
        ],
    )
    async def test_put_then_get_returns_exact_bytes(
        self,
        backend: StorageBackend,
        src_pool: PoolAllocator,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        fmt: MemoryFormat,
    ) -> None:
        key = make_key(1)
        src = make_obj(src_pool, shape, dtype, fmt, seed=7)
        assert await backend.put(key, src) is True
        got = await backend.get(key)
        assert got is not None
        try:
            assert same_entry(got, src)
        finally:
            got.ref_count_down()
            src.ref_count_down()

    async def test_get_missing_is_none(self, backend: StorageBackend) -> None:
        assert await backend.get(make_key(404)) is None

    async def test_contains_reflects_put(self, backend: StorageBackend, src_pool: PoolAllocator) -> None:
        key = make_key(2)
        assert await backend.contains(key) is False
        src = make_obj(src_pool)
        assert await backend.put(key, src)
        src.ref_count_down()
        assert await backend.contains(key) is True

    async def test_put_does_not_keep_caller_reference(self, backend: StorageBackend, src_pool: PoolAllocator) -> None:
        src = make_obj(src_pool)
        refs = src.get_ref_count()
        await backend.put(make_key(3), src)
        assert src.get_ref_count() in (refs, refs + 1)  # +1 only for a tier that indexes the block
        src.ref_count_down()

    async def test_reput_of_present_key_is_noop_true(self, backend: StorageBackend, src_pool: PoolAllocator) -> None:
        key = make_key(4)
        a = make_obj(src_pool, seed=1)
        b = make_obj(src_pool, seed=2)
        assert await backend.put(key, a)
        assert await backend.put(key, b) is True
        got = await backend.get(key)
        assert got is not None
        assert same_entry(got, a)
        for o in (got, a, b):
            o.ref_count_down()

    async def test_remove_present_then_absent(self, backend: StorageBackend, src_pool: PoolAllocator) -> None:
        if not backend.supports_delete:
            pytest.skip(f"{backend.name} does not support delete")
        key = make_key(5)
        src = make_obj(src_pool)
        await backend.put(key, src)
        src.ref_count_down()
        assert await backend.remove(key) is True
        assert await backend.contains(key) is False
        assert await backend.get(key) is None
        assert await backend.remove(key) is False

    async def test_remove_missing_is_false(self, backend: StorageBackend) -> None:
        assert await backend.remove(make_key(406)) is False

    async def test_reader_keeps_data_after_remove(self, backend: StorageBackend, src_pool: PoolAllocator) -> None:
        key = make_key(6)
        src = make_obj(src_pool, seed=3)
        await backend.put(key, src)
        got = await backend.get(key)
        assert got is not None
        await backend.remove(key)
        assert same_entry(got, src)
        got.ref_count_down()
        src.ref_count_down()

    async def test_keys_differing_in_one_field_are_distinct(
        self, backend: StorageBackend, src_pool: PoolAllocator
    ) -> None:
        base = make_key(7)
        variants = [
            base,
            make_key(7, worker_id=1, world_size=2),
            make_key(7, dtype=torch.float16),
            make_key(7, model="other-model"),
            make_key(7, request_configs={"lmcache.tag.user": "a"}),
            make_key(8),
        ]
        objs = [make_obj(src_pool, (16, 16), seed=i) for i in range(len(variants))]
        for k, o in zip(variants, objs, strict=True):
            assert await backend.put(k, o)
        for k, o in zip(variants, objs, strict=True):
            got = await backend.get(k)
            assert got is not None, k
            assert same_entry(got, o), k
            got.ref_count_down()
        for o in objs:
            o.ref_count_down()

    @pytest.mark.parametrize(
        "model",
        ["../../etc/passwd", "a/b/c", "weird%40@name", "x" * 2000, "nul\x00byte", "unicodé-模型", ".."],
    )
    async def test_odd_model_names_round_trip(
        self, backend: StorageBackend, src_pool: PoolAllocator, model: str
    ) -> None:
        key = make_key(9, model=model)
        src = make_obj(src_pool, (8, 8), seed=9)
        assert await backend.put(key, src)
        got = await backend.get(key)
        assert got is not None
        assert same_entry(got, src)
        got.ref_count_down()
        src.ref_count_down()

    async def test_large_entry_round_trips(self, backend: StorageBackend, src_pool: PoolAllocator) -> None:
        key = make_key(10)
        src = make_obj(src_pool, (2304, 1024), torch.float32, seed=10)  # 9 MiB
        assert await backend.put(key, src)
        got = await backend.get(key)
        assert got is not None
        assert same_entry(got, src)
        got.ref_count_down()
        src.ref_count_down()

    # ---- batched --------------------------------------------------------------------------------
    async def test_batched_put_get_contains_one_result_per_key(
        self, backend: StorageBackend, src_pool: PoolAllocator
    ) -> None:
        keys = [make_key(100 + i) for i in range(12)]
        objs = [make_obj(src_pool, (32, 32), seed=i) for i in range(12)]
        stored = keys[::2]
        res = await backend.batched_put(list(zip(stored, objs[::2], strict=True)))
        assert res == [True] * len(stored)
        flags = await backend.batched_contains(keys)
        assert flags == [i % 2 == 0 for i in range(12)]
        got = await backend.batched_get(keys)
        assert len(got) == len(keys)
        for i, g in enumerate(got):
            if i % 2:
                assert g is None
            else:
                assert g is not None and same_entry(g, objs[i])
                g.ref_count_down()
        for o in objs:
            o.ref_count_down()

    async def test_batched_empty(self, backend: StorageBackend) -> None:
        assert await backend.batched_put([]) == []
        assert await backend.batched_get([]) == []
        assert await backend.batched_contains([]) == []

    # ---- concurrency -----------------------------------------------------------------------------
    async def test_concurrent_puts_of_one_key_store_one_entry(
        self, backend: StorageBackend, src_pool: PoolAllocator
    ) -> None:
        key = make_key(11)
        src = make_obj(src_pool, (64, 64), seed=11)
        res = await asyncio.gather(*(backend.put(key, src) for _ in range(16)))
        assert all(res)
        got = await backend.get(key)
        assert got is not None and same_entry(got, src)
        got.ref_count_down()
        src.ref_count_down()

    async def test_concurrent_mixed_operations_stay_consistent(
        self, backend: StorageBackend, src_pool: PoolAllocator
    ) -> None:
        keys = [make_key(200 + i) for i in range(24)]
        objs = [make_obj(src_pool, (16, 64), seed=100 + i) for i in range(24)]

        async def worker(i: int) -> None:
            k, o = keys[i], objs[i]
            assert await backend.put(k, o)
            for _ in range(3):
                g = await backend.get(k)
                assert g is not None and same_entry(g, o)
                g.ref_count_down()
            assert await backend.contains(k)

        await asyncio.gather(*(worker(i) for i in range(len(keys))))
        for o in objs:
            o.ref_count_down()

    # ---- clear / lifecycle -------------------------------------------------------------------------
    async def test_clear_removes_everything(self, backend: StorageBackend, src_pool: PoolAllocator) -> None:
        if not backend.supports_delete:
            pytest.skip(f"{backend.name} does not support delete")
        keys = [make_key(300 + i) for i in range(5)]
        for i, k in enumerate(keys):
            o = make_obj(src_pool, (8, 8), seed=i)
            await backend.put(k, o)
            o.ref_count_down()
        await backend.clear()
        assert await backend.batched_contains(keys) == [False] * 5


class PersistentBackendConformanceTests(BackendConformanceTests):
    """The suite plus restart: entries survive closing and reopening the backend on the same
    location. Subclass this instead of :class:`BackendConformanceTests` for persistent tiers."""

    async def test_restart_keeps_entries(
        self, backend: StorageBackend, src_pool: PoolAllocator, backend_context: Any, location: Path
    ) -> None:
        keys = [make_key(400 + i) for i in range(6)]
        objs = [make_obj(src_pool, (8, 32), seed=i) for i in range(6)]
        assert all(await backend.batched_put(list(zip(keys, objs, strict=True))))
        await flush_backend(backend)
        reopened = await self.reopen(backend, backend_context(), location)
        try:
            for k, o in zip(keys, objs, strict=True):
                g = await reopened.get(k)
                assert g is not None and same_entry(g, o)
                g.ref_count_down()
        finally:
            await reopened.close()
            for o in objs:
                o.ref_count_down()
