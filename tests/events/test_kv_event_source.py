"""The KV connector's event source: durable saves in, vLLM events out, per tier, whole chunks
parent first, removals leaves first with the same hashes, never AllBlocksCleared."""

from __future__ import annotations

import threading

from events.kv_workload import prompt_of

from lmcache_async.events.wire import AllBlocksCleared, BlockRemoved, BlockStored
from lmcache_async.integration.vllm.kv.events import KVEventSource

TYPES = (BlockStored, BlockRemoved)


def _prompt():
    return prompt_of(tuple(range(1, 1 + 32 * 3)), "adapter-a")


def test_a_durable_save_is_stored_per_tier_with_medium_and_ownership() -> None:
    src = KVEventSource(types=TYPES)
    p = _prompt()
    src.chunk_saved(p.keys[0], p.chunks[0], ["cpu", "disk"])
    evs = src.take_events()
    assert [(e.medium, e.ownership) for e in evs] == [("CPU", "lmcache_async:cpu"), ("STORAGE", "lmcache_async:disk")]
    assert evs[0].block_hashes == list(p.chunks[0].block_hashes) and evs[0].lora_name == "adapter-a"
    assert evs[0].extra_keys == list(p.chunks[0].extra_keys) and evs[0].token_ids == list(p.tokens[:32])
    assert src.take_events() == []


def test_a_chunk_saved_before_its_parent_waits_for_it() -> None:
    src = KVEventSource(types=TYPES)
    p = _prompt()
    src.chunk_saved(p.keys[2], p.chunks[2], ["disk"])
    src.chunk_saved(p.keys[1], p.chunks[1], ["disk"])
    assert src.take_events() == []
    src.chunk_saved(p.keys[0], p.chunks[0], ["disk"])
    assert [e.block_hashes for e in src.take_events()] == [list(c.block_hashes) for c in p.chunks]


def test_a_tier_removal_withdraws_the_subtree_leaves_first_on_that_tier_only() -> None:
    src = KVEventSource(types=TYPES)
    p = _prompt()
    for k, c in zip(p.keys, p.chunks, strict=True):
        src.chunk_saved(k, c, ["cpu", "disk"])
    src.take_events()
    src.tier_removed("disk", [p.keys[1]], "evicted")
    evs = src.take_events()
    assert all(isinstance(e, BlockRemoved) and e.medium == "STORAGE" for e in evs)
    assert [e.block_hashes for e in evs] == [list(p.chunks[2].block_hashes), list(p.chunks[1].block_hashes)]
    assert len(src.advertised("cpu")) == 3 and len(src.advertised("disk")) == 1


def test_unknown_keys_and_tiers_are_ignored_and_nothing_clears_everything() -> None:
    src = KVEventSource(types=TYPES)
    p = _prompt()
    src.tier_removed("disk", [p.keys[0]])
    src.chunk_saved(p.keys[0], p.chunks[0], ["cpu"])
    src.tier_removed("cpu", [b"other"])
    src.tier_removed("cpu", [p.keys[0]])
    evs = src.take_events()
    assert [type(e) for e in evs] == [BlockStored, BlockRemoved]
    assert not any(isinstance(e, AllBlocksCleared) for e in evs)


def test_reports_from_many_threads_keep_the_books_consistent() -> None:
    src = KVEventSource(types=TYPES)
    p = _prompt()

    def churn() -> None:
        for _ in range(500):
            src.chunk_saved(p.keys[0], p.chunks[0], ["cpu"])
            src.tier_removed("cpu", [p.keys[0]])

    threads = [threading.Thread(target=churn) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    evs = src.take_events()
    stored = sum(isinstance(e, BlockStored) for e in evs)
    assert stored - sum(isinstance(e, BlockRemoved) for e in evs) == len(src.advertised("cpu"))


def test_the_pending_list_is_bounded() -> None:
    src = KVEventSource(types=TYPES, max_pending=2)
    p = _prompt()
    src.chunk_saved(p.keys[0], p.chunks[0], ["cpu", "disk", "remote"])
    assert len(src.take_events()) == 2 and src.dropped == 1
