"""The record format as documented in docs/formats.md: field offsets, little-endian, and a
decoder that rejects any damage."""

from __future__ import annotations

import struct

import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_async.dtypes import DTYPE_TO_CODE
from lmcache_async.memory import MemoryFormat
from lmcache_async.records import (
    MAGIC,
    RecordError,
    decode_header,
    encode_header,
    header_length,
    verify_payload,
)
from lmcache_async.token_database import HASH_SCHEME_ID


def test_fields_sit_where_the_format_document_says():
    key = "m%2Fx@2@1@ff@bfloat16"
    payload = bytes(range(48))
    h = encode_header(key, (2, 3, 4), torch.bfloat16, MemoryFormat.KV_T2D, xxhash.xxh3_64_intdigest(payload))
    assert h[:8] == MAGIC == b"\x89LMCR\r\n\x1a"
    version, flags, hlen, plen, csum = struct.unpack_from("<HHIQQ", h, 8)
    assert (version, flags, hlen, plen) == (2, 0, len(h), 48)
    assert csum == xxhash.xxh3_64_intdigest(payload)
    scheme, fmt, dcode, rank, klen, nparts, psize = struct.unpack_from("<HHHHIIQ", h, 32)
    assert (scheme, fmt, dcode, rank, klen, nparts, psize) == (
        HASH_SCHEME_ID,
        int(MemoryFormat.KV_T2D),
        DTYPE_TO_CODE[torch.bfloat16],
        3,
        len(key),
        1,
        0,
    )
    zeroed = h[:56] + b"\0" * 8 + h[64:]
    assert struct.unpack_from("<Q", h, 56)[0] == xxhash.xxh3_64_intdigest(zeroed)
    assert struct.unpack_from("<3Q", h, 64) == (2, 3, 4)
    assert h[88 : 88 + klen].decode() == key
    assert len(h) % 64 == 0 and len(h) == header_length(klen, 3)
    assert set(h[88 + klen :]) <= {0}


@settings(max_examples=min(60, settings().max_examples), deadline=None)  # fewer under --hypothesis-profile=quick
@given(
    shape=st.lists(st.integers(0, 7), min_size=0, max_size=6).map(tuple),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int8, torch.float64, torch.bool]),
    fmt=st.sampled_from(list(MemoryFormat)),
    key=st.text(min_size=1, max_size=80),
)
def test_round_trip_of_any_rank_dtype_format_and_key(shape, dtype, fmt, key):
    h = encode_header(key, shape, dtype, fmt, 1234)
    got = decode_header(h, expect_key=key)
    n = dtype.itemsize
    for d in shape:
        n *= d
    assert (got.key, got.shape, got.dtype, got.fmt, got.payload_len, got.checksum) == (key, shape, dtype, fmt, n, 1234)
    assert got.total_len == len(h) + n


def test_any_flipped_header_byte_is_rejected():
    h = encode_header("k@1@0@1@half", (4, 4), torch.float16, MemoryFormat.KV_2LTD, 7)
    for i in range(len(h)):
        bad = bytearray(h)
        bad[i] ^= 0x40
        with pytest.raises(RecordError):
            decode_header(bytes(bad), expect_key="k@1@0@1@half")


def test_another_key_unknown_flags_and_short_input_are_rejected():
    h = encode_header("a", (1,), torch.uint8, MemoryFormat.BINARY, 0)
    with pytest.raises(RecordError, match="another key"):
        decode_header(h, expect_key="b")
    with pytest.raises(RecordError):
        decode_header(h[:40])
    bad = bytearray(h)
    struct.pack_into("<H", bad, 10, 0x8000)
    bad[56:64] = b"\0" * 8
    struct.pack_into("<Q", bad, 56, xxhash.xxh3_64_intdigest(bytes(bad)))
    with pytest.raises(RecordError, match="flags"):
        decode_header(bytes(bad))


def test_payload_checks_and_encoder_limits():
    h = decode_header(encode_header("a", (3,), torch.uint8, MemoryFormat.BINARY, xxhash.xxh3_64_intdigest(b"abc")))
    verify_payload(h, b"abc")
    with pytest.raises(RecordError):
        verify_payload(h, b"abd")
    with pytest.raises(RecordError):
        verify_payload(h, b"ab")
    with pytest.raises(ValueError):
        encode_header("a", (-1,), torch.uint8, MemoryFormat.BINARY, 0)
    with pytest.raises(ValueError):
        encode_header("a", (1,) * 33, torch.uint8, MemoryFormat.BINARY, 0)
