"""The shared record-file reader: header, size and payload checks on real files."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lmcache_async.memory import MemoryFormat
from lmcache_async.records import RecordError, encode_header, payload_checksum
from lmcache_async.records.files import payload_problem, publish_noreplace, read_header, verified_header, write_all

KEY = "model@1@0@abc@half"
PAYLOAD = bytes(range(256)) * 64


def _write(path: Path, key: str = KEY, payload: bytes = PAYLOAD, checksum: int | None = None) -> None:
    checksum = payload_checksum(payload) if checksum is None else checksum
    head = encode_header(key, (len(payload),), torch.uint8, MemoryFormat.UNDEFINED, checksum)
    path.write_bytes(head + payload)


@pytest.fixture
def record(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    path = tmp_path / "r.lmc"
    _write(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        yield path, fd
    finally:
        os.close(fd)


def test_a_whole_record_reads_back_with_its_payload(record: tuple[Path, int]) -> None:
    path, fd = record
    hdr = verified_header(fd, path.stat().st_size, KEY)
    assert hdr.key == KEY and hdr.payload_len == len(PAYLOAD)
    view = memoryview(bytearray(hdr.payload_len))
    assert payload_problem(fd, hdr, view) is None
    assert bytes(view) == PAYLOAD


def test_another_keys_record_is_refused(record: tuple[Path, int]) -> None:
    path, fd = record
    with pytest.raises(RecordError):
        verified_header(fd, path.stat().st_size, KEY + "x")
    assert read_header(fd).key == KEY  # without a key to expect, any record's header reads


def test_a_size_that_differs_from_the_header_is_refused(record: tuple[Path, int]) -> None:
    path, fd = record
    size = path.stat().st_size
    with pytest.raises(RecordError, match="truncated"):
        verified_header(fd, size - 1, KEY)
    with pytest.raises(RecordError, match="trailing"):
        verified_header(fd, size + 1, KEY)


def test_a_flipped_payload_byte_is_named(tmp_path: Path) -> None:
    path = tmp_path / "bad.lmc"
    _write(path, checksum=payload_checksum(PAYLOAD) ^ 1)
    fd = os.open(path, os.O_RDONLY)
    try:
        hdr = read_header(fd, KEY)
        assert payload_problem(fd, hdr, memoryview(bytearray(hdr.payload_len))) == "payload checksum mismatch"
    finally:
        os.close(fd)


def test_a_cut_payload_is_named(tmp_path: Path) -> None:
    path = tmp_path / "cut.lmc"
    _write(path)
    os.truncate(path, path.stat().st_size - 10)
    fd = os.open(path, os.O_RDONLY)
    try:
        hdr = read_header(fd, KEY)
        assert payload_problem(fd, hdr, memoryview(bytearray(hdr.payload_len))) == "file is truncated"
    finally:
        os.close(fd)


def test_a_long_key_takes_a_second_header_read(tmp_path: Path) -> None:
    key = "m" * 2000 + "@1@0@abc@half"
    path = tmp_path / "long.lmc"
    _write(path, key=key)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert read_header(fd, key, probe=64).key == key
    finally:
        os.close(fd)


def test_a_probe_outside_its_range_is_a_value_error(record: tuple[Path, int]) -> None:
    with pytest.raises(ValueError, match="probe"):
        read_header(record[1], probe=0)


def test_garbage_is_not_a_record(tmp_path: Path) -> None:
    path = tmp_path / "junk.lmc"
    path.write_bytes(os.urandom(600))
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(RecordError):
            read_header(fd)
    finally:
        os.close(fd)


@pytest.mark.parametrize("link_first", [False, True], ids=["rename", "link"])
def test_publish_never_replaces_a_published_record(tmp_path: Path, link_first: bool) -> None:
    final, first, second = tmp_path / "r.lmc", tmp_path / ".r.1.tmp", tmp_path / ".r.2.tmp"
    first.write_bytes(b"first")
    second.write_bytes(b"second")
    assert publish_noreplace(first, final, link_first=link_first)
    assert not first.exists() and final.read_bytes() == b"first"
    assert not publish_noreplace(second, final, link_first=link_first)
    assert final.read_bytes() == b"first" and second.exists()  # the loser's file is the caller's


def test_write_all_writes_every_buffer_in_order(tmp_path: Path) -> None:
    path = tmp_path / "w"
    parts: list[bytes | memoryview] = [b"head", memoryview(bytearray(b"x" * 100_000)), b"", memoryview(b"tail")]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        write_all(fd, parts)
    finally:
        os.close(fd)
    assert path.read_bytes() == b"head" + b"x" * 100_000 + b"tail"
