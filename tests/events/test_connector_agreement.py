"""A real router's index agrees with a KV connector store's CPU tier.

The connector's event source (:class:`KVEventSource`) is fed the way the connector feeds it: a
chunk whose put made it readable in the CPU tier is reported saved; the tier's own removal reports
(evictions under pressure of a small pool, deletes, clears) reach it through the manager's removal
listeners. 10,000 operations (stores of prompt prefixes, reads that move the LRU order, deletes,
clears); the events are taken after every operation, as vLLM's scheduler takes them every step.
At each quiet point, for every prompt, the blocks the store's own prefix lookup serves equal the
overlap of our reading of the stream and of NVIDIA Dynamo's ``RadixTree`` fed it.
"""

from __future__ import annotations

import json
import random
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from events.conftest import interpreter
from events.kv_workload import CHUNK_BLOCKS, Prompt, make_prompts
from events.test_router_agreement import Recorder

from lmcache_async.config import LMCacheEngineConfig
from lmcache_async.events.wire import BlockRemoved, BlockStored, KVEventBatch
from lmcache_async.integration.vllm.kv.events import KVEventSource
from lmcache_async.keys import CacheEngineKey
from lmcache_async.metadata import LMCacheEngineMetadata
from lmcache_async.storage_manager import StorageManager

OPS = 10_000
QUIET_EVERY = 250
HERE = Path(__file__).resolve().parent


@dataclass
class Run:
    recording: Path
    checks: int
    own_mismatches: int
    evictions: int
    prompts: int


def _keys(p: Prompt) -> list[CacheEngineKey]:
    return [CacheEngineKey.from_string(k.decode()) for k in p.keys]


class Store:
    """A CPU-tier store with the connector's event source attached."""

    def __init__(self) -> None:
        cfg = LMCacheEngineConfig.from_defaults(max_local_cpu_size=1 / 1024, tier_order=["cpu"])
        self.manager = StorageManager(cfg, LMCacheEngineMetadata("events/model"))
        self.source = KVEventSource(types=(BlockStored, BlockRemoved))
        self.manager.removals.add(self.source.tier_removed)
        self.payload = torch.zeros(16, 256)

    def store(self, p: Prompt, upto: int) -> None:
        for key, chunk in zip(_keys(p)[:upto], p.chunks[:upto], strict=True):
            if self.manager.put_sync(key, self.payload) and self.manager.contains_sync(key):
                self.source.chunk_saved(key, chunk, ["cpu"])  # readable in the CPU tier: durable there

    def lookup_blocks(self, p: Prompt) -> int:
        return self.manager.prefix_len_sync(_keys(p)) * CHUNK_BLOCKS

    def events(self) -> list[KVEventBatch]:
        evs = self.source.take_events()
        return [KVEventBatch(ts=0.0, events=evs)] if evs else []


def _operate(rng: random.Random, store: Store, prompts: list[Prompt]) -> None:
    p = rng.choice(prompts)
    r = rng.random()
    if r < 0.55:
        store.store(p, rng.randint(1, len(p.chunks)))
    elif r < 0.80:
        store.manager.touch(_keys(p))  # a reader: the LRU order moves
    elif r < 0.995:
        store.manager.remove_sync(rng.choice(_keys(p)))
    else:
        store.manager.clear_sync()


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    work = tmp_path_factory.mktemp("connector-agreement")
    rng = random.Random(400)
    prompts = make_prompts(rng, 120)
    store = Store()
    rec = Recorder(work / "recording.jsonl", prompts, "engine CPU")
    checks = own_bad = 0
    try:
        for op in range(1, OPS + 1):
            _operate(rng, store, prompts)
            rec.batches(store.events())  # the scheduler takes the events every step
            if op % QUIET_EVERY == 0:
                want = [store.lookup_blocks(p) for p in prompts]
                own_bad += sum(rec.overlap(p) != w for p, w in zip(prompts, want, strict=True))
                rec.check(want)
                checks += 1
        rec.f.close()
        evictions = int(store.manager.stats()["tiers"]["cpu"]["evictions"])
        yield Run(work / "recording.jsonl", checks, own_bad, evictions, len(prompts))
    finally:
        store.manager.close_sync()


@pytest.mark.timeout(600)
def test_our_reading_of_the_connectors_events_matches_the_store(run: Run) -> None:
    assert run.checks == OPS // QUIET_EVERY
    assert run.evictions > 0, "the workload never put the CPU tier under pressure"
    assert run.own_mismatches == 0


@pytest.mark.timeout(600)
def test_dynamos_radix_tree_agrees_with_the_connector_store(run: Run) -> None:
    python = interpreter("LMCACHE_ASYNC_DYNAMO_PYTHON", "NVIDIA Dynamo's index (scripts/dynamo_env.sh)")
    res = subprocess.run([python, str(HERE / "dynamo_replay.py"), str(run.recording)], capture_output=True,
                         text=True, timeout=300, check=False)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    print(f"dynamo agreement (connector, CPU tier): {OPS} operations ({run.evictions} evictions): {out}")
    assert out["checks"] == run.checks and out["comparisons"] == run.checks * run.prompts
    assert out["errors"] == 0 and out["phantom"] == 0 and out["missed"] == 0, out["first_mismatch"]
