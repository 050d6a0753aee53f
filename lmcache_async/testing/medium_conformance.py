"""The medium checks and the model test of the backend conformance suite.

:class:`MediumConformanceTests` is part of
:class:`~lmcache_async.testing.conformance.BackendConformanceTests`; on its own it runs just
these checks, for a backend whose full suite already runs elsewhere. The medium tests read
what is stored through the medium hooks (:class:`~lmcache_async.testing.hooks.MediumHooks`)
and are collected only in classes that implement them; the Hypothesis state machine
(:mod:`lmcache_async.testing.stateful`) always runs and also checks the medium when it can.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from lmcache_async.memory import MemoryFormat, PoolAllocator
from lmcache_async.testing.hooks import BackendHooks, MediumHooks, flush_backend
from lmcache_async.testing.objects import make_key, make_obj
from lmcache_async.tiers import BackendContext, StorageBackend

__all__ = ["MediumConformanceTests"]


class MediumConformanceTests(BackendHooks):
    """Medium checks and the state machine. Subclass and implement :meth:`make_backend` and,
    for the medium checks, :meth:`medium_keys`/:meth:`medium_bytes`."""

    #: Examples and steps of the Hypothesis state machine.
    state_machine_examples: int = 12
    state_machine_steps: int = 25

    #: The tests that read the medium directly: collected only in classes that implement
    #: :meth:`medium_keys` (a class without a way to read its medium has nothing to check).
    MEDIUM_TESTS = (
        "test_medium_holds_exact_payload_after_put",
        "test_medium_keeps_first_bytes_on_reput",
        "test_medium_loses_entry_on_remove_and_clear",
    )

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        reads_medium = cls.medium_keys is not MediumHooks.medium_keys
        for name in MediumConformanceTests.MEDIUM_TESTS:
            # None hides a test from collection; a subclass that adds the hooks gets it back.
            setattr(cls, name, getattr(MediumConformanceTests, name) if reads_medium else None)

    # ---- the medium, read directly (collected only where the medium hooks are implemented) ----
    def _medium(self, backend: StorageBackend, location: Path) -> set[str]:
        keys = self.medium_keys(backend, location)
        assert keys is not None, f"{type(self).__name__}.medium_keys answered None for its own medium"
        return keys

    async def test_medium_holds_exact_payload_after_put(
        self, backend: StorageBackend, src_pool: PoolAllocator, location: Path
    ) -> None:
        self._medium(backend, location)
        specs = [
            ((64, 128), torch.float32, MemoryFormat.KV_2LTD),
            ((7,), torch.uint8, MemoryFormat.BINARY),
            ((3, 2, 9), torch.bfloat16, MemoryFormat.HS_TD),
        ]
        entries = [
            (make_key(600 + i), make_obj(src_pool, shape, dtype, fmt, seed=60 + i))
            for i, (shape, dtype, fmt) in enumerate(specs)
        ]
        for k, o in entries:
            assert await backend.put(k, o)
        await flush_backend(backend)
        assert self._medium(backend, location) == {k.to_string() for k, _ in entries}
        for k, o in entries:
            assert self.medium_bytes(backend, location, k.to_string()) == bytes(o.byte_view()), k
            o.ref_count_down()

    async def test_medium_keeps_first_bytes_on_reput(
        self, backend: StorageBackend, src_pool: PoolAllocator, location: Path
    ) -> None:
        self._medium(backend, location)
        key = make_key(610)
        first, second = make_obj(src_pool, seed=1), make_obj(src_pool, seed=2)
        assert await backend.put(key, first)
        assert await backend.put(key, second)
        await flush_backend(backend)
        assert self.medium_bytes(backend, location, key.to_string()) == bytes(first.byte_view())
        first.ref_count_down()
        second.ref_count_down()

    async def test_medium_loses_entry_on_remove_and_clear(
        self, backend: StorageBackend, src_pool: PoolAllocator, location: Path
    ) -> None:
        self._medium(backend, location)
        if not backend.supports_delete:
            # A tier may declare supports_delete=False (the ABC allows it); none of ours does.
            # Then there is nothing to remove and this check has no subject: skip, saying why.
            pytest.skip(f"{backend.name} does not support delete")
        keys = [make_key(620 + i) for i in range(4)]
        for i, k in enumerate(keys):
            o = make_obj(src_pool, (8, 8), seed=i)
            assert await backend.put(k, o)
            o.ref_count_down()
        assert await backend.remove(keys[0])
        await flush_backend(backend)
        assert self._medium(backend, location) == {k.to_string() for k in keys[1:]}
        assert self.medium_bytes(backend, location, keys[0].to_string()) is None
        await backend.clear()
        await flush_backend(backend)
        assert self._medium(backend, location) == set()

    # ---- the model ------------------------------------------------------------------------------
    async def test_state_machine_matches_dict_model(
        self,
        backend_context: Callable[[], BackendContext],
        src_pool: PoolAllocator,
        tmp_path: Path,
        backend: StorageBackend,
        location: Path,
    ) -> None:
        # Hypothesis is imported here, not at import time: the kit is a pytest plugin loaded by
        # every pytest run of an environment that has this package, with or without Hypothesis.
        pytest.importorskip("hypothesis", reason="the state machine needs Hypothesis (the test extra)")
        from lmcache_async.testing.stateful import run_backend_state_machine

        root = tmp_path / "stateful"
        root.mkdir()
        await asyncio.to_thread(
            run_backend_state_machine,
            self,
            backend_context,
            root,
            src_pool,
            max_examples=self.state_machine_examples,
            steps=self.state_machine_steps,
            reuse=(backend, location) if backend.supports_delete else None,
        )
