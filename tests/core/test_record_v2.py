"""Record format version 2 (docs/formats.md §1): version-1 records stay readable forever,
version 2 adds header sections (the seal, the vLLM provenance); golden bytes pin both."""

from __future__ import annotations

import hashlib
import os
import struct

import pytest
import torch
import xxhash

from lmcache_async.encryption import RecordCipher
from lmcache_async.memory import MemoryFormat
from lmcache_async.records import (
    FLAG_SEALED,
    ForeignSeal,
    RecordError,
    decode_header,
    encode_header,
    header_length,
    payload_checksum,
)
from lmcache_async.records.sections import Provenance, Seal, sealed_length

KEY = "m%2Fx@2@1@ff@bfloat16"
SHAPE = (2, 3, 4)

# Written by version 1 of the format (the code of 2026-12-06), never regenerated.
V1_GOLDEN = bytes.fromhex(
    "894c4d43520d0a1a01000000800000003000000000000000efcdab896745230101000200020003001500000001000000"
    "0000000000000000ff348048726042a30200000000000000030000000000000004000000000000006d25324678403240"
    "314066664062666c6f6174313600000000000000000000000000000000000000"
)
V1_PARTS_GOLDEN = bytes.fromhex(
    "894c4d43520d0a1a01000100800000000a00000000000000070000000000000001000500060001000d00000003000000"
    "0400000000000000d97d3ed9ea669f500a000000000000006b4031403040314075696e74380000000000000000000000"
    "0000000000000000000000000000000000000000000000000000000000000000"
)
# Version 2 (golden: a change here breaks every stored record).
V2_PLAIN_GOLDEN = bytes.fromhex(
    "894c4d43520d0a1a02000000800000003000000000000000efcdab896745230101000200020003001500000001000000"
    "0000000000000000e37354c5d9ab13ad0200000000000000030000000000000004000000000000006d25324678403240"
    "314066664062666c6f6174313600000000000000000000000000000000000000"
)
V2_SEALED_GOLDEN = bytes.fromhex(
    "894c4d43520d0a1a02000200000100004000000000000000efcdab896745230101000200020003001500000001000000"
    "00000000000000002c2f1c1261ea796c0200000000000000030000000000000004000000000000006d25324678403240"
    "314066664062666c6f617431360000000100010030000000000102030405060708090a0b0c0d0e0f0100000001000000"
    "00000000000000006465666768696a6b6c6d6e6f00000000020000004c00000010000000020000000800010020000000"
    "00000000000000000000000901010101010101010202020202020202e3b98a4da31a127d4bde6e43033f66ba274cab0e"
    "b7eb1c70ec41402bf6273dd800000000"
)
GOLDEN_SEAL = Seal(bytes(range(16)), bytes(range(100, 112)), 0, 1)
GOLDEN_PROV = Provenance(
    16, (b"\x01" * 8, b"\x02" * 8), b"\x00" * 7 + b"\x09", None, hashlib.sha256(b"t").digest(), 32, None
)


def _hdr(**kw: object) -> bytes:
    return encode_header(KEY, SHAPE, torch.bfloat16, MemoryFormat.KV_T2D, 0x0123456789ABCDEF, **kw)  # type: ignore[arg-type]


def test_version_1_records_are_read_forever():
    hdr = decode_header(V1_GOLDEN, expect_key=KEY)
    assert (hdr.version, hdr.shape, hdr.dtype, hdr.payload_len, hdr.checksum) == (1, SHAPE, torch.bfloat16, 48,
                                                                                   0x0123456789ABCDEF)  # fmt: skip
    assert hdr.seal is None and hdr.provenance is None
    parts = decode_header(V1_PARTS_GOLDEN)
    assert (parts.version, parts.num_parts, parts.part_size, parts.payload_len) == (1, 3, 4, 10)


def test_a_plain_version_2_header_is_version_1_with_another_version_number():
    assert _hdr() == V2_PLAIN_GOLDEN
    assert len(V2_PLAIN_GOLDEN) == len(V1_GOLDEN) == header_length(len(KEY), 3)
    diff = [i for i in range(len(V1_GOLDEN)) if V1_GOLDEN[i] != V2_PLAIN_GOLDEN[i]]
    assert diff and set(diff) <= {8} | set(range(56, 64))  # the version and the header checksum


def test_sealed_header_with_provenance_matches_the_golden_bytes():
    h = _hdr(seal=GOLDEN_SEAL, provenance=GOLDEN_PROV)
    assert h == V2_SEALED_GOLDEN
    flags, _hlen, plen = struct.unpack_from("<HIQ", h, 10)
    assert flags == FLAG_SEALED and plen == 48 + 16  # the stored payload: ciphertext and one tag
    got = decode_header(h, KEY, key_id=bytes(range(16)))
    assert got.seal == GOLDEN_SEAL and got.provenance == GOLDEN_PROV
    assert got.plain_len == 48 and got.payload_len == 64


def test_sections_start_8_byte_aligned_after_the_key():
    h = V2_SEALED_GOLDEN
    start = -(-(64 + 24 + len(KEY)) // 8) * 8
    assert struct.unpack_from("<HHI", h, start) == (1, 1, 48)  # the seal, critical, 48 bytes
    assert h[start + 8 : start + 24] == bytes(range(16))  # the key id


def test_the_key_id_decides_who_may_open_a_sealed_record():
    h = _hdr(seal=GOLDEN_SEAL)
    decode_header(h, key_id=bytes(range(16)))
    decode_header(h)  # tools that only inspect accept any record
    with pytest.raises(ForeignSeal):
        decode_header(h, key_id=b"\xff" * 16)
    with pytest.raises(ForeignSeal):
        decode_header(h, key_id=None)  # a reader without a key
    with pytest.raises(ForeignSeal):
        decode_header(_hdr(), key_id=bytes(range(16)))  # a reader with a key meets a plain record
    decode_header(_hdr(), key_id=None)


def _patch_section(h: bytes, offset_in_section: int, value: bytes) -> bytes:
    start = -(-(64 + 24 + len(KEY)) // 8) * 8
    b = bytearray(h)
    b[start + offset_in_section : start + offset_in_section + len(value)] = value
    b[56:64] = b"\0" * 8
    struct.pack_into("<Q", b, 56, xxhash.xxh3_64_intdigest(bytes(b)))
    return bytes(b)


def test_an_unknown_critical_section_rejects_the_record_and_an_unknown_other_one_is_skipped():
    h = _hdr(provenance=GOLDEN_PROV)
    with pytest.raises(RecordError, match="critical"):
        decode_header(_patch_section(h, 0, struct.pack("<HH", 9, 1)))
    got = decode_header(_patch_section(h, 0, struct.pack("<HH", 9, 0)))
    assert got.provenance is None


def test_a_seal_flag_without_a_seal_section_is_rejected():
    b = bytearray(_hdr())
    struct.pack_into("<H", b, 10, FLAG_SEALED)
    b[56:64] = b"\0" * 8
    struct.pack_into("<Q", b, 56, xxhash.xxh3_64_intdigest(bytes(b)))
    with pytest.raises(RecordError):
        decode_header(bytes(b))


def test_the_sealed_flag_is_unknown_in_version_1():
    b = bytearray(V1_GOLDEN)
    struct.pack_into("<H", b, 10, FLAG_SEALED)
    b[56:64] = b"\0" * 8
    struct.pack_into("<Q", b, 56, xxhash.xxh3_64_intdigest(bytes(b)))
    with pytest.raises(RecordError):
        decode_header(bytes(b))


def test_a_sealed_record_never_carries_token_ids():
    prov = Provenance(16, (b"\x01" * 32,), None, tuple(range(16)), None)
    assert decode_header(_hdr(provenance=prov)).provenance == prov
    with pytest.raises(ValueError, match="token"):
        _hdr(seal=GOLDEN_SEAL, provenance=prov)


def test_provenance_refuses_mixed_hash_widths_and_missing_tokens():
    with pytest.raises(ValueError):
        Provenance(16, (b"\x01" * 8, b"\x02" * 32), None, None, b"\0" * 32)
    with pytest.raises(ValueError):
        Provenance(16, (b"\x01" * 8,), None, None, None)
    with pytest.raises(ValueError):
        Provenance(0, (b"\x01" * 8,), None, None, b"\0" * 32)


@pytest.mark.parametrize("segment_size", [0, 7, 16, 1000])
def test_sealed_payload_round_trips_and_fails_on_any_flipped_byte(segment_size):
    cipher = RecordCipher(os.urandom(32))
    x = torch.arange(100, dtype=torch.float32)
    plain = x.numpy().data.cast("B")
    seal, stored = cipher.seal("k@1", (100,), torch.float32, MemoryFormat.BINARY, plain, segment_size)
    assert (seal.segments, stored.nbytes) == sealed_length(400, segment_size)
    assert bytes(plain[:64]) not in bytes(stored)
    h = encode_header("k@1", (100,), torch.float32, MemoryFormat.BINARY, payload_checksum(stored), seal=seal)
    hdr = decode_header(h, "k@1", key_id=cipher.key_id)
    out = torch.empty(100)
    cipher.open_into(hdr, stored, out.numpy().data.cast("B"))
    assert torch.equal(out, x)
    for pos in (0, stored.nbytes // 2, stored.nbytes - 1):
        bad = bytearray(stored)
        bad[pos] ^= 1
        with pytest.raises(RecordError, match="tag"):
            cipher.open_into(hdr, memoryview(bad), out.numpy().data.cast("B"))


def test_a_sealed_payload_cannot_be_moved_to_another_key():
    cipher = RecordCipher(os.urandom(32))
    plain = memoryview(bytes(range(64)))
    seal, stored = cipher.seal("a@1", (64,), torch.uint8, MemoryFormat.BINARY, plain)
    h = encode_header("b@1", (64,), torch.uint8, MemoryFormat.BINARY, payload_checksum(stored), seal=seal)
    hdr = decode_header(h, key_id=cipher.key_id)
    with pytest.raises(RecordError):
        cipher.open_into(hdr, stored, memoryview(bytearray(64)))


def test_a_sealed_length_that_does_not_fit_the_segments_is_rejected():
    seal = Seal(bytes(16), bytes(12), 16, 3)  # 48 bytes in 16-byte segments is 3 segments
    decode_header(_hdr(seal=seal))
    with pytest.raises(RecordError, match="segments"):
        decode_header(_hdr(seal=Seal(bytes(16), bytes(12), 16, 4)))
