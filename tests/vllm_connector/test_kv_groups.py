"""The KV connector with several KV-cache groups, against vLLM's own spec classes.

vLLM's ``FullAttentionSpec`` / ``SlidingWindowSpec`` / ``MambaSpec`` / ``HiddenStateCacheSpec``
and ``KVCacheConfig`` describe the groups; the connector's halves run over a real
StorageManager (CPU + disk tiers) with the scheduler output given as plain attributes. One record
per chunk holds every attention group as a part; a sliding-window part keeps only the blocks in
the window; failures go by request; groups nothing restores turn the connector off for the model.
"""

from __future__ import annotations

import importlib.util
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed here (`nox -s vllm` runs this test)", allow_module_level=True)

import torch  # noqa: E402

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

from lmcache_async.config import LMCacheEngineConfig  # noqa: E402
from lmcache_async.integration.vllm.kv.connector import LMCacheKVConnector  # noqa: E402
from lmcache_async.integration.vllm.kv.groups import NULL_BLOCK_ID, describe_groups  # noqa: E402
from lmcache_async.integration.vllm.kv.layout import PagedCaches, gather_records, scatter_blocks  # noqa: E402
from lmcache_async.integration.vllm.kv.metadata import BlockRun, KVStepMetadata  # noqa: E402
from lmcache_async.integration.vllm.kv.scheduler import KVSchedulerSide  # noqa: E402
from lmcache_async.integration.vllm.kv.store import KVStore  # noqa: E402
from lmcache_async.integration.vllm.kv.worker import KVWorkerSide  # noqa: E402
from lmcache_async.metadata import LMCacheEngineMetadata  # noqa: E402

BS, BPC = 4, 2
CHUNK = BS * BPC
NB, HEADS, HEAD = 24, 2, 3
WINDOW = 6  # tokens: a window part keeps the blocks of the last 5 tokens before a chunk's end
PROMPT = list(range(200, 240))  # 40 tokens: 5 whole chunks; vLLM computes the last token
META = LMCacheEngineMetadata("tiny-swa", kv_dtype=torch.float32)


def full(bs: int = BS) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=bs, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32)


def window_of(tokens: int, bs: int = BS) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=bs, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32, sliding_window=tokens
    )


def window(bs: int = BS) -> SlidingWindowSpec:
    return window_of(WINDOW, bs)


def kv_config(*groups: tuple[list[str], Any]) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=NB, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec) for names, spec in groups]
    )


SWA = kv_config((["w0", "w2"], window()), (["f1", "f3"], full()))
"""vLLM's group order here puts the window group first; the connector's primary part is full."""


def test_the_kv_connector_declares_hybrid_manager_support() -> None:
    assert supports_hma(LMCacheKVConnector)
    assert callable(LMCacheKVConnector.request_finished_all_groups)


def test_full_and_sliding_groups_are_the_parts_of_one_record_full_first() -> None:
    layout = describe_groups(SWA)
    assert layout.attention == (1, 0) and layout.retained == (None, WINDOW - 1)
    assert layout.several and layout.windowed and not layout.unsupported
    assert layout.block_size == BS
    assert [layout.position(n) for n in ("f1", "w0", "f3", "w2", "other")] == [0, 1, 0, 1, None]


def test_one_group_is_the_plain_layout_and_mamba_state_is_named_unsupported() -> None:
    assert not describe_groups(kv_config((["a", "b"], full()))).several
    mamba = MambaSpec(block_size=BS, shapes=((2, 3),), dtypes=(torch.float32,))
    layout = describe_groups(kv_config((["a"], full()), (["m"], mamba)))
    assert layout.unsupported == ("1:MambaSpec",)
    other_sizes = describe_groups(kv_config((["a"], full(BS)), (["w"], window(2 * BS))))
    assert other_sizes.unsupported and "block sizes" in other_sizes.unsupported[0]


def two_group_caches(seed: int | None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed or 0)
    make = (
        (lambda: torch.zeros(NB, HEADS, BS, 2 * HEAD))
        if seed is None
        else (lambda: torch.randn(NB, HEADS, BS, 2 * HEAD, generator=g))
    )
    return {"f1": make(), "w0": make(), "f3": make(), "w2": make()}


PARTS = [0, 1, 0, 1]  # f1, w0, f3, w2


def test_a_record_part_reads_its_own_groups_blocks_and_null_blocks_are_never_written() -> None:
    src = PagedCaches(two_group_caches(1), BS, BPC, layer_parts=PARTS, null_block=NULL_BLOCK_ID)
    record = torch.zeros(src.record_shape)
    gather_records(src, [[3, 4]], [record], [[[NULL_BLOCK_ID, 7]]])
    dst_tensors = two_group_caches(None)
    dst = PagedCaches(dst_tensors, BS, BPC, layer_parts=PARTS, null_block=NULL_BLOCK_ID)
    scatter_blocks(dst, [10, 11], record, 0, None, [[NULL_BLOCK_ID, 12]])
    for name, part in zip(src.layer_names, PARTS, strict=True):
        a = src.tensors[src.layer_names.index(name)]
        b = dst_tensors[name]
        if part == 0:
            assert torch.equal(b[10], a[3]) and torch.equal(b[11], a[4])
        else:
            assert torch.equal(b[12], a[7])
            assert not b[NULL_BLOCK_ID].any()  # the null block is neither read back nor written


def test_the_block_axis_one_layout_copies_each_part_through_its_own_ids() -> None:
    """CUDA's flash-attention layout ``[2, num_blocks, block_size, heads, head]`` (block axis 1),
    exercised on CPU tensors: index copies per part, null blocks skipped on the way in."""
    from lmcache_async.integration.vllm.kv.layout import FLASH_ATTN_LAYOUT, gather_blocks

    g = torch.Generator().manual_seed(5)
    src_t = {n: torch.randn(2, NB, BS, HEADS, HEAD, generator=g) for n in ("f1", "w0", "f3", "w2")}
    src = PagedCaches(src_t, BS, BPC, FLASH_ATTN_LAYOUT, layer_parts=PARTS, null_block=NULL_BLOCK_ID)
    record = torch.zeros(src.record_shape)
    gather_blocks(src, [3, 4], record, None, [[NULL_BLOCK_ID, 7]])
    dst_t = {n: torch.zeros(2, NB, BS, HEADS, HEAD) for n in src_t}
    dst = PagedCaches(dst_t, BS, BPC, FLASH_ATTN_LAYOUT, layer_parts=PARTS, null_block=NULL_BLOCK_ID)
    scatter_blocks(dst, [10, 11], record, 0, None, [[NULL_BLOCK_ID, 12]])
    for name, part in zip(src.layer_names, PARTS, strict=True):
        if part == 0:
            assert torch.equal(dst_t[name][:, 10], src_t[name][:, 3])
            assert torch.equal(dst_t[name][:, 11], src_t[name][:, 4])
        else:
            assert torch.equal(dst_t[name][:, 12], src_t[name][:, 7])
            assert not dst_t[name][:, NULL_BLOCK_ID].any()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[KVStore]:
    cfg = LMCacheEngineConfig(
        chunk_size=CHUNK,
        max_local_cpu_size=0.01,
        staging_size=0.01,
        local_disk=str(tmp_path / "d"),
        max_local_disk_size=0.1,
    )
    s = KVStore(cfg, META)
    yield s
    s.close()


def vreq(req_id: str) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=req_id,
        prompt_token_ids=PROMPT,
        num_prompt_tokens=len(PROMPT),
        mm_features=[],
        lora_request=None,
        cache_salt=None,
        prompt_embeds=None,
    )


def step(req_id: str, groups: tuple[list[int], ...], computed: int, scheduled: int) -> SimpleNamespace:
    new = SimpleNamespace(req_id=req_id, prompt_token_ids=PROMPT, block_ids=groups, num_computed_tokens=computed)
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set())
    return SimpleNamespace(
        scheduled_new_reqs=[new], scheduled_cached_reqs=cached, num_scheduled_tokens={req_id: scheduled}
    )


WIN_IDS = [NULL_BLOCK_ID, NULL_BLOCK_ID, 13, 14, 15, 16, 17, 18, 19, 20]
FULL_IDS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]


def test_a_save_masks_blocks_before_each_chunks_window_and_skips_chunks_whose_window_is_gone(
    store: KVStore,
) -> None:
    sm = store.storage_manager
    sched = KVSchedulerSide(lambda: sm, store.token_database, BS, BPC, groups=describe_groups(SWA))
    sched.after_alloc(vreq("r"), None, 0)
    meta = sched.build_meta(step("r", (WIN_IDS, FULL_IDS), 8, len(PROMPT) - 8))
    (run,) = meta.saves
    # Chunk 0's window (its blocks 0-1) was dropped by vLLM (null): it is not saved; chunks 1-3 are,
    # each with the blocks holding the WINDOW - 1 tokens before its end (here all of its blocks).
    assert run.first_block == 2 and run.block_ids == tuple(FULL_IDS[2:])
    assert run.group_block_ids == ((13, 14, 15, 16, 17, 18, 19, 20),)
    narrow = kv_config((["w0", "w2"], window_of(2)), (["f1", "f3"], full()))
    masked = KVSchedulerSide(lambda: sm, store.token_database, BS, BPC, groups=describe_groups(narrow))
    masked.after_alloc(vreq("q"), None, 0)
    (one,) = masked.build_meta(step("q", (WIN_IDS, FULL_IDS), 8, len(PROMPT) - 8)).saves
    # A 2-token window keeps only each chunk's last block: the first is null (never saved from).
    assert one.group_block_ids == ((NULL_BLOCK_ID, 14, NULL_BLOCK_ID, 16, NULL_BLOCK_ID, 18, NULL_BLOCK_ID, 20),)


def test_hits_end_on_chunk_boundaries_and_loads_are_asynchronous_by_request(store: KVStore) -> None:
    sm = store.storage_manager
    layout = describe_groups(SWA)
    sched = KVSchedulerSide(lambda: sm, store.token_database, BS, BPC, groups=layout, per_request_failures=True)
    worker = KVWorkerSide(sm, store.token_database, BS, BPC, per_request_failures=True)
    worker.register(two_group_caches(3), layer_parts=PARTS, null_block=NULL_BLOCK_ID)
    ids = (WIN_IDS, FULL_IDS)
    sched.after_alloc(vreq("s"), None, 0)
    meta = sched.build_meta(step("s", ids, 8, len(PROMPT) - 8))
    worker.save(meta)
    sm.flush_sync()
    sched.finished("s")
    n, is_async = sched.num_new_matched_tokens(vreq("t"), 0)
    assert n == 0  # chunk 0 was never saved (its window was gone): no prefix
    assert worker.caches is not None  # registered above
    for c in range(5):  # store every chunk so the prefix is whole
        key = store.token_database.keys(PROMPT)[c]
        if not sm.contains_sync(key):
            sm.put_sync(key, torch.ones(worker.caches.record_shape))
    n, is_async = sched.num_new_matched_tokens(vreq("t"), 0)
    assert n == 32 and is_async  # whole chunks only: a block-aligned cut would offer 36
    missing = store.token_database.keys(PROMPT)[2]
    sched.after_alloc(vreq("t"), ([0, 0, 0, 0, 0, 20, 21, 22], [1, 2, 3, 4, 5, 6, 7, 8]), n)
    load = sched.build_meta(step("t", ([0, 0, 0, 0, 0, 20, 21, 22], [1, 2, 3, 4, 5, 6, 7, 8]), 0, 1))
    (run,) = load.async_loads
    assert run.group_block_ids == ((0, 0, 0, 0, 0, 20, 21, 22),)
    sm.remove_sync(missing)
    worker.load(load)
    deadline = time.monotonic() + 20
    done: set[str] = set()
    while not done and time.monotonic() < deadline:
        done = worker.finished_loads(0.01)
    assert done == {"t"}
    assert worker.take_failed_requests() == {"t"} and worker.take_load_errors() == set()
    sched.after_step(SimpleNamespace(invalid_block_ids=set(), failed_recving={"t"}, finished_recving={"t"}))
    assert sched.num_new_matched_tokens(vreq("t"), 0) == (0, False)  # recomputed, never offered again


def test_groups_nothing_restores_offer_no_tokens_and_save_nothing(store: KVStore) -> None:
    sm = store.storage_manager
    mamba = MambaSpec(block_size=BS, shapes=((2, 3),), dtypes=(torch.float32,))
    layout = describe_groups(kv_config((["a"], full()), (["m"], mamba)))
    sched = KVSchedulerSide(lambda: sm, store.token_database, BS, BPC, groups=layout)
    for key in store.token_database.keys(PROMPT):
        sm.put_sync(key, torch.ones(2, 2))
    assert sched.num_new_matched_tokens(vreq("u"), 0) == (0, False)
    sched.after_alloc(vreq("u"), None, 0)
    meta: KVStepMetadata = sched.build_meta(step("u", ([1, 2, 3, 4, 5, 6, 7, 8, 9], [10]), 0, len(PROMPT)))
    assert meta.saves == [] and sched.disabled == "1:MambaSpec"


def test_a_block_run_carries_and_validates_its_other_parts() -> None:
    run = BlockRun("r", 2, (5, 6, 7), (11, 12), group_block_ids=((0, 9, 10),))
    assert BlockRun.from_dict(run.to_dict()) == run
    assert run.part_ids(2) == [[[5, 6], [0, 9]], [[7], [10]]]
    with pytest.raises(ValueError, match="group_block_ids"):
        BlockRun("r", 0, (1, 2), (3,), group_block_ids=((1,),))


def test_the_connector_warns_once_naming_a_group_it_cannot_restore(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import json
    import logging

    from vllm.config import KVTransferConfig, ModelConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "num_hidden_layers": 2,
                "vocab_size": 256,
                "max_position_embeddings": 512,
                "torch_dtype": "float32",
            }
        )
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        vcfg = VllmConfig(
            model_config=ModelConfig(model=str(tmp_path), skip_tokenizer_init=True, dtype="float32"),
            kv_transfer_config=KVTransferConfig(
                kv_connector="LMCacheKVConnector",
                kv_connector_module_path="lmcache_async.integration.vllm",
                kv_role="kv_both",
                kv_load_failure_policy="recompute",
                kv_connector_extra_config={"chunk_size": 256, "max_local_cpu_size": 0.01, "staging_size": 0.01},
            ),
        )
    mamba = MambaSpec(block_size=int(vcfg.cache_config.block_size), shapes=((2, 3),), dtypes=(torch.float32,))
    kvc = kv_config((["a"], full(int(vcfg.cache_config.block_size))), (["m"], mamba))
    with caplog.at_level(logging.WARNING, logger="lmcache_async"):
        conn = LMCacheKVConnector(vcfg, KVConnectorRole.SCHEDULER, kvc)
    try:
        named = [r for r in caplog.records if "1:MambaSpec" in r.getMessage()]
        assert len(named) == 1
        assert conn.get_num_new_matched_tokens(vreq("z"), 0) == (0, False)
    finally:
        conn.shutdown()


def test_a_model_of_sliding_layers_only_masks_its_one_group_the_same_way(store: KVStore) -> None:
    sm = store.storage_manager
    layout = describe_groups(kv_config((["w0", "w1"], window_of(2))))
    assert not layout.several and layout.windowed
    sched = KVSchedulerSide(lambda: sm, store.token_database, BS, BPC, groups=layout)
    sched.after_alloc(vreq("v"), None, 0)
    (run,) = sched.build_meta(step("v", (WIN_IDS,), 8, len(PROMPT) - 8)).saves
    assert run.first_block == 2 and run.group_block_ids == ()
    assert run.block_ids == (NULL_BLOCK_ID, 14, NULL_BLOCK_ID, 16, NULL_BLOCK_ID, 18, NULL_BLOCK_ID, 20)
    assert sched.num_new_matched_tokens(vreq("w"), 0) == (0, False)  # nothing stored yet


def test_record_layers_keep_model_order_whatever_order_the_groups_hand_them() -> None:
    from lmcache_async.integration.vllm.kv.connector import model_order

    handed = ["model.layers.0.attn", "model.layers.2.attn", "model.layers.10.attn", "model.layers.1.attn"]
    assert sorted(handed, key=model_order) == [
        "model.layers.0.attn",
        "model.layers.1.attn",
        "model.layers.2.attn",
        "model.layers.10.attn",
    ]
