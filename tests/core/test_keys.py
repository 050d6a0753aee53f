"""Keys: LMCache-shaped string form, exact round trip, stable hashing, chunk hashes."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys

import pytest
import torch

from lmcache_async import CacheEngineKey, ChunkedTokenDatabase, LMCacheEngineMetadata, stable_u64_from_str


def test_string_form_matches_lmcache_shape():
    k = CacheEngineKey("meta-llama", 2, 1, 0xABCDEF, torch.bfloat16)
    assert k.to_string() == "meta-llama@2@1@abcdef@bfloat16"
    assert CacheEngineKey("m", 1, 0, 5, torch.float16).to_string() == "m@1@0@5@half"
    assert CacheEngineKey("m", 1, 0, 5, torch.float32).to_string() == "m@1@0@5@float"


def test_tags_from_request_configs():
    k = CacheEngineKey("m", 1, 0, 1, torch.half, {"lmcache.tag.user": "alice", "other": "x"})
    assert k.to_string() == "m@1@0@1@half@user%alice"
    assert k.tags == (("user", "alice"),)
    assert CacheEngineKey.from_string(k.to_string()) == k


@pytest.mark.parametrize(
    "model",
    [
        "org/model-7b",
        "100%@weird",
        "../../etc/passwd",
        "tab\tand\nnewline",
        "nul\x00byte",
        "del\x7fchar",
        "unicodé-模型-🚀",
        "%41",
        "",
        "x" * 5000,
    ],
)
def test_round_trip_with_odd_model_names(model):
    k = CacheEngineKey(model, 4, 3, (1 << 64) - 1, torch.float8_e4m3fn, {"lmcache.tag.t": "v@/%x"})
    s = k.to_string()
    assert "/" not in s and "\x00" not in s and "\n" not in s
    back = CacheEngineKey.from_string(s)
    assert back == k and hash(back) == hash(k) and back.model_name == model


def test_keys_are_immutable_and_hashable():
    k = CacheEngineKey("m", 1, 0, 1, torch.half)
    with pytest.raises(AttributeError):
        k.model_name = "x"
    assert {k: 1}[CacheEngineKey("m", 1, 0, 1, torch.half)] == 1
    assert k != CacheEngineKey("m", 1, 0, 1, torch.bfloat16)
    assert k != CacheEngineKey("m", 2, 0, 1, torch.half)


@pytest.mark.parametrize(
    ("args", "exc"),
    [
        ((1, 1, 0, 1, torch.half), TypeError),
        (("m", 1, 0, -1, torch.half), ValueError),
        (("m", 1, 0, 1 << 64, torch.half), ValueError),
        (("m", 1, 0, 1, "half"), TypeError),
        (("m", -1, 0, 1, torch.half), ValueError),
        (("m", 1, 0, 1.5, torch.half), TypeError),
        (("bad\udcffsurrogate", 1, 0, 1, torch.half), ValueError),
        (("m", 1, 0, 1, torch.complex64), ValueError),
    ],
)
def test_bad_key_fields_raise(args, exc):
    with pytest.raises(exc):
        CacheEngineKey(*args)


@pytest.mark.parametrize("s", ["a@b", "m@1@0@xyz@half", "m@1@0@1@nodtype", "m@1@0@1@half@notag", "m@01@0@1@half"])
def test_from_string_rejects_malformed(s):
    with pytest.raises(ValueError):
        CacheEngineKey.from_string(s)


def test_stable_u64_is_sha256_prefix_big_endian():
    for s in ["", "abc", "mm-hash-123", "模型"]:
        expected = int.from_bytes(hashlib.sha256(s.encode()).digest()[:8], "big")
        assert stable_u64_from_str(s) == expected


def _reference_chain(tokens: list[int], chunk: int, partial: bool) -> list[int]:
    out, prev = [], 0
    n = len(tokens) if partial else len(tokens) - len(tokens) % chunk
    for start in range(0, n, chunk):
        part = tokens[start : start + chunk]
        data = prev.to_bytes(8, "big") + struct.pack(f"<{len(part)}q", *part)
        prev = int.from_bytes(hashlib.sha256(data).digest()[:8], "big")
        out.append(prev)
    return out


@pytest.mark.parametrize("partial", [False, True])
def test_chunk_hash_equals_spec_formula(partial):
    tokens = [(i * 7919) % 152000 for i in range(1000)]
    db = ChunkedTokenDatabase(256, save_unfull_chunk=partial)
    assert db.chunk_hashes(tokens) == _reference_chain(tokens, 256, partial)
    assert len(db.chunk_hashes(tokens)) == (4 if partial else 3)


def test_chunk_hash_same_for_list_tensor_and_tuple():
    tokens = list(range(600))
    db = ChunkedTokenDatabase(128)
    h = db.chunk_hashes(tokens)
    assert db.chunk_hashes(torch.tensor(tokens, dtype=torch.int32)) == h
    assert db.chunk_hashes(tuple(tokens)) == h


@pytest.mark.slow  # two fresh interpreters, each importing torch
def test_chunk_hashes_equal_across_processes():
    code = (
        "from lmcache_async import ChunkedTokenDatabase;"
        "print(ChunkedTokenDatabase(64, True).chunk_hashes([i*31 % 5000 for i in range(300)]))"
    )
    # Different string-hash seeds: the chunk hashes must not depend on Python's hash().
    children = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        )
        for seed in ("1", "2")
    ]
    outs = set()
    for child in children:
        out, _ = child.communicate(timeout=120)
        assert child.returncode == 0
        outs.add(out)
    assert len(outs) == 1
    assert outs.pop().strip() == str(ChunkedTokenDatabase(64, True).chunk_hashes([i * 31 % 5000 for i in range(300)]))


def test_process_tokens_yields_ranges_and_metadata_keys():
    md = LMCacheEngineMetadata("mdl", world_size=2, worker_id=1, kv_dtype=torch.float16)
    db = ChunkedTokenDatabase(4, save_unfull_chunk=True, metadata=md)
    out = list(db.process_tokens(list(range(10))))
    assert [(s, e) for s, e, _ in out] == [(0, 4), (4, 8), (8, 10)]
    k = out[0][2]
    assert (k.model_name, k.world_size, k.worker_id, k.dtype) == ("mdl", 2, 1, torch.float16)


def test_unfull_tail_dropped_by_default():
    db = ChunkedTokenDatabase(4)
    assert [(s, e) for s, e, _ in db.process_tokens(list(range(10)))] == [(0, 4), (4, 8)]


def test_neutral_identity_without_metadata():
    k = next(iter(ChunkedTokenDatabase(2).process_tokens([1, 2])))[2]
    assert k.model_name == "default" and k.world_size == 1 and k.worker_id == 0


def test_mask_skips_cached_prefix():
    db = ChunkedTokenDatabase(4)
    mask = [False] * 4 + [True] * 6
    assert [(s, e) for s, e, _ in db.process_tokens(list(range(10)), mask=mask)] == [(4, 8)]
    assert [s for s, _, _ in db.process_tokens(list(range(8)), mask=torch.tensor([False] * 4 + [True] * 4))] == [4]


@pytest.mark.parametrize(
    "mask",
    [[False] * 3 + [True] * 5, [True, False] + [True] * 6, [True] * 7],
)
def test_bad_mask_raises(mask):
    with pytest.raises(ValueError):
        list(ChunkedTokenDatabase(4).process_tokens(list(range(8)), mask=mask))


@pytest.mark.parametrize(
    ("tokens", "exc"),
    [
        ("abc", TypeError),
        ([1.5, 2.0], TypeError),
        ([1 << 70], ValueError),
        (torch.zeros(2, 2, dtype=torch.long), ValueError),
        (torch.zeros(4), TypeError),
    ],
)
def test_bad_token_input(tokens, exc):
    with pytest.raises(exc):
        ChunkedTokenDatabase(2).chunk_hashes(tokens)


def test_bad_chunk_size():
    with pytest.raises(ValueError, match="chunk_size"):
        ChunkedTokenDatabase(0)


def test_database_keys_equal_validated_keys():
    md = LMCacheEngineMetadata("mdl", world_size=2, worker_id=1, kv_dtype=torch.float16)
    db = ChunkedTokenDatabase(4, metadata=md)
    for h, k in zip(db.chunk_hashes(list(range(12))), db.keys(list(range(12))), strict=True):
        ref = CacheEngineKey("mdl", 2, 1, h, torch.float16)
        assert k == ref and hash(k) == hash(ref) and k.to_string() == ref.to_string()
        assert CacheEngineKey.from_string(k.to_string()) == k


@pytest.mark.parametrize(
    "fields",
    [
        ("m", 1, 0, 5, torch.bfloat16, None),
        ("org/model 100%", 4, 3, (1 << 64) - 1, torch.float16, {"lmcache.tag.user": "alice", "other": 7}),
        ("m", 2, 1, 9, torch.float32, {"lmcache.tag.hs_layer": "1", "lmcache.tag.z": "q@/%"}),
    ],
)
@pytest.mark.parametrize(("tag", "value"), [("hs_layer", "3"), ("user", "bob@x/%"), ("new", "")])
def test_with_tag_equals_the_constructor(fields, tag, value):
    model, world, worker, chunk, dtype, rc = fields
    key = CacheEngineKey(model, world, worker, chunk, dtype, rc)
    want_rc = dict(key.request_configs or {})
    want_rc["lmcache.tag." + tag] = value
    want = CacheEngineKey(model, world, worker, chunk, dtype, want_rc)
    got = key.with_tag(tag, value)
    assert got == want
    assert hash(got) == hash(want)
    assert got.tags == want.tags
    assert got.to_string() == want.to_string()
    assert CacheEngineKey.from_string(got.to_string()) == got
    assert key.tags == (CacheEngineKey(model, world, worker, chunk, dtype, rc).tags)  # unchanged


@pytest.mark.parametrize(
    ("tag", "value", "exc"),
    [
        ("", "1", ValueError),
        ("a@b", "1", ValueError),
        ("a/b", "1", ValueError),
        ("a%b", "1", ValueError),
        ("a\nb", "1", ValueError),
        ("ok", "lone \ud800 surrogate", ValueError),
        (1, "1", TypeError),
        ("ok", 1, TypeError),
    ],
)
def test_with_tag_checks_the_tag(tag, value, exc):
    key = CacheEngineKey("m", 1, 0, 5, torch.bfloat16)
    with pytest.raises(exc):
        key.with_tag(tag, value)
    with pytest.raises(exc):  # a second time too (checked names are remembered only when valid)
        key.with_tag(tag, value)
