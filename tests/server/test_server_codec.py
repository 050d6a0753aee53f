"""The wire codec's fast paths decode and check exactly what the plain ones do."""

from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_async.dtypes import DTYPE_TO_CODE
from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import MemoryFormat
from lmcache_async.server.keycheck import checked_key as _checked_key
from lmcache_async.server.protocol import (
    EntryMeta,
    ProtocolError,
    Reader,
    Writer,
    decode_meta,
    encode_keys,
    encode_meta,
)


def _full(raw: bytes) -> bool:
    try:
        CacheEngineKey.from_string(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, TypeError):
        return False
    return True


def _fast(raw: bytes) -> bool:
    try:
        _checked_key(raw)
    except ProtocolError:
        return False
    return True


_BASE = [
    CacheEngineKey("m", 1, 0, 0, torch.bfloat16).to_string().encode(),
    CacheEngineKey("org/model@x%y", 8, 7, (1 << 64) - 1, torch.float16).to_string().encode(),
    CacheEngineKey("m", 2, 1, 0xABC, torch.float32, {"lmcache.tag.user": "a/b", "lmcache.tag.z": "1"})
    .to_string()
    .encode(),
]
_HASH_FIELDS = [b"0", b"00", b"1", b"01", b"ff", b"FF", b"0x1", b"+1", b"1_0", b" 1", b"f" * 16, b"1" + b"0" * 16, b""]


@pytest.mark.parametrize("base", _BASE)
@pytest.mark.parametrize("field", _HASH_FIELDS)
def test_the_key_check_agrees_with_the_full_parse_on_hash_fields(base: bytes, field: bytes) -> None:
    parts = base.split(b"@")
    parts[3] = field
    raw = b"@".join(parts)
    for _ in range(2):  # the second time the template is remembered
        assert _fast(raw) == _full(raw), raw


@settings(max_examples=300, deadline=None)
@given(base=st.sampled_from(_BASE), pos=st.integers(0, 200), new=st.binary(min_size=0, max_size=3))
def test_the_key_check_agrees_with_the_full_parse_on_mutations(base: bytes, pos: int, new: bytes) -> None:
    pos = min(pos, len(base))
    raw = base[:pos] + new + base[pos + len(new) :]
    assert _fast(raw) == _full(raw), raw
    assert _fast(raw) == _full(raw), raw


def test_encode_keys_writes_what_the_writer_writes() -> None:
    keys = [b"a" * 5, b"", b"xyz" * 100]
    assert encode_keys(keys) == Writer().keys(keys).body()
    assert encode_keys(keys, b"\x01") == Writer().u8(1).keys(keys).body()
    assert Reader(encode_keys(keys)).keys() == keys
    body = encode_keys(keys)
    for cut in range(1, len(body)):
        with pytest.raises(ProtocolError):
            r = Reader(body[:cut])
            r.keys()
            r.done()


def test_meta_round_trips_and_bad_records_stay_refused_when_cached() -> None:
    m = EntryMeta.of((4, 8), torch.float16, MemoryFormat.KV_2LTD)
    assert EntryMeta.of((4, 8), torch.float16, MemoryFormat.KV_2LTD) is m
    raw = encode_meta(m)
    assert raw == encode_meta(m)
    for _ in range(2):
        got, pos = decode_meta(raw, 0)
        assert got == m and pos == len(raw)
    head = struct.Struct("<QBBB")
    bad = [
        head.pack(65, int(MemoryFormat.KV_2LTD), DTYPE_TO_CODE[torch.float16], 2) + struct.pack("<2Q", 4, 8),
        head.pack(64, 250, DTYPE_TO_CODE[torch.float16], 2) + struct.pack("<2Q", 4, 8),
        head.pack(64, int(MemoryFormat.KV_2LTD), 250, 2) + struct.pack("<2Q", 4, 8),
        head.pack(64, int(MemoryFormat.KV_2LTD), DTYPE_TO_CODE[torch.float16], 9) + struct.pack("<9Q", *([1] * 9)),
        raw[:-1],
    ]
    for b in bad:
        for _ in range(2):
            with pytest.raises(ProtocolError):
                decode_meta(b, 0)
