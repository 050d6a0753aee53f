"""Stateful model test: ≥ 10⁵ seeded random operations (put, get, batched get, contains,
prefix, remove, flush, evict, clear, restart) over several tier stacks, checked against a
reference model after every step.

The model knows, per key, the current value version and whether the entry is ABSENT (must
miss), PRESENT (must hit) or MAYBE (may have been evicted). A hit must always hold exactly the
current version's bytes; a remove or clear makes a key ABSENT and gives its next put a new
version, so a stale copy that survived in some tier is caught. Pools return to 0 bytes after
``clear``; a double release raises (``DoubleReleaseError``) and fails the run.
"""

from __future__ import annotations

import enum
import random
import time
import uuid
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from lmcache_async import LMCacheEngineConfig, LMCacheEngineMetadata, StorageManager
from lmcache_async.memory import MemoryObj

from .chaos_support import chaos_key, entry_size, identity, payload, same_payload, scaled


class S(enum.Enum):
    ABSENT = 0
    PRESENT = 1
    MAYBE = 2


@dataclass
class Stack:
    """One tier stack of the model test."""

    name: str
    lossless: bool  # lower tiers keep everything (no eviction below the CPU tier)
    persistent: bool  # entries survive a restart
    needs: tuple[str, ...] = ()  # "redis", "nixl", "disk"
    overrides: Callable[[Path, Any], dict[str, Any]] = field(default=lambda root, srv: {})
    ops: int = 10_000


OPS = [  # (name, weight)
    ("put", 26),
    ("get", 28),
    ("batched_get", 5),
    ("contains", 12),
    ("prefix", 6),
    ("remove", 8),
    ("flush", 3),
    ("evict", 2),
    ("clear", 0.25),
    ("restart", 0.25),
]

N_KEYS = 160


class ModelRun:
    def __init__(self, stack: Stack, make: Callable[[], StorageManager], seed: int) -> None:
        self.stack = stack
        self.make = make
        self.seed = seed
        self.rng = random.Random(seed)
        self.sm = make()
        self.state = [S.ABSENT] * N_KEYS
        self.version = [0] * N_KEYS
        self.counts: dict[str, int] = dict.fromkeys((n for n, _ in OPS), 0)
        self.hits_checked = 0
        self.sizes = [entry_size(i, lo=64, hi=24 << 10) for i in range(N_KEYS)]

    # ---- helpers -------------------------------------------------------------------------------
    def key(self, i: int) -> Any:
        return chaos_key(i, model="model/test")

    def check_obj(self, i: int, obj: MemoryObj | None, where: str) -> None:
        st = self.state[i]
        if obj is None:
            assert st is not S.PRESENT, f"{where}: key {i} must be present ({self.stack.name})"
            return
        try:
            assert obj.get_ref_count() >= 1
            assert st is not S.ABSENT, f"{where}: key {i} must be absent, got {identity(obj)} ({self.stack.name})"
            assert same_payload(obj, i, self.sizes[i], self.version[i]), (
                f"{where}: key {i} v{self.version[i]} returned {identity(obj)} ({self.stack.name})"
            )
            self.hits_checked += 1
        finally:
            obj.ref_count_down()

    def degrade(self) -> None:
        """Something may have been evicted (lossy stacks): PRESENT becomes MAYBE."""
        if not self.stack.lossless:
            self.state = [S.MAYBE if s is S.PRESENT else s for s in self.state]

    def check_pools(self) -> None:
        for pool in (self.sm.pool, self.sm.staging_pool):
            if pool is not None:
                assert 0 <= pool.used_bytes <= pool.capacity and pool.num_objects >= 0

    # ---- operations -----------------------------------------------------------------------------
    def op_put(self) -> None:
        i = self.rng.randrange(N_KEYS)
        ok = self.sm.put_sync(self.key(i), payload(i, self.sizes[i], self.version[i]))
        assert ok, f"put of key {i} was refused ({self.stack.name})"
        self.degrade()
        self.state[i] = S.PRESENT
        if self.rng.random() < 0.3:  # read-your-writes, right away
            self.check_obj(i, self.sm.get_sync(self.key(i)), "get after put")
        self.degrade()

    def op_get(self) -> None:
        i = self.rng.randrange(N_KEYS)
        self.check_obj(i, self.sm.get_sync(self.key(i)), "get")
        self.degrade()  # a promotion may evict others

    def op_batched_get(self) -> None:
        ids = [self.rng.randrange(N_KEYS) for _ in range(self.rng.randint(1, 6))]
        objs = self.sm.batched_get_sync([self.key(i) for i in ids])
        assert len(objs) == len(ids)
        seen: set[int] = set()
        for i, obj in zip(ids, objs, strict=True):
            if obj is not None and i in seen:
                obj.ref_count_down()  # a key asked twice: checked once
                continue
            seen.add(i)
            self.check_obj(i, obj, "batched_get")
        self.degrade()

    def op_contains(self) -> None:
        i = self.rng.randrange(N_KEYS)
        got = self.sm.contains_sync(self.key(i))
        if self.state[i] is S.ABSENT:
            assert not got, f"contains: key {i} must be absent ({self.stack.name})"
        elif self.state[i] is S.PRESENT:
            assert got, f"contains: key {i} must be present ({self.stack.name})"

    def op_prefix(self) -> None:
        start = self.rng.randrange(N_KEYS)
        ids = [(start + j) % N_KEYS for j in range(self.rng.randint(1, 8))]
        n = self.sm.prefix_len_sync([self.key(i) for i in ids])
        assert 0 <= n <= len(ids)
        for i in ids[:n]:
            assert self.state[i] is not S.ABSENT, f"prefix counted absent key {i} ({self.stack.name})"
        must = 0
        while must < len(ids) and self.state[ids[must]] is S.PRESENT:
            must += 1
        assert n >= must, f"prefix {n} < {must} present keys ({self.stack.name})"

    def op_remove(self) -> None:
        i = self.rng.randrange(N_KEYS)
        removed = self.sm.remove_sync(self.key(i))
        if self.state[i] is S.ABSENT:
            assert not removed, f"remove: key {i} was absent ({self.stack.name})"
        elif self.state[i] is S.PRESENT:
            assert removed, f"remove: key {i} was present ({self.stack.name})"
        self.state[i] = S.ABSENT
        self.version[i] += 1
        assert not self.sm.contains_sync(self.key(i))

    def op_flush(self) -> None:
        self.sm.flush_sync(timeout=60)

    def op_evict(self) -> None:
        pool = self.sm.pool
        if pool is None:
            return
        block = self.sm.allocate((pool.capacity,), torch.uint8)  # evicts every entry nobody holds
        if block is not None:
            block.ref_count_down()
        if not self.sm.has_lower_tiers:
            self.state = [S.ABSENT] * N_KEYS  # nothing else held them
        else:
            self.degrade()

    def op_clear(self) -> None:
        self.sm.clear_sync()
        for pool in (self.sm.pool, self.sm.staging_pool):
            if pool is not None:
                assert pool.used_bytes == 0 and pool.num_objects == 0, f"after clear: {pool.stats()}"
        self.state = [S.ABSENT] * N_KEYS
        self.version = [v + 1 for v in self.version]

    def op_restart(self) -> None:
        old = self.sm
        old.close_sync()
        for pool in (old.pool, old.staging_pool):
            if pool is not None:
                assert pool.used_bytes == 0, f"after close: {pool.stats()}"
        self.sm = self.make()
        if not self.stack.persistent:
            self.state = [S.ABSENT] * N_KEYS
            self.version = [v + 1 for v in self.version]
        elif not self.stack.lossless:
            self.degrade()

    # ---- the run --------------------------------------------------------------------------------
    def run(self, n_ops: int) -> None:
        names = [n for n, _ in OPS]
        weights = [w for _, w in OPS]
        for step in range(n_ops):
            name = self.rng.choices(names, weights)[0]
            try:
                getattr(self, f"op_{name}")()
            except AssertionError as exc:
                raise AssertionError(f"seed {self.seed} step {step} ({name}): {exc}") from None
            self.counts[name] += 1
            if step % 64 == 0:
                self.check_pools()
        self.op_clear()
        self.counts["clear"] += 1

    def close(self) -> None:
        self.sm.close_sync()


def _fs(root: Path, srv: Any) -> dict[str, Any]:
    return {"remote_url": f"fs://{root / 'fs'}"}


def _redis(root: Path, srv: Any) -> dict[str, Any]:
    return {"remote_url": srv.url, "remote_key_prefix": f"model-{uuid.uuid4().hex[:8]}", "remote_part_size": 8 << 10}


def _nixl(root: Path, srv: Any) -> dict[str, Any]:
    return {"nixl_path": str(root / "nixl"), "nixl_backend": "POSIX"}


def _disk(budget_gib: float) -> Callable[[Path, Any], dict[str, Any]]:
    return lambda root, srv: {"local_disk": str(root / "disk"), "max_local_disk_size": budget_gib}


STACKS = [
    Stack("cpu-only", lossless=False, persistent=False, ops=30_000),
    Stack("cpu+fs", lossless=True, persistent=True, overrides=_fs, ops=12_000),
    Stack(
        "no-cpu+fs", lossless=True, persistent=True, overrides=lambda r, s: {**_fs(r, s), "local_cpu": False}, ops=6_000
    ),
    Stack("cpu+redis", lossless=True, persistent=True, needs=("redis",), overrides=_redis, ops=12_000),
    Stack("cpu+nixl", lossless=True, persistent=True, needs=("nixl",), overrides=_nixl, ops=10_000),
    Stack(
        "cpu+nixl+fs",
        lossless=True,
        persistent=True,
        needs=("nixl",),
        overrides=lambda r, s: {**_nixl(r, s), **_fs(r, s)},
        ops=8_000,
    ),
    Stack("cpu+disk", lossless=True, persistent=True, needs=("disk",), overrides=_disk(1.0), ops=12_000),
    Stack(
        "cpu+small-disk",  # the disk tier evicts too
        lossless=False,
        persistent=True,
        needs=("disk",),
        overrides=_disk(1.5 / 1024),
        ops=8_000,
    ),
    Stack(
        "cpu+disk+redis",
        lossless=True,
        persistent=True,
        needs=("disk", "redis"),
        overrides=lambda r, s: {**_disk(1.0)(r, s), **_redis(r, s)},
        ops=6_000,
    ),
]


def _run_stack(stack: Stack, tmp_path: Path, request: pytest.FixtureRequest, figures: Any, ops: int, seed: int) -> None:
    srv = request.getfixturevalue("shared_redis") if "redis" in stack.needs else None
    if "nixl" in stack.needs:
        request.getfixturevalue("need_nixl")
    overrides = stack.overrides(tmp_path, srv)

    def make() -> StorageManager:
        cfg = LMCacheEngineConfig.from_defaults(
            max_local_cpu_size=1 / 1024,  # 1 MiB: constant eviction and promotion
            staging_size=2 / 1024,
            blocking_timeout_secs=30,
            remote_timeout_s=10,
            **overrides,
        )
        return StorageManager(cfg, LMCacheEngineMetadata("model/test"), name="model")

    run = ModelRun(stack, make, seed)
    t0 = time.monotonic()
    try:
        run.run(ops)
    finally:
        run.close()
    total = sum(run.counts.values())
    figures(
        "stateful model test",
        operations=total,
        hits_checked=run.hits_checked,
        restarts=run.counts["restart"],
        clears=run.counts["clear"],
        evicts=run.counts["evict"],
        stacks=1,
    )
    figures(f"stateful model test: {stack.name}", operations=total, seconds=round(time.monotonic() - t0, 1))


@pytest.mark.parametrize("stack", STACKS, ids=[s.name for s in STACKS])
def test_model(stack: Stack, tmp_path: Path, request: pytest.FixtureRequest, figures: Any) -> None:
    if "disk" in stack.needs:
        pytest.importorskip("lmcache_async.disk.tier")
    _run_stack(stack, tmp_path, request, figures, scaled(stack.ops), seed=zlib.crc32(stack.name.encode()))


@pytest.mark.soak
@pytest.mark.parametrize("stack", STACKS, ids=[s.name for s in STACKS])
def test_model_soak(stack: Stack, tmp_path: Path, request: pytest.FixtureRequest, figures: Any) -> None:
    _run_stack(stack, tmp_path, request, figures, scaled(stack.ops * 10), seed=int(time.time()))
