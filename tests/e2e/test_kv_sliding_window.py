"""A model with full and sliding-window layers: two KV-cache groups through the KV connector.

The tiny float32 Llama with ``layer_types`` alternating full and sliding attention (window 512
tokens): vLLM's hybrid KV-cache manager stays on with ``LMCacheKVConnector`` (it declares
``SupportsHMA``) and keeps two groups, the window layers holding only the blocks inside their
window. Every chunk's record holds both groups' parts. Engines, each in its own process, with
chunked prefill of 1,024 tokens a step (so vLLM drops window blocks while a prompt is saved):

1. ``baseline``: no connector, the hybrid manager off (what vLLM did with a connector that does
   not declare ``SupportsHMA``) — the reference tokens and that KV-cache capacity;
2. ``store``: the connector on a disk directory, hybrid manager on;
3. ``load``: a new process on that directory: prompt 0 restored (tokens equal), then asked again
   without resetting vLLM's prefix cache (vLLM's own hit, the TTFT baseline of the same process);
   then one record of prompt 1 is damaged before its load: that request is recomputed (tokens
   equal, the engine alive, the failure reported by request and counted);
4. ``load_off``: a new process with the hybrid manager off reads the same records (every block
   of a window layer is then held, but the window kernel reads only the window): same tokens;
5. ``block_errors``: the same fault reported by block id (``block_errors_connector``: how the
   connector reported it before) — vLLM's scheduler refuses that with several groups and the
   engine dies. The reproduction the request-level channel fixes.
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
from .kv_engines import CHUNK, PROMPT_LEN, make_prompts, run_kv_engine
from .kv_engines import ok_runs as _ok
from .model_variants import sliding_variant

WINDOW = 512
STEP_TOKENS = 1024
DAMAGED_PROMPT, DAMAGED_CHUNK = 1, 5
CONNECTOR = {"max_local_cpu_size": 0.25, "staging_size": 0.05, "chunk_size": CHUNK, "load_policy": "always"}


def record_file(model_dir: Path, prompt: list[int], chunk: int, root: Path) -> str:
    """The disk path of ``prompt``'s chunk ``chunk`` record."""
    import torch

    from lmcache_async.disk.layout import entry_path, key_digest
    from lmcache_async.metadata import LMCacheEngineMetadata
    from lmcache_async.token_database import ChunkedTokenDatabase

    meta = LMCacheEngineMetadata(model_name=str(model_dir), kv_dtype=torch.float32)
    key = ChunkedTokenDatabase(CHUNK, False, meta).keys(prompt)[chunk]
    return entry_path(str(root), key_digest(key.to_string()))


def damage(path: str) -> None:
    """Flip bytes in the middle of a record's payload (its checksum no longer matches)."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        chunk = bytearray(f.read(64))
        f.seek(-len(chunk), os.SEEK_CUR)
        f.write(bytes(b ^ 0xFF for b in chunk))


def chunk_aligned_hit(prompt_len: int = PROMPT_LEN) -> int:
    """What the connector restores with a sliding-window group: whole chunks below the last token."""
    return (prompt_len - 1) // CHUNK * CHUNK


@pytest.fixture(scope="module")
def swa_runs(kv_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model = sliding_variant(kv_model_dir, WINDOW, KV_MODEL_SIZES["layers"])
    work = tmp_path_factory.mktemp("kv-swa")
    disk = work / "disk"
    prompts = make_prompts(2, vocab=4096, seed=23)
    llm = {"max_num_batched_tokens": STEP_TOKENS}
    base = {"model": str(model), "prompts": prompts, "max_tokens": 16}
    kv = {**CONNECTOR, "local_disk": str(disk), "max_local_disk_size": 1.0}
    out: dict[str, Any] = {"prompts": prompts, "model": model}
    no_hma = {**llm, "disable_hybrid_kv_cache_manager": True}
    out["baseline"] = run_kv_engine(
        work, "baseline", {**base, "kv": None, "llm": no_hma, "phases": [{"prompts": [0, 1]}]}
    )
    out["store"] = run_kv_engine(work, "store", {**base, "kv": kv, "llm": llm, "phases": [{"prompts": [0, 1]}]})
    damaged = record_file(model, prompts[DAMAGED_PROMPT], DAMAGED_CHUNK, disk)
    out["damaged_existed"] = os.path.exists(damaged)
    phases = [
        {"prompts": [0]},
        {"prompts": [0], "keep_prefix": True, "barrier": "own-hit"},
        {"prompts": [DAMAGED_PROMPT], "barrier": "damage"},
    ]
    out["load"] = run_kv_engine(
        work,
        "load",
        {**base, "kv": kv, "llm": llm, "phases": phases},
        barriers={"own-hit": lambda: None, "damage": lambda: damage(damaged)},
    )
    out["load_off"] = run_kv_engine(work, "load_off", {**base, "kv": kv, "llm": no_hma, "phases": [{"prompts": [0]}]})
    other = record_file(model, prompts[0], 3, disk)
    old = {"connector": "BlockErrorsKVConnector", "module": "block_errors_connector"}
    out["block_errors"] = run_kv_engine(
        work,
        "block_errors",
        {**base, **old, "kv": kv, "llm": llm, "phases": [{"prompts": [0], "barrier": "damage"}]},
        barriers={"damage": lambda: damage(other)},
    )
    return out


def test_the_hybrid_manager_stays_on_with_the_connector_and_keeps_the_window_group(swa_runs: dict[str, Any]) -> None:
    for name in ("store", "load"):
        cfg = swa_runs[name]["kv_config"]
        assert cfg["hybrid_manager"], cfg
        assert [g["spec"] for g in cfg["groups"]] == ["FullAttentionSpec", "SlidingWindowSpec"], cfg
        assert cfg["groups"][1]["sliding_window"] == WINDOW
    off = swa_runs["baseline"]["kv_config"]
    assert not off["hybrid_manager"] and len(off["groups"]) == 1
    on = swa_runs["store"]["kv_config"]
    print(
        f"[e2e] KV cache, sliding-window model: hybrid manager on (this connector) {on['num_blocks']} blocks, "
        f"{on['capacity_tokens']} tokens, concurrency {on['max_concurrency']:.2f}x; off {off['num_blocks']} "
        f"blocks, {off['capacity_tokens']} tokens, concurrency {off['max_concurrency']:.2f}x "
        f"(same {on['tensor_bytes']} / {off['tensor_bytes']} bytes)"
    )
    assert on["max_concurrency"] > 1.2 * off["max_concurrency"]


def test_storing_changes_no_token(swa_runs: dict[str, Any]) -> None:
    ref = {r["prompt"]: r["tokens"] for r in _ok(swa_runs["baseline"])}
    for r in _ok(swa_runs["store"]):
        assert r["tokens"] == ref[r["prompt"]]
        assert r["num_cached_tokens"] == 0
    stats = swa_runs["store"]["connector"]
    assert stats["saved_chunks"] == 2 * (PROMPT_LEN // CHUNK) and stats["errors"] == 0
    assert swa_runs["damaged_existed"]


def test_a_new_process_restores_both_groups_with_the_same_tokens(swa_runs: dict[str, Any]) -> None:
    ref = {r["prompt"]: r["tokens"] for r in _ok(swa_runs["baseline"])}
    runs = _ok(swa_runs["load"])
    restored, own = runs[0], runs[1]
    assert restored["prompt"] == 0 and restored["num_cached_tokens"] == chunk_aligned_hit()
    assert restored["tokens"] == ref[0]
    assert own["prompt"] == 0 and own["tokens"] == ref[0] and own["num_cached_tokens"] > 0
    print(
        f"[e2e] sliding-window model, run-2 TTFT: connector {restored['ttft_s']:.3f} s "
        f"({restored['num_cached_tokens']} tokens) vs vLLM's own prefix-cache hit {own['ttft_s']:.3f} s "
        f"({own['num_cached_tokens']} tokens), same process"
    )


def test_a_damaged_record_recomputes_the_request_and_the_engine_lives(swa_runs: dict[str, Any]) -> None:
    ref = {r["prompt"]: r["tokens"] for r in _ok(swa_runs["baseline"])}
    r = [r for r in _ok(swa_runs["load"]) if r["phase"] == "damage"][0]
    assert r["prompt"] == DAMAGED_PROMPT and r["tokens"] == ref[DAMAGED_PROMPT]
    assert r["num_cached_tokens"] == 0  # recomputed whole: no partial restore
    worker, sched = swa_runs["load"]["connector"], swa_runs["load"]["scheduler"]
    assert worker["failed_requests"] == 1 and worker["load_failures"] == 1
    assert sched["loads_failed"] == 1 and sched["loads_refused_after_failure"] >= 1
    assert swa_runs["load"]["alive"]


def test_the_same_fault_reported_by_block_id_would_end_the_engine(swa_runs: dict[str, Any]) -> None:
    """What the request-level channel avoids: vLLM raises on block ids with several groups."""
    old = swa_runs["block_errors"]
    assert not old["alive"] and old["error"] is not None
    assert "not supported for models with multiple KV cache groups" in old["error"] + old.get("traceback", "")


def test_an_engine_with_the_hybrid_manager_off_reads_the_same_records(swa_runs: dict[str, Any]) -> None:
    ref = {r["prompt"]: r["tokens"] for r in _ok(swa_runs["baseline"])}
    (r,) = _ok(swa_runs["load_off"])
    assert not swa_runs["load_off"]["kv_config"]["hybrid_manager"]
    assert r["num_cached_tokens"] == chunk_aligned_hit() and r["tokens"] == ref[0]
