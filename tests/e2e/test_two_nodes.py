"""Two nodes sharing one cache through an object store, with real vLLM engines.

Two ``lmcache-async serve`` processes stand for two machines: separate sockets, pools and disk
directories, each with the same shared store below it — the ``s3://`` tier on one bucket of a
SeaweedFS, or a Mooncake Store (master, metadata server and a segment holder) — every listener on
loopback. Engines use ``tier_order: [server]`` with their node's socket:

1. ``baseline``: no connector — the reference greedy tokens and the uncached TTFT;
2. ``node1``: stores prompt 0 into node 1's server, which writes it through to its disk and the
   shared store; node 1's server then shuts down (its write-through flushed);
3. ``node2``: a new engine on node 2 restores prompt 0 from the shared store through node 2's
   server (which finds it in its lower tier and keeps it in its pool), tokens equal to the
   baseline's;
4. ``node2_again``: another new engine on node 2 finds prompt 0 in node 2's pool: a node-local hit.

Node 2's run-2 TTFT is reported beside the uncached one and beside the node-local hit.
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

from lmcache_async.testing.cache_server import CacheServerProcess
from lmcache_async.testing.mooncake_servers import MooncakeServers
from lmcache_async.testing.seaweedfs_servers import SeaweedServer

from .kv_engines import CHUNK, expected_hit, make_prompts, run_kv_engine
from .kv_engines import ok_runs as _ok

NAMESPACE = "two-nodes"
PREFIX = "two-nodes"
PROMPTS = make_prompts(1, vocab=4096, seed=31)


@pytest.fixture(scope="module", params=["s3", "mooncake"])
def shared(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The store both nodes share: a SeaweedFS bucket, or a Mooncake Store."""
    srv: Any
    if request.param == "s3":
        srv = SeaweedServer(workdir=tmp_path_factory.mktemp("weed")).start()
    else:
        srv = MooncakeServers(workdir=tmp_path_factory.mktemp("mooncake")).start()
    yield srv
    srv.stop()


def node(workdir: Path, shared: Any) -> CacheServerProcess:
    """One node's server: a 128 MiB pool, a disk directory of its own, the shared store below."""
    below = shared.config(PREFIX, remote_timeout_s=10.0) if isinstance(shared, SeaweedServer) else shared.config()
    return CacheServerProcess(
        workdir,
        max_local_cpu_size=0.125,
        local_disk=str(workdir / "disk"),
        max_local_disk_size=0.5,
        **below,
    )


def s3_objects(seaweed: SeaweedServer) -> int:
    """Objects under the test's prefix in the bucket."""
    import obstore
    from obstore.store import S3Store

    store = S3Store(
        seaweed.bucket,
        endpoint=seaweed.endpoint,
        region="us-east-1",
        skip_signature=True,
        client_options={"allow_http": True},
    )
    return sum(len(batch) for batch in obstore.list(store, prefix=PREFIX))


@pytest.fixture(scope="module")
def baseline(kv_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The engine without a connector, once for both shared stores."""
    work = tmp_path_factory.mktemp("two-nodes-baseline")
    spec = {"model": str(kv_model_dir), "prompts": PROMPTS, "max_tokens": 16, "kv": None, "phases": [{"prompts": [0]}]}
    return run_kv_engine(work, "baseline", spec)


@pytest.fixture(scope="module")
def two_node_runs(
    kv_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, shared: Any, baseline: dict[str, Any]
) -> Iterator[dict[str, Any]]:
    work = tmp_path_factory.mktemp("two-nodes")
    node1 = node(work / "node1", shared).start(timeout=120)
    node2 = node(work / "node2", shared).start(timeout=120)
    try:
        prompts = PROMPTS
        base = {"model": str(kv_model_dir), "prompts": prompts, "max_tokens": 16}

        def kv(srv: CacheServerProcess) -> dict[str, Any]:
            return {
                "tier_order": ["server"],
                "cache_server_socket": srv.socket,
                "cache_server_namespace": NAMESPACE,
                "chunk_size": CHUNK,
                "remote_timeout_s": 10.0,
            }

        out: dict[str, Any] = {"prompts": prompts}
        out["baseline"] = baseline
        out["node1"] = run_kv_engine(work, "node1", {**base, "kv": kv(node1), "phases": [{"prompts": [0]}]})
        out["node1_exit"] = node1.stop(timeout=120)  # a graceful stop flushes the write-through
        out["shared_objects"] = s3_objects(shared) if isinstance(shared, SeaweedServer) else None
        out["node2_before"] = node2.status()["namespaces"].get(NAMESPACE, {})
        out["node2"] = run_kv_engine(work, "node2", {**base, "kv": kv(node2), "phases": [{"prompts": [0]}]})
        out["node2_after"] = node2.status()["namespaces"].get(NAMESPACE, {})
        out["node2_again"] = run_kv_engine(work, "node2_again", {**base, "kv": kv(node2), "phases": [{"prompts": [0]}]})
        yield out
    finally:
        node1.kill()
        node2.kill()


def test_node_one_writes_the_prompt_through_to_the_shared_bucket(two_node_runs: dict[str, Any]) -> None:
    ref = _ok(two_node_runs["baseline"])[0]["tokens"]
    (stored,) = _ok(two_node_runs["node1"])
    assert stored["tokens"] == ref and stored["num_cached_tokens"] == 0
    assert two_node_runs["node1_exit"] == 0
    if two_node_runs["shared_objects"] is not None:
        assert two_node_runs["shared_objects"] >= len(two_node_runs["prompts"][0]) // CHUNK
    assert two_node_runs["node2_before"].get("entries", 0) == 0  # node 2 never saw the prompt


def test_node_two_restores_it_from_the_bucket_and_keeps_it_for_its_next_reader(
    two_node_runs: dict[str, Any],
) -> None:
    base = _ok(two_node_runs["baseline"])[0]
    (first,) = _ok(two_node_runs["node2"])
    assert first["num_cached_tokens"] == expected_hit()
    assert first["tokens"] == base["tokens"]
    chunks = expected_hit() // CHUNK
    assert two_node_runs["node2_after"].get("entries", 0) >= chunks  # now in node 2's pool
    (again,) = _ok(two_node_runs["node2_again"])
    assert again["num_cached_tokens"] == expected_hit()
    assert again["tokens"] == base["tokens"]
    print(
        f"[e2e] two nodes: node 2 run-2 TTFT {first['ttft_s']:.3f} s (from the shared store through its server), "
        f"node-local hit {again['ttft_s']:.3f} s, uncached {base['ttft_s']:.3f} s"
    )
