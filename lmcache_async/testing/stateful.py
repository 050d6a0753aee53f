"""A Hypothesis state machine over one backend, checked against a dict model.

Rules: put (a present key is a no-op: the first bytes stay), get, contains (and
``contains_nowait`` where the backend answers it), remove, clear, batched get and contains.
After every step, when the test class implements the medium hooks of
:class:`~lmcache_async.testing.hooks.BackendHooks`, the medium itself must hold exactly the
model's keys with the model's bytes.

The machine runs on a worker thread and drives the backend's coroutines on the test's event
loop (``run_coroutine_threadsafe``), so the backend sees the loop it was built for and its
``contains_nowait`` is exercised from a thread that is not the loop's, as in production.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import tempfile
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from lmcache_async.memory import MemoryFormat, MemoryObj, PoolAllocator
from lmcache_async.testing.hooks import BackendHooks, flush_backend, start_backend
from lmcache_async.testing.objects import make_key, make_obj
from lmcache_async.tiers import UNKNOWN, BackendContext, StorageBackend

__all__ = ["SHAPES", "BackendStateMachine", "run_backend_state_machine"]

T = TypeVar("T")

#: (shape, dtype, fmt) of the values the machine writes: small, a rank-4 bf16, a 256 KiB one.
SHAPES: tuple[tuple[tuple[int, ...], torch.dtype, MemoryFormat], ...] = (
    ((8,), torch.float32, MemoryFormat.UNDEFINED),
    ((2, 3, 5, 4), torch.bfloat16, MemoryFormat.KV_2LTD),
    ((256, 256), torch.float32, MemoryFormat.HS_TD),
)
_NUM_KEYS = 8
_STEP_TIMEOUT_S = 60.0


@dataclass
class _Env:
    hooks: BackendHooks
    ctx: BackendContext
    loop: asyncio.AbstractEventLoop
    root: Path
    src_pool: PoolAllocator
    reuse: tuple[StorageBackend, Path] | None = None


class BackendStateMachine(RuleBasedStateMachine):
    """The model test. Bound to a backend by :func:`run_backend_state_machine`."""

    env: ClassVar[_Env]

    def __init__(self) -> None:
        super().__init__()
        env = type(self).env
        self.owned = env.reuse is None
        if env.reuse is None:
            self.location = Path(tempfile.mkdtemp(dir=env.root))
            self.backend = self._run(self._open(env.ctx, self.location))
        else:
            self.backend, self.location = env.reuse
            self._run(self.backend.clear())  # the model starts empty
        self.keys = [make_key(5000 + i, model="stateful/model") for i in range(_NUM_KEYS)]
        self.model: dict[int, tuple[int, int]] = {}  # key index -> (seed, shape index)
        self.medium_readable = env.hooks.medium_keys(self.backend, self.location) is not None

    async def _open(self, ctx: BackendContext, location: Path) -> StorageBackend:
        backend = await start_backend(await type(self).env.hooks.make_backend(ctx, location))
        # The model starts empty: a shared medium (a server namespace that outlives one example)
        # keeps the previous example's entries unless they are cleared first.
        if backend.supports_delete:
            await backend.clear()
        return backend

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        fut = asyncio.run_coroutine_threadsafe(coro, type(self).env.loop)
        try:
            return fut.result(_STEP_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise AssertionError(f"a backend call did not finish in {_STEP_TIMEOUT_S}s") from None

    def _expected(self, k: int) -> bytes:
        seed, s = self.model[k]
        shape, dtype, fmt = SHAPES[s]
        obj = make_obj(type(self).env.src_pool, shape, dtype, fmt, seed=seed)
        try:
            return bytes(obj.byte_view())
        finally:
            obj.ref_count_down()

    def _check_obj(self, k: int, got: MemoryObj | None) -> None:
        try:
            if k not in self.model:
                assert got is None, f"key {k} was never stored (or was removed) but get found it"
                return
            assert got is not None, f"key {k} is stored but get missed"
            shape, dtype, fmt = SHAPES[self.model[k][1]]
            assert tuple(got.shape) == shape and got.dtype == dtype and got.fmt == fmt, (k, got)
            assert bytes(got.byte_view()) == self._expected(k), f"key {k}: wrong bytes"
        finally:
            if got is not None:
                got.ref_count_down()

    # ---- rules -------------------------------------------------------------------------------
    @rule(k=st.integers(0, _NUM_KEYS - 1), seed=st.integers(0, 2**16), s=st.integers(0, len(SHAPES) - 1))
    def put(self, k: int, seed: int, s: int) -> None:
        shape, dtype, fmt = SHAPES[s]
        obj = make_obj(type(self).env.src_pool, shape, dtype, fmt, seed=seed)
        try:
            assert self._run(self.backend.put(self.keys[k], obj)) is True
        finally:
            obj.ref_count_down()
        self.model.setdefault(k, (seed, s))  # a put of a present key keeps the first bytes

    @rule(k=st.integers(0, _NUM_KEYS - 1))
    def get(self, k: int) -> None:
        self._check_obj(k, self._run(self.backend.get(self.keys[k])))

    @rule(k=st.integers(0, _NUM_KEYS - 1))
    def contains(self, k: int) -> None:
        assert self._run(self.backend.contains(self.keys[k])) is (k in self.model)
        nowait = self.backend.contains_nowait(self.keys[k])
        assert nowait is UNKNOWN or nowait is (k in self.model), (k, nowait)  # a bool or UNKNOWN, never None

    @rule(k=st.integers(0, _NUM_KEYS - 1))
    def remove(self, k: int) -> None:
        if not self.backend.supports_delete:
            return
        assert self._run(self.backend.remove(self.keys[k])) is (k in self.model)
        self.model.pop(k, None)

    @rule()
    def clear(self) -> None:
        if not self.backend.supports_delete:
            return
        self._run(self.backend.clear())
        self.model.clear()

    @rule(ks=st.lists(st.integers(0, _NUM_KEYS - 1), max_size=6))
    def batched(self, ks: list[int]) -> None:
        keys = [self.keys[k] for k in ks]
        assert self._run(self.backend.batched_contains(keys)) == [k in self.model for k in ks]
        got = self._run(self.backend.batched_get(keys))
        assert len(got) == len(ks)
        for k, g in zip(ks, got, strict=True):
            self._check_obj(k, g)

    # ---- the medium --------------------------------------------------------------------------
    @invariant()
    def medium_matches_model(self) -> None:
        hooks = type(self).env.hooks
        if not self.medium_readable:
            return
        self._run(flush_backend(self.backend))
        on_medium = hooks.medium_items(self.backend, self.location)
        assert on_medium is not None
        assert set(on_medium) == {self.keys[k].to_string() for k in self.model}
        for k in self.model:
            assert on_medium[self.keys[k].to_string()] == self._expected(k), f"key {k}: the medium holds other bytes"

    def teardown(self) -> None:
        if self.owned:
            self._run(self.backend.close())


def run_backend_state_machine(
    hooks: BackendHooks,
    ctx_factory: Callable[[], BackendContext],
    root: Path,
    src_pool: PoolAllocator,
    *,
    max_examples: int = 12,
    steps: int = 25,
    reuse: tuple[StorageBackend, Path] | None = None,
) -> None:
    """Run :class:`BackendStateMachine` over ``hooks.make_backend`` on the calling thread.

    Call it off the event loop that ``ctx_factory``'s contexts are bound to (for example with
    ``await asyncio.to_thread(...)``): each step waits on that loop. Every example gets a fresh
    backend on a fresh directory under ``root``, unless ``reuse`` names a started backend that
    supports delete and its location: then every example runs on it, cleared first (cheaper for
    tiers whose open and close are costly, such as a store client). A failure raises with
    Hypothesis' shrunk steps.
    """
    if reuse is not None and not reuse[0].supports_delete:
        raise ValueError("reuse needs a backend that supports delete (each example starts empty)")
    ctx = ctx_factory()
    env = _Env(hooks=hooks, ctx=ctx, loop=ctx.loop, root=root, src_pool=src_pool, reuse=reuse)
    bound = type("BoundBackendStateMachine", (BackendStateMachine,), {"env": env})
    run_state_machine_as_test(
        bound,
        settings=settings(
            max_examples=max_examples,
            stateful_step_count=steps,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
