"""The kv_hs suite's coroutine figures: each engine coroutine beside its own sync call.

* **kv astore / hs aretrieve, CPU tier**: ``await eng.astore(...)`` and
  ``await hs.aretrieve_hidden_states(...)`` timed inside a running loop, each beside the sync
  call (timed on the same thread while no loop runs), alternating call by call in the same run,
  below the off-loop threshold (the copy runs on the caller's thread) and above it (the copy
  runs on the engine copy executor). Target <= 1.2.
* **off-loop threshold**: the copy executor's round trip (``await run_off_loop(noop)``) beside
  a rotating 1 MiB ``copy_``; the note gives the copy size at which the hop costs 20% of the
  copy, the figure :data:`~lmcache_async.engines._offload.OFF_LOOP_COPY_BYTES` is set from.

Run through ``lmcache-async bench --suite kv_hs``.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from lmcache_async.engines import _offload
from lmcache_async.engines.kv import LMCacheEngine

from .common import BenchOptions, CopyBaseline, MiB, Result, median_of

__all__ = ["CHUNK", "SUITE", "hs_aretrieve", "kv_astore", "off_loop_threshold", "run"]

SUITE = "kv_hs"
CHUNK = 256
_TARGET = 1.2


class _Pair:
    """``await afn(i)`` (timed inside ``loop``) beside ``sfn(i)`` (timed on this thread, which
    runs no loop between the awaited calls), call by call: each repetition runs ``setup()``
    (untimed), then ``inner`` pairs, the order inside a pair alternating, so load that comes and
    goes hits both sides alike. Each side keeps its last result referenced while its next call
    runs ("results kept")."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        afn: Callable[[int], Awaitable[Any]],
        sfn: Callable[[int], Any],
        inner: int,
        setup: Callable[[], None] | None = None,
    ) -> None:
        self.loop, self.afn, self.sfn, self.inner, self.setup = loop, afn, sfn, inner, setup
        self.i = 0
        self.last_a: Any = None
        self.last_s: Any = None

    async def _timed(self, i: int) -> tuple[float, Any]:
        t0 = time.perf_counter()
        r = await self.afn(i)
        return time.perf_counter() - t0, r

    def _one_async(self, i: int) -> float:
        dt, self.last_a = self.loop.run_until_complete(self._timed(i))
        return dt

    def _one_sync(self, i: int) -> float:
        t0 = time.perf_counter()
        r = self.sfn(i)
        dt = time.perf_counter() - t0
        self.last_s = r
        return dt

    def rep(self) -> tuple[float, float]:
        """Seconds per call of each side over one repetition."""
        if self.setup is not None:
            self.setup()
        ta = ts = 0.0
        for j in range(self.inner):
            i = self.i
            self.i = i + 1
            if j % 2:
                ta += self._one_async(i)
                ts += self._one_sync(i)
            else:
                ts += self._one_sync(i)
                ta += self._one_async(i)
        return ta / self.inner, ts / self.inner


def _pair(pair: _Pair, reps: int, warmup: int) -> tuple[float, float]:
    """Medians over ``reps`` repetitions (after ``warmup``) of the awaited and the sync side."""
    try:
        for _ in range(warmup):
            pair.rep()
        samples = [pair.rep() for _ in range(reps)]
    finally:
        pair.last_a = pair.last_s = None
        gc.collect()
    return median_of([a for a, _s in samples]), median_of([s for _a, s in samples])


def _ratio(name: str, ta: float, tb: float, base: str) -> Result:
    return Result(SUITE, name, ta * 1e3, "ms", base, tb * 1e3, target=_TARGET)


def _prompt(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 150_000, (n,), generator=g)


def _where(nbytes: int) -> str:
    return "copy off the loop" if _offload.should_offload(nbytes) else "copy on the caller's thread"


def kv_astore(
    opts: BenchOptions, eng: LMCacheEngine, loop: asyncio.AbstractEventLoop, tokens: int, layers: int, hidden: int
) -> Result:
    """``await eng.astore`` vs ``eng.store`` of new prompts into an emptied CPU tier."""
    reps, warmup = max(opts.reps, 5), max(opts.warmup, 1)
    nbytes = 2 * layers * tokens * hidden * 2
    inner = max(1, min(64, (64 * MiB) // nbytes))
    kv = torch.randn(2, layers, tokens, hidden).to(torch.bfloat16)
    n = (reps + warmup) * inner
    seeds = iter(range(10_000, 10_000 + 4 * n))
    prompts_a = [_prompt(tokens, next(seeds)) for _ in range(n)]
    prompts_s = [_prompt(tokens, next(seeds)) for _ in range(n)]
    clear = eng.storage_manager.clear_sync
    counts: list[int] = []

    async def astore(i: int) -> None:
        counts.append(await eng.astore(prompts_a[i], kv))

    def store(i: int) -> None:
        counts.append(eng.store(prompts_s[i], kv))

    opts.say(f"kv astore vs store, {nbytes // MiB} MiB")
    ta, tb = _pair(_Pair(loop, astore, store, inner, clear), reps, warmup)
    assert counts and all(c == tokens // CHUNK for c in counts), f"stored {set(counts)} chunks"
    label = f"{tokens} tokens x [2,{layers},*,{hidden}] bf16 ({nbytes / MiB:g} MiB, {_where(nbytes)})"
    return _ratio(f"await kv.astore, CPU tier, {label}", ta, tb, "kv.store (sync) same run")


def hs_aretrieve(
    opts: BenchOptions, eng: LMCacheEngine, loop: asyncio.AbstractEventLoop, prompt: torch.Tensor, hidden: int
) -> Result:
    """``await hs.aretrieve_hidden_states`` vs the sync retrieve of a stored prompt (results kept)."""
    hs = eng.hidden_state_store
    assert hs is not None
    reps, warmup = max(opts.reps, 5), max(opts.warmup, 1)
    nbytes = len(prompt) * hidden * 4
    inner = max(1, min(64, (64 * MiB) // nbytes))

    async def aretrieve(_i: int) -> torch.Tensor | None:
        return await hs.aretrieve_hidden_states(prompt)

    opts.say(f"hs aretrieve vs retrieve, {nbytes // MiB} MiB")
    ta, tb = _pair(_Pair(loop, aretrieve, lambda i: hs.retrieve_hidden_states(prompt), inner), reps, warmup)
    got = loop.run_until_complete(aretrieve(0))
    assert got is not None and got.shape == (len(prompt), hidden)
    label = f"{len(prompt)}x{hidden} f32 ({nbytes / MiB:g} MiB, {_where(nbytes)})"
    return _ratio(f"await hs.aretrieve_hidden_states, CPU tier, {label}", ta, tb, "retrieve (sync) same run")


def off_loop_threshold(opts: BenchOptions, loop: asyncio.AbstractEventLoop) -> Result:
    """The copy executor's round trip beside a rotating 1 MiB copy; the note derives the copy
    size at which the hop is 20% of the copy."""
    reps = max(opts.reps, 5)
    inner = 200

    async def hops() -> float:
        t0 = time.perf_counter()
        for _ in range(inner):
            await _offload.run_off_loop(lambda: None)
        return (time.perf_counter() - t0) / inner

    opts.say("off-loop hop vs copy 1 MiB")
    loop.run_until_complete(hops())
    copy = CopyBaseline(MiB, span=256 * MiB)
    hop_s = [loop.run_until_complete(hops()) for _ in range(reps)]
    copy_s = [copy.measure(reps=1) for _ in range(reps)]
    hop, per_mib = median_of(hop_s), median_of(copy_s)
    at_20 = 5 * hop / per_mib
    return Result(
        SUITE,
        "off-loop copy threshold: copy-executor round trip",
        hop * 1e6,
        "µs",
        "copy_ 1 MiB (rotating)",
        per_mib * 1e6,
        note=f"hop = 20% of the copy at {at_20:.1f} MiB; OFF_LOOP_COPY_BYTES = "
        f"{_offload.OFF_LOOP_COPY_BYTES / MiB:g} MiB",
    )


def run(opts: BenchOptions, quick: bool) -> list[Result]:
    """The coroutine figures: below and above the off-loop threshold, and the threshold itself."""
    from .kv_hs import _engine

    hidden = 1_024
    big_tokens = 4_096 if quick else 16_384
    loop = asyncio.new_event_loop()
    out: list[Result] = []
    try:
        out.append(off_loop_threshold(opts, loop))
        big_hs = big_tokens * hidden * 4
        eng = _engine(kv_gib=(160 * MiB) / (1 << 30), hs_gib=2.25 * (big_hs + 4 * MiB) / (1 << 30))
        try:
            # 128 KiB (the fixed cost of the call shows), 2 MiB, 32 MiB (above the threshold)
            for tokens, layers, kv_hidden in ((256, 2, 64), (512, 8, 128), (4_096, 8, 256)):
                out.append(kv_astore(opts, eng, loop, tokens, layers, kv_hidden))
            eng.storage_manager.clear_sync()
            hs = eng.hidden_state_store
            assert hs is not None
            # 256 KiB (the fixed cost of the call shows), 4 MiB, above the threshold
            for n, dim in ((256, 256), (1_024, hidden), (big_tokens, hidden)):
                p = _prompt(n, 20_000 + n)
                eng.store(p, torch.zeros(2, 1, n, 8, dtype=torch.bfloat16))
                assert hs.store_hidden_states(p, torch.randn(n, dim)) == n // CHUNK
                out.append(hs_aretrieve(opts, eng, loop, p, dim))
        finally:
            eng.close()
    finally:
        loop.close()
        gc.collect()
    return out
