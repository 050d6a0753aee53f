"""A coverage-guided fuzz target for the record parser (:mod:`lmcache_async.records`) and the
remote tier's record-head parser, run with atheris::

    python tests/chaos/fuzz_records.py -atheris_runs=20000 [CORPUS_DIR ...]

Without a corpus directory it starts from a few valid records written to a temporary one.
The module imports without atheris (``pip install atheris``): :func:`check_record_bytes` is the
oracle, also used by the Hypothesis tests.

Contract checked on every input: the parser raises nothing but
:class:`~lmcache_async.records.RecordError`, and whatever it accepts is self-consistent
(aligned header inside the buffer, payload length equal to the shape times the item size, a
part layout that adds up, a payload that passes :func:`~lmcache_async.records.verify_payload`
only when its length and xxh3 checksum match).

The first input byte steers a few repairs so the fuzzer gets past the cheap checks into the
interesting ones: bit 0 writes the magic and version, bit 1 sets the header-length field to
a plausible value, bit 2 recomputes the header checksum, bit 3 recomputes the payload checksum.
"""

from __future__ import annotations

import os
import struct
import sys
import tempfile
from collections.abc import Sequence

import torch
import xxhash

from lmcache_async.memory import MemoryFormat
from lmcache_async.records import (
    FIXED,
    HEADER_ALIGN,
    MAGIC,
    MAX_HEADER_LEN,
    VERSION,
    RecordError,
    decode_header,
    encode_header,
    peek_header_len,
    verify_payload,
)

__all__ = ["check_record_bytes", "main", "repair", "seed_records"]

_FIX_MAGIC, _FIX_HLEN, _FIX_HSUM, _FIX_PSUM = 1, 2, 4, 8


def repair(flags: int, record: bytes) -> bytes:
    """Apply the repairs selected by ``flags`` (see the module docstring) to ``record``."""
    b = bytearray(record)
    if len(b) < FIXED.size:
        return bytes(b)
    if flags & _FIX_MAGIC:
        b[0:8] = MAGIC
        struct.pack_into("<H", b, 8, VERSION)
    if flags & _FIX_HLEN:
        hlen = max(FIXED.size, min(len(b), MAX_HEADER_LEN) // HEADER_ALIGN * HEADER_ALIGN)
        struct.pack_into("<I", b, 12, hlen)
    hlen = struct.unpack_from("<I", b, 12)[0]
    if flags & _FIX_PSUM and FIXED.size <= hlen <= len(b):
        struct.pack_into("<Q", b, 24, xxhash.xxh3_64_intdigest(bytes(b[hlen:])))
    if flags & _FIX_HSUM and FIXED.size <= hlen <= len(b):
        head = bytearray(b[:hlen])
        head[56:64] = bytes(8)
        struct.pack_into("<Q", b, 56, xxhash.xxh3_64_intdigest(bytes(head)))
    return bytes(b)


def check_record_bytes(data: bytes) -> None:
    """Parse ``data`` as a record; raise ``AssertionError`` (or the unexpected exception) when
    the parser misbehaves. A clean rejection (:class:`RecordError`) is fine."""
    try:
        hlen = peek_header_len(data)
    except RecordError:
        hlen = None
    try:
        hdr = decode_header(data)
    except RecordError:
        _check_remote_head(data)
        return
    assert hlen is not None and hdr.header_len == hlen, "decode accepted what peek rejected"
    assert hdr.header_len % HEADER_ALIGN == 0 and FIXED.size <= hdr.header_len <= min(len(data), MAX_HEADER_LEN)
    n = hdr.dtype.itemsize
    for d in hdr.shape:
        assert d >= 0
        n *= d
    assert n == hdr.payload_len, "payload length differs from shape x itemsize"
    if hdr.num_parts != 1:  # (a single-part record's part-size field is not checked: unused)
        assert hdr.num_parts >= 2 and hdr.part_size > 0
        assert -(-hdr.payload_len // hdr.part_size) == hdr.num_parts
    assert isinstance(hdr.fmt, MemoryFormat) and isinstance(hdr.dtype, torch.dtype)
    assert len(hdr.key.encode("utf-8")) + 8 * len(hdr.shape) + FIXED.size <= hdr.header_len
    payload = memoryview(data)[hdr.header_len :]
    try:
        verify_payload(hdr, payload)
    except RecordError:
        pass
    else:
        assert len(payload) == hdr.payload_len and xxhash.xxh3_64_intdigest(payload) == hdr.checksum
    try:
        decode_header(data, expect_key=hdr.key + "x")
    except RecordError:
        pass
    else:
        raise AssertionError("a record was accepted for another key")
    _check_remote_head(data)


def _check_remote_head(data: bytes) -> None:
    """The remote tier's head parser on the same bytes: only RecordError, consistent lengths."""
    from lmcache_async.remote.codec import MANIFEST_LEN, parse_head
    from lmcache_async.remote.naming import EntryName

    try:
        hdr = decode_header(data)
        key = hdr.key
    except RecordError:
        key = "model@1@0@1@bfloat16"
    name = EntryName(key=key, prefix="fuzz", model="m", digest="0" * 32)
    try:
        got, token = parse_head(data, name)
    except RecordError:
        return
    if token is None:
        assert len(data) == got.header_len + got.payload_len
    else:
        assert got.num_parts >= 2 and len(data) == got.header_len + MANIFEST_LEN and len(token) == MANIFEST_LEN


def one_input(data: bytes) -> None:
    """The fuzz target: byte 0 selects repairs, the rest is the record."""
    if not data:
        return
    check_record_bytes(repair(data[0], data[1:]))


def seed_records() -> list[bytes]:
    """A few valid records (single and multi-part heads, several dtypes and ranks)."""
    out = []
    specs: Sequence[tuple[str, tuple[int, ...], torch.dtype, MemoryFormat]] = [
        ("m@1@0@abc@bfloat16", (2, 2, 4, 8), torch.bfloat16, MemoryFormat.KV_2LTD),
        ("vision%2Fmodel@1@0@1f@float16", (16, 32), torch.float16, MemoryFormat.EC_TD),
        ("m@4@3@ffffffffffffffff@float32@tag%x", (), torch.float32, MemoryFormat.UNDEFINED),
        ("m@1@0@0@uint8", (0,), torch.uint8, MemoryFormat.BINARY),
        ("h@1@0@2@float32", (8, 4), torch.float32, MemoryFormat.HS_TD),
    ]
    for key, shape, dtype, fmt in specs:
        t = torch.arange(max(1, int(torch.tensor(shape).prod().item()) if shape else 1), dtype=torch.float32)
        payload = t[: (int(torch.tensor(shape).prod().item()) if shape else 1)].to(dtype).contiguous()
        raw = payload.view(torch.uint8).reshape(-1).tolist() if payload.numel() else []
        body = bytes(raw)
        head = encode_header(key, shape, dtype, fmt, xxhash.xxh3_64_intdigest(body))
        out.append(head + body)
    big = encode_header("m@1@0@9@uint8", (10,), torch.uint8, MemoryFormat.BINARY, 0, num_parts=3, part_size=4)
    out.append(big + b"0123456789abcdef")
    return out


def main(argv: list[str] | None = None) -> None:
    """Run the fuzzer (``atheris`` must be installed); libFuzzer/atheris flags pass through."""
    try:
        import atheris
    except ImportError:
        sys.exit("atheris is not installed: pip install atheris")
    args = list(sys.argv if argv is None else argv)
    corpus_given = any(not a.startswith("-") for a in args[1:])
    tmp = None
    if not corpus_given:
        tmp = tempfile.TemporaryDirectory(prefix="lmcache-async-fuzz-")
        for i, rec in enumerate(seed_records()):
            with open(os.path.join(tmp.name, f"seed{i}"), "wb") as f:
                f.write(bytes([_FIX_MAGIC | _FIX_HLEN | _FIX_HSUM | _FIX_PSUM]) + rec)
        args.append(tmp.name)
    import lmcache_async.records as records
    import lmcache_async.remote.codec as codec

    for mod, names in (
        (records, ("peek_header_len", "decode_header", "verify_payload", "header_length")),
        (codec, ("parse_head",)),
    ):
        for fn_name in names:
            atheris.instrument_func(getattr(mod, fn_name))
    atheris.instrument_func(check_record_bytes)
    atheris.instrument_func(_check_remote_head)
    atheris.Setup(args, one_input)
    try:
        atheris.Fuzz()
    finally:
        if tmp is not None:
            tmp.cleanup()


if __name__ == "__main__":
    main()
