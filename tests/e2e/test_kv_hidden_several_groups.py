"""The hidden-state connector with several KV-cache groups: a failure never ends the engine.

The tiny float32 Llama with full and sliding-window layers, and vLLM's ``extract_hidden_states``
(aux layers 0 and 3): vLLM keeps three KV-cache groups — full attention, sliding window, and the
hidden-state layer, whose page (2 × 512 floats a token) differs from an attention layer's, so it
gets blocks of 64 tokens against 128. With more than one group vLLM refuses block-level load
errors (``_handle_invalid_blocks`` raises, and the engine would die); the connector reports a
failed load by request instead. Engines, each in its own process:

1. ``baseline``: no connector, no extraction — the reference tokens;
2. ``store``: ``LMCacheKVHiddenStatesConnector`` on a disk directory;
3. ``load``: a new process on that directory: prompt 0's KV (both attention groups) and hidden
   states come back, tokens equal, hidden-state rows bit-exact; then one published hidden-state
   record of prompt 1 is damaged before its load: the request is recomputed whole (no KV without
   its hidden states, no partial restore), tokens equal, the engine alive, the failure counted;
   and one of prompt 2 is deleted: the lookup sees that part missing, so only the chunks before
   it are offered (a hit needs every part of a chunk).
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

from .conftest import KV_MODEL_SIZES
from .kv_engines import CHUNK, make_prompts, run_kv_engine
from .kv_engines import ok_runs as _ok
from .model_variants import sliding_variant
from .test_kv_hidden_group import AUX_LAYERS, SPECULATIVE, hs_record_file
from .test_kv_sliding_window import WINDOW, chunk_aligned_hit, damage

CONNECTOR = {
    "max_local_cpu_size": 0.25,
    "staging_size": 0.05,
    "chunk_size": CHUNK,
    "enable_hidden_state_cache": True,
    "max_hidden_state_cpu_size": 0.1,
    "load_policy": "always",
}
DAMAGED_PROMPT, MISSING_PROMPT, MISSING_CHUNK = 1, 2, 4


@pytest.fixture(scope="module")
def groups_runs(kv_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model = sliding_variant(kv_model_dir, WINDOW, KV_MODEL_SIZES["layers"])
    work = tmp_path_factory.mktemp("kv-hs-groups")
    disk = work / "disk"
    prompts = make_prompts(3, vocab=4096, seed=31)
    base = {"model": str(model), "prompts": prompts, "max_tokens": 16}
    kv = {**CONNECTOR, "local_disk": str(disk), "max_local_disk_size": 1.0}
    hs = {"connector": "LMCacheKVHiddenStatesConnector", "speculative": SPECULATIVE, "kv": kv}
    out: dict[str, Any] = {"prompts": prompts}
    out["baseline"] = run_kv_engine(work, "baseline", {**base, "kv": None, "phases": [{"prompts": [0, 1, 2]}]})
    store = [{"prompts": [0, 1, 2], "hs_group": True}]
    out["store"] = run_kv_engine(work, "store", {**base, **hs, "phases": store})
    damaged = hs_record_file(model, prompts[DAMAGED_PROMPT], MISSING_CHUNK, AUX_LAYERS[-1], disk)
    missing = hs_record_file(model, prompts[MISSING_PROMPT], MISSING_CHUNK, AUX_LAYERS[0], disk)
    out["parts_existed"] = os.path.exists(damaged) and os.path.exists(missing)
    phases = [
        {"prompts": [0], "hs_group": True},
        {"prompts": [DAMAGED_PROMPT], "barrier": "damage"},
        {"prompts": [MISSING_PROMPT], "barrier": "drop"},
    ]
    faults = {"damage": lambda: damage(damaged), "drop": lambda: os.unlink(missing)}
    out["load"] = run_kv_engine(work, "load", {**base, **hs, "phases": phases}, barriers=faults)
    return out


def test_vllm_keeps_three_groups_and_the_hidden_state_group_has_its_own_block_size(
    groups_runs: dict[str, Any],
) -> None:
    cfg = groups_runs["store"]["kv_config"]
    assert cfg["hybrid_manager"]
    assert [g["spec"] for g in cfg["groups"]] == ["FullAttentionSpec", "SlidingWindowSpec", "HiddenStateCacheSpec"]
    ref = {r["prompt"]: r["tokens"] for r in _ok(groups_runs["baseline"])}
    for r in _ok(groups_runs["store"]):
        assert r["tokens"] == ref[r["prompt"]] and r["num_cached_tokens"] == 0
        assert r["hs_group"]["kind"] == "save"
    assert groups_runs["store"]["connector"]["errors"] == 0
    assert groups_runs["parts_existed"]


def test_a_new_process_restores_every_group_with_the_same_tokens(groups_runs: dict[str, Any]) -> None:
    import torch
    from safetensors.torch import load_file

    ref = {r["prompt"]: r["tokens"] for r in _ok(groups_runs["baseline"])}
    stored = [r for r in _ok(groups_runs["store"]) if r["prompt"] == 0][0]
    loaded = _ok(groups_runs["load"])[0]
    hit = chunk_aligned_hit()
    assert loaded["prompt"] == 0 and loaded["num_cached_tokens"] == hit
    assert loaded["tokens"] == ref[0]
    assert loaded["hs_group"] == {"kind": "load", "start": 0, "end": hit, "shape": [hit, len(AUX_LAYERS), 512]}
    first = load_file(stored["hs_group_path"])["rows"]
    again = load_file(loaded["hs_group_path"])["rows"]
    assert again.abs().sum() > 0
    assert torch.equal(again, first[:hit])


def test_a_damaged_hidden_state_record_recomputes_the_request_and_the_engine_lives(
    groups_runs: dict[str, Any],
) -> None:
    ref = {r["prompt"]: r["tokens"] for r in _ok(groups_runs["baseline"])}
    r = [r for r in _ok(groups_runs["load"]) if r["phase"] == "damage"][0]
    assert r["prompt"] == DAMAGED_PROMPT and r["tokens"] == ref[DAMAGED_PROMPT]
    assert r["num_cached_tokens"] == 0  # the whole request recomputed: no KV without its hidden states
    worker, sched = groups_runs["load"]["connector"], groups_runs["load"]["scheduler"]
    assert worker["hs_short_loads"] == 1 and worker["failed_requests"] == 1
    assert sched["loads_failed"] == 1
    assert groups_runs["load"]["alive"]


def test_a_deleted_hidden_state_record_ends_the_offered_prefix_before_its_chunk(groups_runs: dict[str, Any]) -> None:
    ref = {r["prompt"]: r["tokens"] for r in _ok(groups_runs["baseline"])}
    r = [r for r in _ok(groups_runs["load"]) if r["phase"] == "drop"][0]
    assert r["prompt"] == MISSING_PROMPT and r["tokens"] == ref[MISSING_PROMPT]
    assert r["num_cached_tokens"] == MISSING_CHUNK * CHUNK  # the chunks before the missing part
    assert groups_runs["load"]["connector"]["failed_requests"] == 1  # the damaged one only
