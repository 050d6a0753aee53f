"""The engines' chunk helpers give exactly the token database's bytes and keys."""

from __future__ import annotations

import struct

import pytest
import torch

from lmcache_async.engines._chunks import ChunkPlan, KeyCache, key_cache
from lmcache_async.token_database import ChunkedTokenDatabase, tokens_to_int64_bytes


@pytest.mark.parametrize(
    "ids",
    [
        [1, 2, 3, -4, 2**40],
        (7, 8, 9),
        [],
        torch.tensor([5, 6, 7], dtype=torch.int32),
        torch.arange(1000, dtype=torch.int64)[::3],
        torch.tensor([], dtype=torch.int64),
    ],
)
def test_token_bytes_are_int64_little_endian(ids):
    vals = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
    assert tokens_to_int64_bytes(ids) == struct.pack(f"<{len(vals)}q", *vals)


@pytest.mark.parametrize(
    "bad,exc",
    [
        (torch.zeros(3), TypeError),
        (torch.zeros(2, 2, dtype=torch.int64), ValueError),
        (torch.ones(3, dtype=torch.bool), TypeError),
        ("abc", TypeError),
    ],
)
def test_token_bytes_reject_what_the_database_rejects(bad, exc):
    with pytest.raises(exc):
        tokens_to_int64_bytes(bad)


@pytest.mark.parametrize("save_unfull", [False, True])
def test_plan_keys_and_spans_match_process_tokens(metadata, save_unfull):
    db = ChunkedTokenDatabase(16, save_unfull_chunk=save_unfull, metadata=metadata)
    ids = torch.randint(0, 1000, (16 * 5 + 3,))
    plan = ChunkPlan(db, ids)
    expected = list(db.process_tokens(ids))
    assert [(plan.start(i), plan.end(i), k) for i, k in enumerate(plan.keys)] == expected
    assert plan.tokens_in(len(plan)) == (expected[-1][1] if expected else 0)
    assert plan.tokens_in(0) == 0


def test_key_cache_is_shared_per_database_and_bounded(metadata):
    db = ChunkedTokenDatabase(16, metadata=metadata)
    assert key_cache(db) is key_cache(db)
    kc = KeyCache(db, capacity=100)
    keys = kc.keys(list(range(250)))
    assert keys == [db.make_key(h) for h in range(250)]
    assert len(kc) <= 100
    again = kc.keys(list(range(200, 250)))
    assert all(a is b for a, b in zip(again, keys[200:], strict=True))  # the newest are still remembered
    kc.clear()
    assert len(kc) == 0
