"""Key extras: what besides the token ids enters a chunk key (images, adapters, salts, embeddings).

The membership rules mirror vLLM's block-hash extras; the byte encoding is normative
(docs/formats.md), so golden values pin it across releases.
"""

from __future__ import annotations

import struct
from hashlib import sha256

import pytest
import torch

from lmcache_async import ChunkedTokenDatabase, KeyExtras, LMCacheEngine, LMCacheEngineConfig, MMItem
from lmcache_async.engines.hidden_states import HiddenStateStore
from lmcache_async.metadata import LMCacheEngineMetadata
from lmcache_async.token_database import chain_hashes, tokens_to_int64_bytes

CS = 16
TOKENS = list(range(1000, 1064))  # 4 chunks
DB = ChunkedTokenDatabase(CS)


def hashes(extras: KeyExtras | None = None, tokens: list[int] = TOKENS) -> list[int]:
    return DB.chunk_hashes(tokens, extras)


def shared(a: list[int], b: list[int]) -> int:
    """Chunks whose keys the two prompts share (a prefix, by chaining)."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_no_extras_keeps_the_plain_token_keys_byte_for_byte() -> None:
    plain = chain_hashes(tokens_to_int64_bytes(TOKENS), CS, False)
    assert hashes() == plain
    assert hashes(KeyExtras()) == plain
    assert hashes(KeyExtras(cache_salt="")) == plain  # an empty salt is no salt (as in vLLM)
    h = sha256(b"\x00" * 8)
    h.update(tokens_to_int64_bytes(TOKENS[:CS]))
    assert plain[0] == int.from_bytes(h.digest()[:8], "big")


def test_golden_values_pin_the_encoding() -> None:
    extras = KeyExtras(
        mm_items=(MMItem(20, 8, "img-a"),),
        lora=("adapter", "/models/a"),
        cache_salt="tenant",
        prompt_embeds=torch.arange(64 * 3, dtype=torch.float32).view(64, 3),
    )
    digests = extras.chunk_digests(64, CS)
    assert [d.hex()[:16] if d else None for d in digests] == GOLDEN_DIGESTS
    assert [f"{h:016x}" for h in hashes(extras)] == GOLDEN_HASHES


GOLDEN_DIGESTS = ["2e07078375b75f6f", "7aaacc41d4a92359", "b0c15782b8c4c11c", "7a190e9f71d9903d"]
GOLDEN_HASHES = ["ed86cc826e559d0f", "412f9a3db8062f35", "7cef8d7bfa45aeda", "09013a3adac098cc"]


def test_the_encoding_is_the_documented_one() -> None:
    """docs/formats.md, "Key extras", written out by hand for chunk 1 of a request."""
    embeds = torch.arange(64 * 3, dtype=torch.float32).view(64, 3)
    extras = KeyExtras(mm_items=(MMItem(20, 8, "img-a"),), lora=("ad", "/p"), cache_salt="t", prompt_embeds=embeds)

    def text(s: str) -> bytes:
        return struct.pack("<I", len(s.encode())) + s.encode()

    rows = embeds[16:32].contiguous().numpy().tobytes()
    chunk1 = (
        b"LMCX\x01"
        + b"\x01" + text("ad") + text("/p")
        + b"\x02" + text("img-a") + struct.pack("<q", 20 - 16)
        + b"\x04" + text("float32") + struct.pack("<I", 3) + sha256(rows).digest()
    )  # fmt: skip
    assert extras.chunk_digests(64, CS)[1] == sha256(chunk1).digest()
    prev = hashes(extras)[0].to_bytes(8, "big")
    h = sha256(prev + tokens_to_int64_bytes(TOKENS[CS : 2 * CS]) + sha256(chunk1).digest() + b"LMX1")
    assert hashes(extras)[1] == int.from_bytes(h.digest()[:8], "big")


def test_a_salt_separates_every_chunk_and_equal_salts_share() -> None:
    alice, bob = hashes(KeyExtras(cache_salt="alice")), hashes(KeyExtras(cache_salt="bob"))
    assert shared(alice, hashes()) == 0 and shared(alice, bob) == 0
    assert alice == hashes(KeyExtras(cache_salt="alice"))
    digests = KeyExtras(cache_salt="alice").chunk_digests(64, CS)
    assert digests[0] is not None and digests[1:] == [None, None, None]  # first chunk; the chain carries it


def test_an_image_separates_the_chunks_from_the_one_it_overlaps_on() -> None:
    a = hashes(KeyExtras(mm_items=(MMItem(20, 8, "img-a"),)))
    b = hashes(KeyExtras(mm_items=(MMItem(20, 8, "img-b"),)))
    assert shared(a, b) == 1 and shared(a, hashes()) == 1  # chunk 0 ends before the image
    assert a == hashes(KeyExtras(mm_items=(MMItem(20, 8, "img-a"),)))
    moved = hashes(KeyExtras(mm_items=(MMItem(21, 8, "img-a"),)))
    assert shared(a, moved) == 1  # the same image at another offset is other KV
    spanning = KeyExtras(mm_items=(MMItem(12, 30, "img-a"),)).chunk_digests(64, CS)
    assert [d is not None for d in spanning] == [True, True, True, False]  # every chunk it overlaps


def test_an_adapter_separates_every_chunk() -> None:
    a = hashes(KeyExtras(lora=("a", "/p/a")))
    assert shared(a, hashes()) == 0
    assert shared(a, hashes(KeyExtras(lora=("a", "/p/other")))) == 0  # re-pointed name: other KV
    assert shared(a, hashes(KeyExtras(lora=("b", "/p/a")))) == 0
    assert a == hashes(KeyExtras(lora=("a", "/p/a")))


def test_prompt_embeddings_separate_the_chunks_they_differ_in() -> None:
    e = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    other = e.clone()
    other[40, 1] += 1.0  # chunk 2
    a, b = hashes(KeyExtras(prompt_embeds=e)), hashes(KeyExtras(prompt_embeds=other))
    assert shared(a, b) == 2 and shared(a, hashes()) == 0
    assert a == hashes(KeyExtras(prompt_embeds=e.clone()))
    with pytest.raises(ValueError, match="rows"):
        KeyExtras(prompt_embeds=e[:40]).chunk_digests(64, CS)


def test_bad_extras_name_the_field() -> None:
    with pytest.raises(TypeError, match="extras"):
        DB.chunk_hashes(TOKENS, {"cache_salt": "x"})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="cache_salt"):
        KeyExtras(cache_salt=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="mm_items"):
        KeyExtras(mm_items=("img",))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="length"):
        MMItem(0, 0, "img")
    with pytest.raises(ValueError, match="identifier"):
        MMItem(0, 4, "")
    with pytest.raises(TypeError, match="lora"):
        KeyExtras(lora="a")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prompt_embeds"):
        KeyExtras(prompt_embeds=torch.zeros(4))


def test_mm_items_are_kept_in_order_whatever_order_they_come_in() -> None:
    one = KeyExtras(mm_items=(MMItem(40, 4, "b"), MMItem(2, 4, "a")))
    two = KeyExtras(mm_items=[MMItem(2, 4, "a"), MMItem(40, 4, "b")])  # type: ignore[arg-type]
    assert one == two and hashes(one) == hashes(two)


def _config(**extra: object) -> LMCacheEngineConfig:
    return LMCacheEngineConfig.from_defaults(
        chunk_size=CS, max_local_cpu_size=0.01, enable_hidden_state_cache=True, max_hidden_state_cpu_size=0.01, **extra
    )


def test_the_kv_engine_and_the_hidden_state_store_find_entries_only_under_equal_extras() -> None:
    salt_a, salt_b = KeyExtras(cache_salt="a"), KeyExtras(cache_salt="b")
    kv = torch.randn(2, 2, 64, 8)
    meta = LMCacheEngineMetadata("m", kv_dtype=torch.float32)
    with LMCacheEngine(_config(), meta) as engine:
        assert engine.store(TOKENS, kv, extras=salt_a) == 4
        assert engine.lookup(TOKENS, extras=salt_a) == 64
        assert engine.lookup(TOKENS, extras=salt_b) == 0 and engine.lookup(TOKENS) == 0
        n, got = engine.retrieve(TOKENS, extras=salt_a)
        assert n == 64 and got is not None and torch.equal(got, kv)
        assert engine.retrieve(TOKENS, extras=salt_b) == (0, None)
        hs = engine.hidden_state_store
        assert isinstance(hs, HiddenStateStore)
        rows = torch.randn(64, 8)
        assert hs.store_hidden_states(TOKENS, rows, extras=salt_a) == 4
        out = hs.retrieve_hidden_states(TOKENS, extras=salt_a)
        assert out is not None and torch.equal(out, rows)
        assert hs.retrieve_hidden_states(TOKENS, extras=salt_b) is None
        assert hs.retrieve_hidden_states(TOKENS) is None
        assert hs.coverage(TOKENS, extras=salt_a) == 64 and hs.coverage(TOKENS) == 0


async def test_the_async_twins_take_extras_too() -> None:
    salt = KeyExtras(cache_salt="a")
    meta = LMCacheEngineMetadata("m", kv_dtype=torch.float32)
    async with LMCacheEngine(_config(), meta) as engine:
        kv = torch.randn(2, 2, 64, 8)
        assert await engine.astore(TOKENS, kv, extras=salt) == 4
        assert await engine.alookup(TOKENS, extras=salt) == 64 and await engine.alookup(TOKENS) == 0
        n, _ = await engine.aretrieve(TOKENS, extras=salt)
        assert n == 64
