"""The stage-payload record: round trips without pickle, and a reader that trusts nothing."""

from __future__ import annotations

import math
import struct
from typing import Any

import numpy as np
import pytest
import torch

from lmcache_async.integration.omni.codec import (
    CODEC_BYTES,
    CODEC_OMNI,
    CODEC_TREE,
    CorruptPayload,
    decode_record,
    encode_record,
)


def roundtrip(data: object, omni: object = None) -> object:
    enc = encode_record(data, omni)  # type: ignore[arg-type]
    buf = torch.zeros(enc.nbytes, dtype=torch.uint8)
    enc.write_into(buf)
    return decode_record(buf, omni)  # type: ignore[arg-type]


def test_tree_of_tensors_scalars_and_containers_round_trips() -> None:
    data: dict[str, Any] = {
        "hidden": torch.randn(7, 5).to(torch.bfloat16),
        "ids": [1, 2, 3],
        "pair": (1, "a", None, True),
        "nested": {"x": [torch.arange(4, dtype=torch.int64)], "f": 1.5},
        "blob": b"\x00\x01",
        "scalar": torch.tensor(3.0),
        "empty": torch.empty(0, 3),
    }
    out = roundtrip(data)
    assert isinstance(out, dict)
    assert torch.equal(out["hidden"], data["hidden"]) and out["hidden"].dtype == torch.bfloat16
    assert out["ids"] == [1, 2, 3] and out["pair"] == (1, "a", None, True)
    assert torch.equal(out["nested"]["x"][0], data["nested"]["x"][0]) and out["nested"]["f"] == 1.5
    assert out["blob"] == b"\x00\x01"
    assert out["scalar"].shape == () and out["scalar"].item() == 3.0
    assert out["empty"].shape == (0, 3)


def test_dict_with_non_string_or_dollar_keys_round_trips() -> None:
    data = {1: "one", "$t": [0], (1, 2): {"$b": 3}}
    assert roundtrip(data) == data


def test_non_contiguous_tensor_and_nan_survive() -> None:
    t = torch.randn(6, 4).t()
    out = roundtrip({"t": t, "nan": math.nan})
    assert isinstance(out, dict)
    assert torch.equal(out["t"], t) and out["t"].is_contiguous()
    assert math.isnan(out["nan"])


def test_numpy_array_round_trips() -> None:
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    out = roundtrip({"a": arr})
    assert isinstance(out, dict)
    np.testing.assert_array_equal(out["a"], arr)


def test_decoded_tensors_do_not_share_the_record_buffer() -> None:
    enc = encode_record({"t": torch.ones(16)})
    buf = torch.zeros(enc.nbytes, dtype=torch.uint8)
    enc.write_into(buf)
    out = decode_record(buf)
    buf.fill_(0xFF)
    assert torch.equal(out["t"], torch.ones(16))


def test_bytes_payload_uses_the_bytes_codec() -> None:
    enc = encode_record(bytearray(b"abc"))
    assert enc.codec == CODEC_BYTES
    assert roundtrip(memoryview(b"xyz")) == b"xyz"


def test_arbitrary_object_without_omni_serializer_is_a_type_error_naming_data() -> None:
    class Opaque:
        pass

    with pytest.raises(TypeError, match="data"):
        encode_record({"x": Opaque()})


def test_types_the_tree_codec_cannot_carry_fall_back_to_the_omni_serializer() -> None:
    class Opaque:
        pass

    calls: list[object] = []

    def ser(obj: object) -> bytes:
        calls.append(obj)
        return b"omni-bytes"

    def de(mv: memoryview) -> object:
        return ("decoded", bytes(mv))

    codec = (ser, de)
    enc = encode_record({"x": Opaque()}, codec)
    assert enc.codec == CODEC_OMNI and len(calls) == 1
    assert roundtrip({"x": Opaque()}, codec) == ("decoded", b"omni-bytes")
    assert encode_record({"x": 1}, codec).codec == CODEC_TREE


def test_omni_record_without_omni_serializer_is_corrupt_here() -> None:
    enc = encode_record({"x": 1}, (lambda o: b"z", lambda mv: None), prefer_omni=True)
    buf = torch.zeros(enc.nbytes, dtype=torch.uint8)
    enc.write_into(buf)
    with pytest.raises(CorruptPayload, match="Omni"):
        decode_record(buf, None)


def _record(data: object) -> torch.Tensor:
    enc = encode_record(data)
    buf = torch.zeros(enc.nbytes, dtype=torch.uint8)
    enc.write_into(buf)
    return buf


@pytest.mark.parametrize(
    ("offset", "value"),
    [(0, b"XXXX"), (4, b"\x09"), (5, b"\x07"), (8, struct.pack("<I", 1 << 30)), (12, struct.pack("<I", 1 << 30))],
    ids=["magic", "version", "codec", "skeleton-length", "segment-count"],
)
def test_damaged_header_is_corrupt(offset: int, value: bytes) -> None:
    buf = _record({"t": torch.ones(8)})
    buf[offset : offset + len(value)] = torch.frombuffer(bytearray(value), dtype=torch.uint8)
    with pytest.raises(CorruptPayload):
        decode_record(buf)


def test_segment_outside_the_record_is_corrupt() -> None:
    buf = _record({"t": torch.ones(8)})
    buf[24:32] = torch.frombuffer(bytearray(struct.pack("<Q", 1 << 40)), dtype=torch.uint8)  # segment 0 length
    with pytest.raises(CorruptPayload):
        decode_record(buf)


def test_truncated_record_is_corrupt() -> None:
    buf = _record({"t": torch.ones(64)})
    with pytest.raises(CorruptPayload):
        decode_record(buf[: buf.numel() // 2].clone())


def test_tensor_shape_that_disagrees_with_its_segment_is_corrupt() -> None:
    buf = _record({"t": torch.ones(8)})
    raw = bytes(buf.numpy())
    i = raw.index(b"[8]")
    buf[i : i + 3] = torch.frombuffer(bytearray(b"[9]"), dtype=torch.uint8)
    with pytest.raises(CorruptPayload, match="bytes"):
        decode_record(buf)


def test_not_a_record_is_corrupt() -> None:
    with pytest.raises(CorruptPayload):
        decode_record(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(CorruptPayload):
        decode_record(torch.zeros(64, dtype=torch.float32))
