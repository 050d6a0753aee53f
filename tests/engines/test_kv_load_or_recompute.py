"""Load or recompute: the cost estimates, the decision, no load/recompute cycle, deadlines.

Costs here are synthetic (samples fed to the book by hand, a fake clock); nothing asserts a
timing. The scheduler and worker halves run over a real StorageManager (CPU + disk tiers) as in
``test_kv_connector_sides.py``.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lmcache_async.integration.vllm.kv import worker as kv_worker
from lmcache_async.integration.vllm.kv.costs import CostBook, LoadDecision, ReadCost, decide_load, load_deadline
from lmcache_async.integration.vllm.kv.lookup import LoadSettings, TierLookups
from lmcache_async.integration.vllm.kv.metadata import BlockRun, KVStepMetadata
from lmcache_async.integration.vllm.kv.scheduler import KVSchedulerSide
from lmcache_async.integration.vllm.kv.store import KVStore
from lmcache_async.integration.vllm.kv.worker import KVWorkerSide

from .test_kv_connector_sides import (
    BPC,
    BS,
    DST_BLOCKS,
    META,
    PROMPT,
    build,
    caches,
    config,
    new_req_step,
    store_prompt,
    vreq,
    wait_loads,
)

MB = 1_000_000


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


def book_with(clock: Clock | None = None, **tiers: tuple[float, float]) -> CostBook:
    """A book whose tiers read at ``(latency_s, bytes_per_s)`` (two probe sizes each)."""
    book = CostBook({}, clock=clock or Clock())
    for tier, (lat, bw) in tiers.items():
        for n in (64 << 10, 2 << 20):
            book.observe_read(tier, n, lat + n / bw)
    return book


# ---- the estimator ----
def test_a_tiers_latency_and_bandwidth_are_fitted_from_reads_of_two_sizes() -> None:
    c = ReadCost(3600.0)
    for n in (64 << 10, 1 << 20, 2 << 20):
        c.observe(n, 0.005 + n / (8 * MB), 1.0)
    params = c.params()
    assert params is not None
    lat, per_byte = params
    assert lat == pytest.approx(0.005, rel=1e-6)
    assert 1 / per_byte == pytest.approx(8 * MB, rel=1e-6)
    assert c.estimate(4 << 20, reads=2) == pytest.approx(2 * 0.005 + (4 << 20) / (8 * MB))


def test_reads_of_one_size_price_everything_as_bandwidth() -> None:
    c = ReadCost(3600.0)
    c.observe(2 << 20, 0.5, 1.0)
    assert c.estimate(4 << 20) == pytest.approx(1.0)
    assert ReadCost(3600.0).estimate(1) is None


def test_recent_reads_outweigh_old_ones_so_a_recovered_tier_is_believed_again() -> None:
    clock = Clock()
    book = CostBook({}, clock=clock, half_life_s=60.0)
    for _ in range(20):
        book.observe_read("remote", 2 << 20, 2.0)  # slow
    slow = book.read_time("remote", 2 << 20)
    clock.t += 600  # ten half-lives later the tier is fast again
    book.observe_read("remote", 2 << 20, 0.01)
    fast = book.read_time("remote", 2 << 20)
    assert slow is not None and fast is not None
    assert fast < 0.05 < slow


def test_an_unavailable_mark_prices_the_tier_out_until_it_expires() -> None:
    clock = Clock()
    book = book_with(clock, disk=(0.0001, 2e9))
    book.mark_unavailable("disk", 30.0)
    assert book.read_time("disk", 1 << 20) == math.inf
    clock.t += 31
    t = book.read_time("disk", 1 << 20)
    assert t is not None and t < 0.01


def test_the_prefill_rate_comes_from_the_engines_steps() -> None:
    book = CostBook({})
    assert book.prefill_tokens_per_s is None
    book.observe_prefill(3000, 1.5)
    book.observe_prefill(2000, 1.0)
    assert book.prefill_tokens_per_s == pytest.approx(2000.0)


def test_estimates_survive_the_process_in_the_state_file_keyed_by_location(tmp_path: Path) -> None:
    path = str(tmp_path / "costs.json")
    a = CostBook({"remote": "redis-a"}, path)
    a.observe_read("remote", 2 << 20, 0.25)
    a.observe_prefill(3000, 1.0)
    a.save(force=True)
    b = CostBook({"remote": "redis-a"}, path)
    assert b.read_time("remote", 2 << 20) == pytest.approx(0.25)
    assert b.prefill_tokens_per_s == pytest.approx(3000.0)
    other = CostBook({"remote": "redis-b"}, path)  # the same tier name reached elsewhere
    assert other.read_time("remote", 2 << 20) is None
    (tmp_path / "costs.json").write_text("not json")
    assert CostBook({"remote": "redis-a"}, path).read_time("remote", 1) is None  # damage: a fresh book


# ---- the decision ----
CHUNK_BYTES = 2 << 20
TOKENS = [256] * 10


def decide(tiers: Sequence[str | None], book: CostBook, rate: float | None, **kw: Any) -> LoadDecision:
    return decide_load(tiers, TOKENS[: len(tiers)], CHUNK_BYTES, book.read_time, rate, memory_tiers={"cpu"}, **kw)


def test_a_slow_tier_is_recomputed_and_a_fast_one_loaded() -> None:
    book = book_with(remote=(0.005, 8 * MB), disk=(0.0002, 1.5e9))
    rate = 1000.0  # tokens/s: 2.56 s to prefill the ten chunks; the remote needs ~2.7 s
    slow = decide(["remote"] * 10, book, rate)
    assert slow.chunks == 0 and slow.reason == "slower"
    assert slow.declined is not None and slow.declined[0] == "remote" and slow.declined[1] > slow.declined[2]
    fast = decide(["disk"] * 10, book, rate)
    assert fast.chunks == 10 and fast.reason == "cheaper"
    assert fast.load_s is not None and fast.recompute_s is not None and fast.load_s < fast.recompute_s


def test_memory_chunks_are_free_and_a_slow_tail_is_weighed_on_its_own() -> None:
    book = book_with(remote=(0.005, 8 * MB))
    d = decide(["cpu"] * 4 + ["remote"] * 6, book, 1000.0)
    assert d.chunks == 4 and d.reason == "slower"
    assert decide(["cpu"] * 10, CostBook({}), None).reason == "memory"


def test_the_margin_decides_a_close_call() -> None:
    book = book_with(remote=(0.0, 1e6 * 2.2))  # one chunk: 0.953 s to read, 1.0 s to prefill
    rate = 256.0
    assert decide(["remote"], book, rate, margin=0.0).chunks == 1
    assert decide(["remote"], book, rate, margin=0.1).chunks == 0


def test_an_unavailable_tier_ends_the_prefix_unless_the_policy_is_always() -> None:
    book = book_with(disk=(0.0002, 1.5e9))
    book.mark_unavailable("disk")
    assert decide(["disk"] * 3, book, 1000.0).reason == "unavailable"
    assert decide(["disk"] * 3, book, 1000.0, policy="always").chunks == 3


def test_policies_never_always_and_an_unknown_tier() -> None:
    book = book_with(remote=(0.005, 8 * MB))
    assert decide(["remote"] * 3, book, 1000.0, policy="never").chunks == 0
    assert decide(["remote"] * 3, book, 1000.0, policy="always").chunks == 3
    unknown = decide(["nixl"] * 3, book, 1000.0)  # never measured: loaded, as before measures
    assert unknown.chunks == 3 and unknown.reason == "unknown"
    assert decide([None, "remote"], book, 1000.0).reason == "miss"
    with pytest.raises(ValueError, match="policy"):
        decide(["remote"], book, 1.0, policy="sometimes")
    with pytest.raises(ValueError, match="tokens"):
        decide_load(["remote"], [1, 2], 1, book.read_time, 1.0, memory_tiers=set())


def test_max_load_s_cuts_the_load_to_what_fits() -> None:
    book = book_with(disk=(0.0, 20 * MB))  # ~0.105 s per chunk
    d = decide(["disk"] * 10, book, 100.0, max_load_s=0.35)
    assert d.chunks == 3 and d.reason == "max_load_s"
    assert decide(["disk"] * 10, book, 100.0, max_load_s=0.35, policy="always").chunks == 10  # a deadline only


def test_the_deadline_is_a_factor_over_the_estimate_never_below_the_recompute_and_capped() -> None:
    d = LoadDecision(4, 1.0, 2.5, "cheaper")
    assert load_deadline(d, factor=3.0, max_load_s=None) == 3.0
    assert load_deadline(d, factor=1.5, max_load_s=None) == 2.5
    assert load_deadline(d, factor=3.0, max_load_s=2.0) == 2.0
    assert load_deadline(LoadDecision(4, None, None, "unknown"), factor=3.0, max_load_s=None) is None


def test_request_params_override_the_policy_and_bad_ones_are_reported() -> None:
    base = LoadSettings()
    s, bad = base.for_request({"load_policy": "never", "max_load_s": 2})
    assert (s.policy, s.max_load_s, bad) == ("never", 2.0, None)
    s, bad = base.for_request({"load_policy": "maybe"})
    assert s is base and bad is not None and "load_policy" in bad
    assert base.for_request(None) == (base, None)


# ---- the scheduler: priced decisions and no cycle ----
@pytest.fixture
def two_stores(tmp_path: Path) -> Iterator[tuple[KVStore, KVStore]]:
    first = KVStore(config(tmp_path / "disk"), META)
    second = KVStore(config(tmp_path / "disk"), META)
    yield first, second
    first.close()
    second.close()


def sched_for(store: KVStore, book: CostBook, **kw: Any) -> KVSchedulerSide:
    sm = store.storage_manager
    return KVSchedulerSide(lambda: sm, store.token_database, BS, BPC, costs=book, chunk_bytes=CHUNK_BYTES, **kw)


def test_a_slow_tier_is_declined_counted_and_a_request_may_ask_for_it_anyway(
    two_stores: tuple[KVStore, KVStore],
) -> None:
    store_prompt(two_stores[0])
    book = book_with(disk=(0.5, 1e6))  # priced far slower than the prefill
    book.observe_prefill(10_000, 1.0)
    sched = sched_for(two_stores[1], book)
    assert sched.num_new_matched_tokens(vreq("r1"), 0) == (0, False)
    assert sched.counters["decision_slower"] == 1 and sched.counters["tokens_declined"] == 24
    always = vreq("r2", kv_transfer_params={"load_policy": "always"})
    assert sched.num_new_matched_tokens(always, 0) == (24, True)
    assert sched.counters["decision_always"] == 1


def test_a_failed_load_is_never_offered_again(two_stores: tuple[KVStore, KVStore]) -> None:
    store_prompt(two_stores[0])
    sched = sched_for(two_stores[1], book_with(disk=(0.0001, 1e9)))
    for failure in ("invalid", "failed"):
        req = vreq(f"r-{failure}")
        n, is_async = sched.num_new_matched_tokens(req, 0)
        assert n == 24 and is_async
        sched.after_alloc(req, (DST_BLOCKS,), n)
        build(sched, new_req_step(req.request_id, DST_BLOCKS, 0, len(PROMPT) - n))
        if failure == "invalid":
            out = SimpleNamespace(invalid_block_ids={DST_BLOCKS[3]}, failed_recving=set(), finished_recving=set())
        else:
            out = SimpleNamespace(invalid_block_ids=set(), failed_recving={req.request_id}, finished_recving=set())
        sched.after_step(out)
        # vLLM recomputes and asks again: the same chunks are not offered a second time
        assert sched.num_new_matched_tokens(req, 0) == (0, False)
    assert sched.counters["loads_failed"] == 2 and sched.counters["loads_refused_after_failure"] == 2
    sched.finished("r-invalid")
    assert "r-invalid" not in sched._refused


def test_a_successful_load_may_be_loaded_again_after_preemption(two_stores: tuple[KVStore, KVStore]) -> None:
    store_prompt(two_stores[0])
    sched = sched_for(two_stores[1], book_with(disk=(0.0001, 1e9)))
    req = vreq("r")
    n, _ = sched.num_new_matched_tokens(req, 0)
    assert n is not None  # the lookup ran on this thread
    sched.after_alloc(req, (DST_BLOCKS,), n)
    build(sched, new_req_step("r", DST_BLOCKS, 0, len(PROMPT) - n))
    sched.after_step(SimpleNamespace(invalid_block_ids=set(), failed_recving=set(), finished_recving={"r"}))
    assert sched.num_new_matched_tokens(req, 0) == (24, True)


def test_the_planned_async_load_carries_its_tiers_and_deadline(two_stores: tuple[KVStore, KVStore]) -> None:
    store_prompt(two_stores[0])
    book = book_with(disk=(0.0001, 1e9))
    book.observe_prefill(1000, 1.0)
    sched = sched_for(two_stores[1], book, settings=LoadSettings(max_load_s=5.0))
    n, _ = sched.num_new_matched_tokens(vreq("r"), 0)
    assert n is not None  # the lookup ran on this thread
    sched.after_alloc(vreq("r"), (DST_BLOCKS,), n)
    meta = build(sched, new_req_step("r", DST_BLOCKS, 0, len(PROMPT) - n))
    (run,) = meta.async_loads
    assert run.tiers == ("disk",) * 3
    assert run.deadline_s is not None and 0 < run.deadline_s <= 5.0
    back = KVStepMetadata.from_dict(meta.to_dict())
    assert back.async_loads[0] == run and back.num_tokens == meta.num_tokens


def test_with_several_kv_cache_groups_every_load_is_asynchronous(tmp_path: Path) -> None:
    store = KVStore(config(tmp_path / "d"), META)
    try:
        store_prompt(store)  # in this store's CPU tier: a synchronous load otherwise
        sched = sched_for(store, CostBook({}), per_request_failures=True)
        assert sched.num_new_matched_tokens(vreq("r"), 0) == (24, True)
    finally:
        store.close()


# ---- the lookup never blocks the scheduler thread ----
class SlowLocator:
    """A manager whose lower tiers only the loop can answer, and slowly."""

    def __init__(self, names: list[str | None]) -> None:
        self.names = names
        self.release = threading.Event()

    def locate_here(self, keys: list[Any]) -> tuple[list[str | None], bool]:
        return [None] * len(keys), True

    def locate_sync(self, keys: list[Any]) -> list[str | None]:
        self.release.wait(10)
        return self.names[: len(keys)]


def test_a_lookup_in_flight_answers_ask_again_then_the_tiers() -> None:
    loc = SlowLocator(["remote", "remote", None])
    lookups = TierLookups(lambda: loc, CostBook({}), give_up_s=30.0)  # type: ignore[arg-type,return-value]
    try:
        keys = [object(), object(), object()]
        assert lookups.where("r", keys) is None  # type: ignore[arg-type]
        assert lookups.where("r", keys) is None  # type: ignore[arg-type]
        loc.release.set()
        deadline = time.monotonic() + 10
        got = None
        while got is None and time.monotonic() < deadline:
            got = lookups.where("r", keys)  # type: ignore[arg-type]
            time.sleep(0.001)
        assert got == ["remote", "remote", None]
        assert lookups.counters["lookups_deferred"] == 1
    finally:
        loc.release.set()
        lookups.close()


def test_a_lookup_past_its_bound_is_a_miss() -> None:
    loc = SlowLocator(["remote"])
    lookups = TierLookups(lambda: loc, CostBook({}), give_up_s=0.01)  # type: ignore[arg-type,return-value]
    try:
        keys = [object()]
        assert lookups.where("r", keys) is None  # type: ignore[arg-type]
        time.sleep(0.05)
        assert lookups.where("r", keys) == [None]  # type: ignore[arg-type]
        assert lookups.counters["lookups_given_up"] == 1
    finally:
        loc.release.set()
        lookups.close()


# ---- the worker: deadlines that cannot corrupt ----
def worker_for(store: KVStore, book: CostBook, **kw: Any) -> KVWorkerSide:
    return KVWorkerSide(store.storage_manager, store.token_database, BS, BPC, costs=book, **kw)


def planned_run(store: KVStore, deadline_s: float | None) -> BlockRun:
    hashes = tuple(store.token_database.chunk_hashes(PROMPT)[:3])
    return BlockRun("r", 0, tuple(DST_BLOCKS[:6]), hashes, ("disk",) * 3, deadline_s)


def test_a_load_past_its_deadline_stops_at_a_chunk_boundary_and_writes_nothing_after(
    two_stores: tuple[KVStore, KVStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    src = store_prompt(two_stores[0])
    book = CostBook({})
    worker = worker_for(two_stores[1], book)
    dst = caches(seed=None)
    worker.register(dst)
    monkeypatch.setattr(kv_worker, "PIECE_BYTES", 1)  # one chunk per read
    monkeypatch.setattr(kv_worker, "PIECE_S", 0.0)
    sm = worker.manager
    real = sm.read_into_sync
    reads: list[int] = []

    def slow_read(keys: Any, sinks: Any, *, prefix: bool = False) -> list[bool]:
        reads.append(len(keys))
        out = real(keys, sinks, prefix=prefix)
        time.sleep(0.2)  # the piece in flight outlives the deadline: it is waited out
        return out

    monkeypatch.setattr(sm, "read_into_sync", slow_read)
    worker.load(KVStepMetadata(async_loads=[planned_run(two_stores[1], 0.1)]))
    wait_loads(worker, {"r"})
    assert reads == [1]  # the second piece was never started
    assert worker.take_load_errors() == set(DST_BLOCKS[2:6])
    assert worker.counters["abandoned_loads"] == 1 and worker.counters["abandoned_blocks"] == 4
    for name in src:
        for s, d in zip([9, 3], DST_BLOCKS[:2], strict=True):
            assert torch.equal(dst[name][d], src[name][s])
        assert not dst[name][DST_BLOCKS[2:]].any()  # nothing written after the abandon
    # priced by the late piece it waited out, not priced out: a slow read is not a failure
    assert book.read_params("disk") is not None and book.snapshot()["unavailable"] == []
    assert book.read_time("disk", 1) != math.inf


def test_with_several_groups_an_abandoned_load_fails_its_request_not_block_ids(
    two_stores: tuple[KVStore, KVStore],
) -> None:
    store_prompt(two_stores[0])
    worker = worker_for(two_stores[1], CostBook({}), per_request_failures=True)
    worker.register(caches(seed=None))
    run = planned_run(two_stores[1], 0.001)
    fetched = worker._fetch_guarded(run, False, time.monotonic() - 1.0)  # already past its deadline
    assert fetched is not None and fetched.filled == 0
    worker._apply_guarded(run, fetched)
    assert worker.take_load_errors() == set()
    assert worker.take_failed_requests() == {"r"}
    assert worker.counters["abandoned_loads"] == 1


def test_completed_pieces_are_measured_into_the_tiers_cost(two_stores: tuple[KVStore, KVStore]) -> None:
    store_prompt(two_stores[0])
    book = CostBook({})
    worker = worker_for(two_stores[1], book)
    worker.register(caches(seed=None))
    worker.load(KVStepMetadata(async_loads=[planned_run(two_stores[1], None)]))
    wait_loads(worker, {"r"})
    assert worker.take_load_errors() == set()
    t = book.read_time("disk", 1 << 20)
    assert t is not None and 0 < t < math.inf


def test_a_fast_tier_is_read_in_one_piece_and_a_slow_one_chunk_by_chunk(two_stores: tuple[KVStore, KVStore]) -> None:
    book = book_with(disk=(0.0001, 2e9), remote=(0.005, 8 * MB))
    worker = worker_for(two_stores[1], book)
    record = 4 << 20
    assert worker._piece_chunks("disk", record) == int(kv_worker.PIECE_S * 2e9) // record
    assert worker._piece_chunks("remote", record) == 1
    assert worker._piece_chunks("", 1 << 20) == kv_worker.PIECE_BYTES // (1 << 20)


def test_the_worker_times_big_steps_as_the_prefill_rate(two_stores: tuple[KVStore, KVStore]) -> None:
    book = CostBook({})
    worker = worker_for(two_stores[1], book)
    worker.step_started(10.0)
    worker.step_computed(3000, 11.5)
    worker.step_started(20.0)
    worker.step_computed(1, 30.0)  # a decode step: not a prefill sample
    assert book.prefill_tokens_per_s == pytest.approx(2000.0)


# ---- the manager: where each entry lies ----
def test_the_manager_locates_each_key_in_its_tier_and_probes_a_lower_tier(tmp_path: Path) -> None:
    store = KVStore(config(tmp_path / "d"), META)
    other = KVStore(config(tmp_path / "d"), META)
    try:
        store_prompt(store)
        keys = store.token_database.keys(PROMPT)[:3] + other.token_database.keys(list(range(8)))[:1]
        assert store.storage_manager.locate_sync(keys) == ["cpu", "cpu", "cpu", None]
        assert other.storage_manager.locate_sync(keys) == ["disk", "disk", "disk", None]
        assert other.storage_manager.locate_here(keys) == (["disk", "disk", "disk", None], False)
        status = other.storage_manager.tier_status()
        assert status["cpu"] == (True, True) and status["disk"] == (False, True)
        took = other.storage_manager.probe_read_sync("disk", 64 << 10)
        assert took is not None and took > 0
        assert other.storage_manager.probe_read_sync("cpu", 64 << 10) is None
        with pytest.raises(ValueError, match="nbytes"):
            other.storage_manager.probe_read_sync("disk", 0)
        with pytest.raises(TypeError, match="key"):
            other.storage_manager.locate_sync(["not a key"])  # type: ignore[list-item]
    finally:
        store.close()
        other.close()


def test_decisions_and_estimates_are_exported_to_prometheus(two_stores: tuple[KVStore, KVStore]) -> None:
    pytest.importorskip("prometheus_client")
    from lmcache_async.integration.vllm.kv.metrics import SchedulerMetrics

    store_prompt(two_stores[0])
    book = book_with(disk=(0.5, 1e6))
    book.observe_prefill(10_000, 1.0)
    sched = sched_for(two_stores[1], book)
    sched.num_new_matched_tokens(vreq("r1"), 0)
    families = {f.name: f for f in SchedulerMetrics(sched).collect()}
    counters = {s.labels["counter"]: s.value for s in families["lmcache_async_kv_connector"].samples}
    assert counters["decision_slower"] == 1 and counters["tokens_declined"] == 24
    assert families["lmcache_async_kv_prefill_tokens_per_second"].samples[0].value == pytest.approx(10_000)
    bw = {s.labels["tier"]: s.value for s in families["lmcache_async_kv_tier_read_bytes_per_second"].samples}
    assert bw["disk"] == pytest.approx(1e6)
