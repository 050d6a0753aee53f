"""The manager-level conformance suite: a tier under test below the CPU tier of a real
:class:`~lmcache_async.storage_manager.StorageManager`.

Subclass :class:`ManagerConformanceTests` and implement :meth:`~ManagerConformanceTests.make_tier`
(a registry factory: synchronous, given the manager's :class:`~lmcache_async.tiers.BackendContext`)::

    from lmcache_async.testing.manager_conformance import ManagerConformanceTests

    class TestMyTierUnderAManager(ManagerConformanceTests):
        def make_tier(self, ctx, location):
            return MyBackend(ctx, root=location)

The suite registers the tier with :func:`~lmcache_async.tiers.register_backend` (wrapped in a
:class:`~lmcache_async.testing.faults.FaultyTier` under a per-class name, so it can also make
the tier fail or hang) and checks, through the manager's public API only: write-through after
``flush``, promotion of a lower-tier hit into the CPU tier, ``read_into_sync`` filling
caller memory from either tier, ``contains_sync``/``contains``/the
tier's ``contains_nowait`` agreeing, ``stats()`` from another thread while puts run, ``remove``
and ``clear`` reaching every tier, and a failing or hanging tier costing a miss, never an
exception. The medium hooks of :class:`~lmcache_async.testing.hooks.MediumHooks` (or
:class:`~lmcache_async.testing.media.RecordDirectoryMedium`) add checks of what is really stored.
"""

from __future__ import annotations

import abc
import asyncio
import threading
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from lmcache_async.config import LMCacheEngineConfig
from lmcache_async.errors import LoopThreadCallError
from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import HeapAllocator, MemoryFormat, MemoryObj
from lmcache_async.metadata import LMCacheEngineMetadata
from lmcache_async.read_sinks import ReadSink
from lmcache_async.storage_manager import StorageManager
from lmcache_async.testing.faults import FaultMode, FaultyTier
from lmcache_async.testing.hooks import MediumHooks, flush_backend
from lmcache_async.testing.objects import make_key
from lmcache_async.tiers import UNKNOWN, BackendContext, StorageBackend, register_backend

__all__ = ["ManagerConformanceTests", "tensor_for"]

T = TypeVar("T")

_CALL_TIMEOUT_S = 60.0


def tensor_for(seed: int, n: int = 4096) -> torch.Tensor:
    """A float32 tensor of ``n`` values, distinct per ``seed``."""
    return torch.arange(n, dtype=torch.float32) + float(seed) * 0.5


class ManagerConformanceTests(MediumHooks, abc.ABC):
    """Generic tests of a tier below the CPU tier. Subclass and implement :meth:`make_tier`."""

    #: GiB of the manager's CPU pool and staging area (small: tests stay light).
    cpu_gib: float = 1 / 64
    staging_gib: float = 1 / 64
    #: ``blocking_timeout_secs`` of the manager; a local lower tier is bounded by half of it.
    blocking_timeout_s: float = 20.0
    #: Bounds used by the hang test (a remote tier gets ``remote_timeout_s``, a local one half
    #: of ``blocking_timeout_secs``).
    hang_blocking_timeout_s: float = 4.0
    hang_remote_timeout_s: float = 1.0
    #: The tier's ``stats()["entries"]`` counts its entries (False for a shared medium that
    #: would have to be listed to count them; the guard then reports 0).
    stats_counts_entries: bool = True

    # ---- hooks ---------------------------------------------------------------------------------
    @abc.abstractmethod
    def make_tier(self, ctx: BackendContext, location: Path) -> StorageBackend:
        """Build the tier under test for the manager's context; ``location`` is a fresh directory
        per test. Runs on the manager's construction path (not on its loop thread)."""

    def manager_config(self, tier_name: str, **overrides: Any) -> LMCacheEngineConfig:
        """The manager's configuration: CPU tier, then ``tier_name``. Override to add keys."""
        base: dict[str, Any] = {
            "max_local_cpu_size": self.cpu_gib,
            "staging_size": self.staging_gib,
            "blocking_timeout_secs": self.blocking_timeout_s,
            "tier_order": ["cpu", tier_name],
        }
        base.update(overrides)
        return LMCacheEngineConfig.from_defaults(**base)

    # ---- fixtures ------------------------------------------------------------------------------
    @pytest.fixture
    def location(self, tmp_path: Path) -> Path:
        d = tmp_path / "tier"
        d.mkdir()
        return d

    @property
    def tier_name(self) -> str:
        """The registry name the tier is registered under (one per test class)."""
        return f"conformance-{type(self).__name__.lower()}"

    def _build(self, location: Path, **overrides: Any) -> tuple[StorageManager, FaultyTier, asyncio.AbstractEventLoop]:
        built: list[tuple[FaultyTier, asyncio.AbstractEventLoop]] = []
        name = self.tier_name

        def factory(ctx: BackendContext) -> StorageBackend:
            tier = FaultyTier(self.make_tier(ctx, location), name)
            built.append((tier, ctx.loop))
            return tier

        register_backend(name, factory, replace=True)
        sm = StorageManager(
            self.manager_config(name, **overrides), LMCacheEngineMetadata("manager-conformance"), name="conformance"
        )
        assert len(built) == 1, f"the manager built {len(built)} instances of tier {name!r}"
        assert name in sm.tier_names, (name, sm.tier_names)
        return sm, built[0][0], built[0][1]

    @pytest.fixture
    def stack(self, location: Path) -> Iterator[tuple[StorageManager, FaultyTier, asyncio.AbstractEventLoop]]:
        """(manager, the tier as the manager holds it, the manager's loop); closed afterwards."""
        sm, tier, loop = self._build(location)
        yield sm, tier, loop
        tier.mode = "ok"
        if not sm.closed:
            sm.close_sync()

    # ---- helpers -------------------------------------------------------------------------------
    @staticmethod
    def on_loop(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T]) -> T:
        """Run a tier coroutine on the manager's loop thread (where tiers run) and wait."""
        return asyncio.run_coroutine_threadsafe(coro, loop).result(_CALL_TIMEOUT_S)

    def put_below(self, loop: asyncio.AbstractEventLoop, tier: StorageBackend, key: CacheEngineKey, seed: int) -> None:
        """Store an entry in the tier only (the CPU tier does not see it)."""
        src = HeapAllocator("manager-conformance").allocate((4096,), torch.float32, MemoryFormat.UNDEFINED)
        assert src is not None
        src.tensor.copy_(tensor_for(seed))
        try:
            assert self.on_loop(loop, tier.put(key, src)) is True
            self.on_loop(loop, flush_backend(tier))
        finally:
            src.ref_count_down()

    @staticmethod
    def assert_holds(obj: MemoryObj | None, seed: int) -> None:
        """``obj`` is the entry written for ``seed``; releases the caller's reference."""
        assert obj is not None, f"entry {seed} missing"
        try:
            assert torch.equal(obj.tensor.reshape(-1), tensor_for(seed)), f"entry {seed}: wrong bytes"
        finally:
            obj.ref_count_down()

    def check_medium(self, tier: FaultyTier, location: Path, expected: dict[CacheEngineKey, int]) -> None:
        """With medium hooks: the medium holds exactly ``expected`` (key -> seed), byte for byte."""
        items = self.medium_items(tier.inner, location)
        if items is None:
            return
        assert set(items) == {k.to_string() for k in expected}
        for k, seed in expected.items():
            assert items[k.to_string()] == tensor_for(seed).numpy().tobytes(), f"the medium holds other bytes for {k}"

    # ---- write-through and promotion ---------------------------------------------------------
    def test_put_reaches_the_tier_after_flush(self, stack: Any, location: Path) -> None:
        sm, tier, loop = stack
        keys = {make_key(700 + i): i for i in range(6)}
        for k, seed in keys.items():
            assert sm.put_sync(k, tensor_for(seed)) is True
        sm.flush_sync()
        self.on_loop(loop, flush_backend(tier))
        for k, seed in keys.items():
            assert self.on_loop(loop, tier.contains(k)) is True, k
            self.assert_holds(self.on_loop(loop, tier.get(k)), seed)
        self.check_medium(tier, location, keys)

    def test_lower_tier_hit_is_promoted_to_cpu(self, stack: Any) -> None:
        sm, tier, loop = stack
        key = make_key(710)
        self.put_below(loop, tier, key, seed=71)
        self.assert_holds(sm.get_sync(key), 71)
        if not tier.supports_delete:
            # A tier may declare supports_delete=False (the ABC allows it); none of ours does.
            # Then there is nothing to remove and this check has no subject: skip, saying why.
            pytest.skip(f"{tier.inner.name} cannot delete: promotion is not observable without it")
        assert self.on_loop(loop, tier.remove(key)) is True
        # Gone below, so this hit can only come from the CPU tier the first get promoted it into.
        self.assert_holds(sm.get_sync(key), 71)
        assert sm.stats()["tiers"][self.tier_name]["hits"] >= 1

    async def test_async_get_promotes_too(self, stack: Any) -> None:
        sm, tier, loop = stack
        key = make_key(711)
        await asyncio.to_thread(self.put_below, loop, tier, key, 72)
        self.assert_holds(await sm.get(key), 72)
        if tier.supports_delete:
            assert await asyncio.to_thread(self.on_loop, loop, tier.remove(key))
            self.assert_holds(await sm.get(key), 72)

    # ---- presence ------------------------------------------------------------------------------
    async def test_contains_answers_agree(self, stack: Any) -> None:
        sm, tier, loop = stack
        both, below, absent = make_key(720), make_key(721), make_key(722)
        assert await asyncio.to_thread(sm.put_sync, both, tensor_for(1))
        await asyncio.to_thread(sm.flush_sync)
        await asyncio.to_thread(self.put_below, loop, tier, below, 2)
        for key, expected in ((both, True), (below, True), (absent, False)):
            assert await asyncio.to_thread(sm.contains_sync, key) is expected, key
            assert await sm.contains(key) is expected, key  # awaited from a foreign loop
            assert await asyncio.to_thread(self.on_loop, loop, tier.contains(key)) is expected, key
            nowait = await asyncio.to_thread(tier.contains_nowait, key)  # a caller thread
            assert nowait is UNKNOWN or nowait is expected, (key, nowait)
        assert await asyncio.to_thread(sm.prefix_len_sync, [both, below, absent]) == 2
        assert await sm.prefix_len([below, both]) == 2

    # ---- stats ---------------------------------------------------------------------------------
    def test_stats_from_another_thread_while_puts_run(self, stack: Any) -> None:
        sm, _tier, _loop = stack
        stop = threading.Event()
        errors: list[BaseException] = []
        seen: list[dict[str, Any]] = []

        def reader() -> None:
            while not stop.is_set():
                try:
                    seen.append(sm.stats())
                except BaseException as exc:  # recorded, re-raised on the test's thread
                    errors.append(exc)
                    return

        t = threading.Thread(target=reader, name="lmcache-async-test-stats", daemon=True)
        t.start()
        try:
            for i in range(120):
                assert sm.put_sync(make_key(800 + i), tensor_for(i, 1024))
            sm.flush_sync()
        finally:
            stop.set()
            t.join(_CALL_TIMEOUT_S)
        assert not t.is_alive(), "stats() did not return"
        assert not errors, errors[0]
        assert seen, "stats() was never answered"
        final = sm.stats()["tiers"][self.tier_name]
        for field in ("entries", "bytes", "hits", "misses", "errors"):
            assert isinstance(final[field], int | float), field
        assert final["errors"] == 0
        if self.stats_counts_entries:
            held = sum(self.on_loop(_loop, _tier.batched_contains([make_key(800 + i) for i in range(120)])))
            assert final["entries"] == held, (final["entries"], held)

    # ---- remove / clear ------------------------------------------------------------------------
    def test_remove_reaches_every_tier(self, stack: Any, location: Path) -> None:
        sm, tier, loop = stack
        if not tier.supports_delete:
            # A tier may declare supports_delete=False (the ABC allows it); none of ours does.
            # Then there is nothing to remove and this check has no subject: skip, saying why.
            pytest.skip(f"{tier.inner.name} does not support delete")
        gone, kept = make_key(730), make_key(731)
        assert sm.put_sync(gone, tensor_for(3)) and sm.put_sync(kept, tensor_for(4))
        sm.flush_sync()
        assert sm.remove_sync(gone) is True
        assert sm.contains_sync(gone) is False
        assert sm.get_sync(gone) is None
        assert self.on_loop(loop, tier.contains(gone)) is False
        assert sm.remove_sync(gone) is False
        self.on_loop(loop, flush_backend(tier))
        self.check_medium(tier, location, {kept: 4})

    def test_remove_of_an_entry_only_below(self, stack: Any) -> None:
        sm, tier, loop = stack
        if not tier.supports_delete:
            # A tier may declare supports_delete=False (the ABC allows it); none of ours does.
            # Then there is nothing to remove and this check has no subject: skip, saying why.
            pytest.skip(f"{tier.inner.name} does not support delete")
        key = make_key(732)
        self.put_below(loop, tier, key, 5)
        assert sm.remove_sync(key) is True
        assert self.on_loop(loop, tier.contains(key)) is False

    def test_clear_reaches_every_tier(self, stack: Any, location: Path) -> None:
        sm, tier, loop = stack
        if not tier.supports_delete:
            # A tier may declare supports_delete=False (the ABC allows it); none of ours does.
            # Then there is nothing to remove and this check has no subject: skip, saying why.
            pytest.skip(f"{tier.inner.name} does not support delete")
        keys = [make_key(740 + i) for i in range(5)]
        for i, k in enumerate(keys):
            assert sm.put_sync(k, tensor_for(i))
        sm.flush_sync()
        self.put_below(loop, tier, make_key(749), 9)
        sm.clear_sync()
        for k in [*keys, make_key(749)]:
            assert sm.contains_sync(k) is False, k
            assert self.on_loop(loop, tier.contains(k)) is False, k
        self.on_loop(loop, flush_backend(tier))
        self.check_medium(tier, location, {})

    # ---- reads into caller memory ---------------------------------------------------------------
    @staticmethod
    def sink_over(dst: torch.Tensor, cut: int = 1000) -> ReadSink:
        """A sink over the float32 tensor ``dst``, as two pieces (``cut`` values, then the rest)."""
        base, n = dst.data_ptr(), dst.numel() * 4
        return ReadSink(tuple(dst.shape), torch.float32, ((base, cut * 4), (base + cut * 4, n - cut * 4)))

    def test_read_into_fills_caller_memory_from_every_tier(self, stack: Any) -> None:
        sm, tier, loop = stack
        front, below, absent = make_key(720), make_key(721), make_key(722)
        assert sm.put_sync(front, tensor_for(20)) is True
        self.put_below(loop, tier, below, seed=21)
        dsts = [torch.zeros(4096) for _ in range(3)]
        flags = sm.read_into_sync([front, below, absent], [self.sink_over(d) for d in dsts])
        assert flags == [True, True, False]
        assert torch.equal(dsts[0], tensor_for(20)) and torch.equal(dsts[1], tensor_for(21))
        stats = sm.stats()
        assert stats["read_into"]["hits"] == 2 and stats["read_into"]["misses"] == 1
        if tier.as_direct_reader() is not None:  # read on this thread, straight from the medium
            assert stats["tiers"][self.tier_name]["direct_hits"] == 1
        # prefix: stops at the first miss; nothing after it is read
        later = torch.zeros(4096)
        assert sm.read_into_sync(
            [absent, below], [self.sink_over(torch.zeros(4096)), self.sink_over(later)], prefix=True
        ) == [False, False]
        assert not later.any()

    def test_read_into_of_another_shape_is_a_miss_and_keeps_the_entry(self, stack: Any) -> None:
        sm, tier, loop = stack
        key = make_key(723)
        self.put_below(loop, tier, key, seed=23)
        wrong = torch.zeros(2, 2048)
        sink = ReadSink((2, 2048), torch.float32, ((wrong.data_ptr(), wrong.numel() * 4),))
        assert sm.read_into_sync([key], [sink]) == [False]
        assert sm.stats()["read_into"]["mismatches"] + sm.stats()["tiers"][self.tier_name].get("read_mismatch", 0) >= 1
        assert self.on_loop(loop, tier.contains(key)) is True
        dst = torch.zeros(4096)
        assert sm.read_into_sync([key], [self.sink_over(dst)]) == [True]
        assert torch.equal(dst, tensor_for(23))

    def test_read_into_refuses_caller_mistakes(self, stack: Any) -> None:
        sm, _tier, loop = stack
        sink = self.sink_over(torch.zeros(4096))
        with pytest.raises(ValueError, match="sinks"):
            sm.read_into_sync([make_key(724)], [])
        with pytest.raises(TypeError, match=r"keys\[0\]"):
            sm.read_into_sync(["k"], [sink])
        with pytest.raises(TypeError, match=r"sinks\[0\]"):
            sm.read_into_sync([make_key(724)], [torch.zeros(4)])

        async def on_the_loop() -> None:
            sm.read_into_sync([make_key(724)], [sink])

        with pytest.raises(LoopThreadCallError):
            self.on_loop(loop, on_the_loop())

    # ---- a tier in trouble ---------------------------------------------------------------------
    def _trouble(self, sm: StorageManager, tier: FaultyTier, loop: asyncio.AbstractEventLoop, mode: FaultMode) -> None:
        below = make_key(750)
        self.put_below(loop, tier, below, 6)
        front = make_key(751)
        assert sm.put_sync(front, tensor_for(7))
        tier.mode = mode
        # Reads of an entry only the tier holds are misses; nothing raises into the caller.
        assert sm.get_sync(below) is None
        assert sm.contains_sync(below) is False
        assert sm.batched_get_sync([front, below])[1] is None
        assert sm.prefix_len_sync([front, below]) == 1
        dst = torch.zeros(4096)
        assert sm.read_into_sync([front, below], [self.sink_over(dst), self.sink_over(torch.zeros(4096))]) == [
            True,
            False,
        ]
        assert torch.equal(dst, tensor_for(7))
        # The CPU tier still serves and takes puts; write-through failures are counted.
        self.assert_holds(sm.get_sync(front), 7)
        assert sm.put_sync(make_key(752), tensor_for(8)) is True
        sm.flush_sync()
        sm.remove_sync(make_key(752))
        assert sm.stats()["tiers"][self.tier_name]["errors"] >= 1
        # Nothing was deleted on the tier's account while it could not answer.
        tier.mode = "ok"
        assert self.on_loop(loop, tier.contains(below)) is True

    def test_failing_tier_costs_a_miss_not_an_exception(self, stack: Any) -> None:
        sm, tier, loop = stack
        self._trouble(sm, tier, loop, "fail")

    def test_hanging_tier_costs_a_miss_not_an_exception(self, location: Path) -> None:
        sm, tier, loop = self._build(
            location,
            blocking_timeout_secs=self.hang_blocking_timeout_s,
            remote_timeout_s=self.hang_remote_timeout_s,
            remote_breaker_max_backoff_s=0.5,
        )
        try:
            self._trouble(sm, tier, loop, "hang")
        finally:
            tier.mode = "ok"
            sm.close_sync()
