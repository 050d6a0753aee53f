"""The eviction check of the backend conformance suite.

A tier that declares :attr:`~lmcache_async.tiers.StorageBackend.reports_removals` promises that
a listener bound with ``bind_removals`` hears of every entry it drops on its own; for a tier
with a byte budget that is mostly :attr:`~lmcache_async.tiers.RemovalReason.EVICTED`. The check
builds the tier small (the :meth:`EvictionConformanceTests.make_bounded_backend` hook), fills it
several times over with distinct entries, puts some evicted keys again and fills it once more,
and then compares what the tier reported with what it still holds:

* every report names the tier (its ``name``), a key it was given, and a :class:`RemovalReason`;
* a key reported removed is no longer held (``contains`` False, ``get`` None), unless it was put
  again after the report;
* a key it accepted (``put`` True) and no longer holds was reported (EVICTED, or DELETED/DAMAGED
  with that reason);
* no key is reported evicted twice without being put again in between.

:func:`eviction_problems` is the check itself (one line per problem, ``[]`` when none), so a
tier author may call it directly, and the kit's own tests feed it tiers that lie.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import MemoryFormat, PoolAllocator
from lmcache_async.testing.hooks import BackendHooks, flush_backend, start_backend
from lmcache_async.testing.objects import make_key, make_obj
from lmcache_async.tiers import BackendContext, RemovalReason, StorageBackend

__all__ = ["EvictionConformanceTests", "RemovalLog", "eviction_problems"]

#: Where the check's keys start (distinct from every other key of the suite).
KEY_BASE = 70_000


class RemovalLog:
    """A removal listener that records every report in order, from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seq = 0
        #: ``(seq, tier, keys, reason)`` per report, in the order they arrived.
        self.reports: list[tuple[int, Any, list[Any], Any]] = []

    def next_seq(self) -> int:
        """A position in the same sequence as the reports (marks when a put started)."""
        with self._lock:
            self._seq += 1
            return self._seq

    def __call__(self, tier: str, keys: Sequence[CacheEngineKey], reason: RemovalReason) -> None:
        with self._lock:
            self._seq += 1
            self.reports.append((self._seq, tier, list(keys), reason))

    def snapshot(self) -> list[tuple[int, Any, list[Any], Any]]:
        with self._lock:
            return list(self.reports)


@dataclass
class _Run:
    """What the check did: per key, when each accepted put started (log positions)."""

    backend: StorageBackend
    log: RemovalLog
    puts: dict[CacheEngineKey, list[int]] = field(default_factory=dict)
    refused: set[CacheEngineKey] = field(default_factory=set)
    accepted_bytes: int = 0

    async def put(self, items: Sequence[tuple[CacheEngineKey, Any]], *, batched: bool) -> None:
        seqs = [self.log.next_seq() for _ in items]
        if batched:
            results = await self.backend.batched_put(list(items))
        else:
            results = [await self.backend.put(k, o) for k, o in items]
        assert len(results) == len(items), f"batched_put answered {len(results)} flags for {len(items)} items"
        for (k, o), seq, ok in zip(items, seqs, results, strict=True):
            if ok:
                self.puts.setdefault(k, []).append(seq)
                self.accepted_bytes += o.nbytes
            elif k not in self.puts:
                self.refused.add(k)

    def removals(
        self, reports: list[tuple[int, Any, list[Any], Any]]
    ) -> dict[CacheEngineKey, list[tuple[int, RemovalReason]]]:
        out: dict[CacheEngineKey, list[tuple[int, RemovalReason]]] = {}
        for seq, _, keys, reason in reports:
            for k in keys:
                if isinstance(k, CacheEngineKey) and isinstance(reason, RemovalReason):
                    out.setdefault(k, []).append((seq, reason))
        return out

    def last_put(self, key: CacheEngineKey) -> int:
        return self.puts[key][-1]

    def reported_since_last_put(
        self, key: CacheEngineKey, removals: dict[CacheEngineKey, list[tuple[int, RemovalReason]]]
    ) -> list[tuple[int, RemovalReason]]:
        last = self.last_put(key)
        return [(s, r) for s, r in removals.get(key, []) if s > last]

    async def state_problems(self) -> list[str]:
        """Held-versus-reported problems now: reports read before and after asking ``contains``,
        so an eviction racing the question is not taken for a lie."""
        keys = list(self.puts)
        before = self.removals(self.log.snapshot())
        held = await self.backend.batched_contains(keys)
        after = self.removals(self.log.snapshot())
        still_held: list[str] = []
        unreported: list[str] = []
        name = self.backend.name
        for k, h in zip(keys, held, strict=True):
            if h and self.reported_since_last_put(k, before):
                (_, why), *_ = self.reported_since_last_put(k, before)
                still_held.append(
                    f"tier {name!r} reported key {k} as {why.name} but still holds it (contains True after the report)"
                )
            elif not h and not self.reported_since_last_put(k, after):
                unreported.append(
                    f"tier {name!r} no longer holds key {k} (accepted by put, now contains False) but never "
                    f"reported its removal: reason {RemovalReason.EVICTED.name} missing (or DELETED/DAMAGED "
                    "with its reason)"
                )
        return still_held + unreported

    async def settle(self, wait_s: float) -> None:
        """Wait (bounded) until what the tier holds and what it reported agree: removals may be
        reported a little after they happen, on another thread."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not await self.state_problems():
                return
            await asyncio.sleep(0.02)


def _report_problems(run: _Run) -> list[str]:
    """Problems of the reports themselves: the tier's name, known keys, reasons, and keys
    reported evicted twice without a put in between."""
    out: list[str] = []
    name = run.backend.name
    events: dict[CacheEngineKey, list[tuple[int, str]]] = {k: [(s, "put") for s in v] for k, v in run.puts.items()}
    for seq, tier, keys, reason in run.log.snapshot():
        if tier != name:
            out.append(f"a removal report of {keys} names tier {tier!r}, not the tier's name {name!r}")
        if not isinstance(reason, RemovalReason):
            out.append(f"a removal report of {keys} gives {reason!r} as its reason, not a RemovalReason")
            continue
        for k in keys:
            if not isinstance(k, CacheEngineKey):
                out.append(f"tier {name!r} reported {k!r} ({reason.name}), not a CacheEngineKey")
            elif k not in run.puts:
                out.append(f"tier {name!r} reported key {k} ({reason.name}) that it never accepted from a put")
            else:
                events[k].append((seq, reason.name))
    for k, evs in events.items():
        present = False
        for _, what in sorted(evs):
            if what == "put":
                present = True
            elif present:
                present = False
            elif what == RemovalReason.EVICTED.name:
                out.append(
                    f"tier {name!r} reported key {k} as EVICTED twice without it being put again (no entry of it "
                    "was held since its last removal report)"
                )
    return out


def _summary(problems: list[str], most: int = 12) -> list[str]:
    """Each problem once, in order; past ``most`` lines, one line counting the rest."""
    unique = list(dict.fromkeys(problems))
    if len(unique) <= most:
        return unique
    return [*unique[:most], f"... and {len(unique) - most} more problems of the same kinds"]


class _Entries:
    """The check's entries: distinct keys from :data:`KEY_BASE` on, each with its own seed, so an
    entry put again holds the same bytes as the first time. Blocks come from ``src_pool``."""

    def __init__(self, src_pool: PoolAllocator, entry_bytes: int) -> None:
        self._pool = src_pool
        self._shape = (entry_bytes // 4,)  # float32
        self._seeds: dict[CacheEngineKey, int] = {}

    def again(self, key: CacheEngineKey) -> tuple[CacheEngineKey, Any]:
        """A new block for ``key`` (made by :meth:`fresh` before) with its bytes."""
        return key, make_obj(self._pool, self._shape, torch.float32, MemoryFormat.UNDEFINED, seed=self._seeds[key])

    def fresh(self, count: int) -> list[tuple[CacheEngineKey, Any]]:
        """``count`` entries under keys never used before."""
        new = [make_key(KEY_BASE + len(self._seeds) + i) for i in range(count)]
        for k in new:
            self._seeds[k] = len(self._seeds)
        return [self.again(k) for k in new]


async def _put_released(run: _Run, items: list[tuple[CacheEngineKey, Any]], *, batched: bool) -> None:
    """Put ``items`` through ``run``, then release their blocks (whatever the put did)."""
    try:
        await run.put(items, batched=batched)
    finally:
        for _, o in items:
            o.ref_count_down()


async def _await_first_reports(run: _Run, capacity_bytes: int, wait_s: float) -> None:
    """After the first fill: wait up to ``wait_s`` seconds while nothing was reported though more
    than ``capacity_bytes`` were accepted (a tier that evicts in the background), stopping early
    once the state shows a problem."""
    deadline = time.monotonic() + wait_s
    while not run.log.snapshot() and run.accepted_bytes > capacity_bytes and time.monotonic() < deadline:
        if await run.state_problems():
            break
        await asyncio.sleep(0.02)


def _evicted_nothing(run: _Run, capacity_bytes: int) -> list[str]:
    """The problem of a tier that reported no removal after the first fill (a skip when it
    refused what did not fit instead of evicting)."""
    name = run.backend.name
    if run.accepted_bytes <= capacity_bytes:
        pytest.skip(f"tier {name!r} refuses puts that do not fit instead of evicting: nothing to check")
    return [
        f"tier {name!r} accepted {len(run.puts)} puts ({run.accepted_bytes} bytes) into a budget of "
        f"{capacity_bytes} bytes and still holds every one: it evicted nothing, so the check checked "
        "nothing (make_bounded_backend must bound the tier by capacity_bytes)"
    ]


async def _still_readable(run: _Run) -> list[str]:
    """Keys reported removed (and not put again since) that ``get`` still returns."""
    problems: list[str] = []
    final = run.removals(run.log.snapshot())
    for k in run.puts:
        since = run.reported_since_last_put(k, final)
        if not since:
            continue
        got = await run.backend.get(k)
        if got is not None:
            got.ref_count_down()
            problems.append(
                f"tier {run.backend.name!r} reported key {k} as {since[0][1].name} but get still returns it"
            )
    return problems


async def eviction_problems(
    backend: StorageBackend,
    src_pool: PoolAllocator,
    capacity_bytes: int,
    *,
    entries_per_capacity: int = 16,
    fill_factor: int = 3,
    wait_s: float = 5.0,
) -> list[str]:
    """Fill ``backend`` (built with a budget of ``capacity_bytes``) ``fill_factor`` times over
    with distinct entries of ``capacity_bytes / entries_per_capacity`` bytes, put again some of
    the keys it evicted, fill it once more, then compare its removal reports with what it holds
    (see the module docstring). One line per problem; ``[]`` when it kept its word.

    Binds a listener to ``backend`` for the duration (and unbinds it). Flushes the tier's
    buffered writes before each comparison and waits up to ``wait_s`` seconds for reports that
    arrive late. The entries come from ``src_pool`` (released before returning)."""
    entries = _Entries(src_pool, max(capacity_bytes // entries_per_capacity, 4))
    log = RemovalLog()
    backend.bind_removals(log)
    run = _Run(backend, log)
    try:
        # 1. Fill it fill_factor times over, one put after the other.
        for _ in range(fill_factor * entries_per_capacity):
            await _put_released(run, entries.fresh(1), batched=False)
        await flush_backend(backend)
        await run.settle(wait_s)
        await _await_first_reports(run, capacity_bytes, wait_s)
        problems = await run.state_problems()
        if problems:
            return _summary(_report_problems(run) + problems)
        removed = run.removals(log.snapshot())
        if not removed:
            return _evicted_nothing(run, capacity_bytes)
        evicted = [k for k in run.puts if any(r is RemovalReason.EVICTED for _, r in removed.get(k, []))]
        # 2. Put again a few keys it evicted (each a real store now), then fill it once more in
        # batches, so those keys may be evicted a second time.
        for k in evicted[: max(1, entries_per_capacity // 4)]:
            await _put_released(run, [entries.again(k)], batched=False)
        for _ in range(entries_per_capacity // 4 + 1):
            await _put_released(run, entries.fresh(4), batched=True)
        await flush_backend(backend)
        await run.settle(wait_s)
        problems = _report_problems(run) + await run.state_problems()
        # 3. Every key reported removed (and not put again) reads as absent.
        return _summary(problems + await _still_readable(run))
    finally:
        backend.bind_removals(None)


class EvictionConformanceTests(BackendHooks):
    """The eviction check; part of
    :class:`~lmcache_async.testing.conformance.BackendConformanceTests`. A tier with a byte
    budget implements :meth:`make_bounded_backend`."""

    #: The budget :meth:`make_bounded_backend` is asked for; the check's entries are 1/16 of it.
    bounded_capacity_bytes: int = 1 << 20
    #: How long the check waits for removal reports that arrive after the fact.
    eviction_report_wait_s: float = 5.0

    async def make_bounded_backend(
        self, ctx: BackendContext, location: Path, capacity_bytes: int
    ) -> StorageBackend | None:
        """Build the backend under test with room for about ``capacity_bytes`` payload bytes
        (its byte budget; header overhead is the tier's business), on the fresh directory
        ``location``; None (the default) means the tier cannot be built small, and the eviction
        check skips. The suite runs ``start()`` and ``close()``."""
        return None

    async def test_what_it_evicts_it_reports_and_holds_no_more(
        self, backend_context: Any, location: Path, src_pool: PoolAllocator
    ) -> None:
        cap = self.bounded_capacity_bytes
        made = await self.make_bounded_backend(backend_context(), location, cap)
        if made is None:
            pytest.skip(
                f"{type(self).__name__} does not implement make_bounded_backend(ctx, location, capacity_bytes): "
                "no way to build the tier small enough to evict"
            )
        be = await start_backend(made)
        try:
            if not be.reports_removals:
                pytest.skip(f"tier {be.name!r} does not declare reports_removals: no promise to hold its evictions to")
            if be.evicted_elsewhere:
                pytest.skip(f"tier {be.name!r} declares evicted_elsewhere: another process evicts and publishes that")
            problems = await eviction_problems(be, src_pool, cap, wait_s=self.eviction_report_wait_s)
            assert not problems, "\n".join(problems)
        finally:
            await be.close()
