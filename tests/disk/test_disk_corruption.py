"""Damaged files (flipped bytes, truncation, trailing junk, foreign content) are misses, are
deleted and counted, on the read path and on the start-up scan; the budget follows."""

from __future__ import annotations

import asyncio
import os
import random
import shutil

import pytest
import torch

from lmcache_async.memory import MemoryFormat
from lmcache_async.records import encode_header

from .disk_testkit import dir_bytes, entry_files, key, make_entry, path_of, same_bytes

N = 8192
COUNT = 40


def _flip(path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset % len(data)] ^= 0xFF
    path.write_bytes(bytes(data))


def _damage(mode: str, path, other, rng: random.Random) -> None:
    size = path.stat().st_size
    if mode == "flip_payload":
        _flip(path, rng.randrange(size - N, size))
    elif mode == "flip_header":
        _flip(path, rng.randrange(0, size - N))
    elif mode == "flip_magic":
        _flip(path, 0)
    elif mode == "truncate":
        os.truncate(path, rng.randrange(0, size))
    elif mode == "empty":
        os.truncate(path, 0)
    elif mode == "append":
        with open(path, "ab") as f:
            f.write(b"junk")
    elif mode == "foreign_record":  # a valid record of another key at this key's name
        shutil.copyfile(other, path)
    elif mode == "garbage":
        path.write_bytes(os.urandom(size))
    else:  # pragma: no cover
        raise AssertionError(mode)


MODES = ["flip_payload", "flip_header", "flip_magic", "truncate", "empty", "append", "foreign_record", "garbage"]


async def _fill(be, pool) -> None:
    for i in range(COUNT):
        obj = make_entry(pool, i, N)
        assert await be.put(key(i), obj)
        obj.ref_count_down()


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_every_damaged_entry_is_a_miss_removed_and_counted(make_disk, pool, tmp_path, seed):
    rng = random.Random(seed)
    be = await make_disk(tmp_path / "d")
    await _fill(be, pool)
    damaged = rng.sample(range(COUNT), 16)
    for n, i in enumerate(damaged):
        other = path_of(be.root, key((i + 1) % COUNT if (i + 1) % COUNT not in damaged else (i + 2) % COUNT))
        _damage(MODES[n % len(MODES)], path_of(be.root, key(i)), other, rng)
    for i in range(COUNT):
        got = await be.get(key(i))
        if i in damaged:
            assert got is None, (i, MODES[damaged.index(i) % len(MODES)])
            assert not path_of(be.root, key(i)).exists()
        else:
            assert got is not None and same_bytes(got, i, N)
            got.ref_count_down()
    assert be.stats()["corrupt"] == len(damaged)
    assert be.accounted() == (dir_bytes(be.root), COUNT - len(damaged))


async def test_start_up_scan_removes_files_with_damaged_headers(make_disk, pool, tmp_path):
    rng = random.Random(7)
    be = await make_disk(tmp_path / "d")
    await _fill(be, pool)
    await be.close()
    header_modes = ["flip_header", "flip_magic", "truncate", "empty", "append", "foreign_record", "garbage"]
    damaged = list(range(len(header_modes)))
    for n, i in enumerate(damaged):
        _damage(header_modes[n], path_of(be.root, key(i)), path_of(be.root, key(COUNT - 1)), rng)
    again = await make_disk(tmp_path / "d")
    assert again.stats()["corrupt"] == len(damaged)
    assert len(entry_files(again.root)) == COUNT - len(damaged)
    assert again.stats()["entries"] == COUNT - len(damaged)
    assert again.accounted() == (dir_bytes(again.root), COUNT - len(damaged))


async def test_a_record_of_the_wrong_key_is_never_returned(make_disk, pool, tmp_path):
    be = await make_disk(tmp_path / "d")
    await _fill(be, pool)
    # A well-formed record whose header names key 1, stored at key 0's path.
    shutil.copyfile(path_of(be.root, key(1)), path_of(be.root, key(0)))
    assert await be.get(key(0)) is None
    got = await be.get(key(1))
    assert got is not None and same_bytes(got, 1, N)
    got.ref_count_down()


async def test_unknown_files_in_the_directory_are_left_alone(make_disk, pool, tmp_path):
    root = tmp_path / "d"
    (root / "ab").mkdir(parents=True)
    (root / "notes.txt").write_text("mine")
    (root / "ab" / "README").write_text("mine too")
    hdr = encode_header("x", (1,), torch.uint8, MemoryFormat.BINARY, 0)
    (root / "ab" / "record-without-our-name.bin").write_bytes(hdr + b"\0")
    be = await make_disk(root)
    await _fill(be, pool)
    await be.clear()
    assert (root / "notes.txt").exists() and (root / "ab" / "README").exists()
    assert (root / "ab" / "record-without-our-name.bin").exists()
    assert be.stats()["corrupt"] == 0


@pytest.mark.parametrize("seed", [4, 5])
async def test_reads_into_caller_memory_find_the_same_damage(make_disk, pool, tmp_path, seed):
    """``read_into`` (the caller's thread, straight into the caller's scattered memory) checks
    what ``get`` checks: every damaged file is a miss, deleted and counted; a whole one lands
    byte for byte across the pieces."""
    from lmcache_async.read_sinks import ReadSink

    from .disk_testkit import payload

    rng = random.Random(seed)
    be = await make_disk(tmp_path / "d")
    await _fill(be, pool)
    damaged = rng.sample(range(COUNT), len(MODES))
    for n, i in enumerate(damaged):
        other = path_of(be.root, key((i + 1) % COUNT if (i + 1) % COUNT not in damaged else (i + 2) % COUNT))
        _damage(MODES[n], path_of(be.root, key(i)), other, rng)
    for i in range(COUNT):
        dst = torch.zeros(N + 64, dtype=torch.uint8)  # pieces out of order in the buffer
        base = dst.data_ptr()
        sink = ReadSink((N,), torch.uint8, ((base + 64 + N // 2, N // 2), (base, N // 2)))
        hit = await asyncio.to_thread(be.read_into, key(i), sink)
        if i in damaged:
            assert hit is False, (i, MODES[damaged.index(i)])
            assert not path_of(be.root, key(i)).exists()
        else:
            want = payload(i, N)
            assert hit is True
            assert torch.equal(dst[64 + N // 2 : 64 + N], want[: N // 2]) and torch.equal(dst[: N // 2], want[N // 2 :])
    assert be.stats()["corrupt"] == len(damaged)
    wrong = torch.zeros(N // 4, dtype=torch.float32)
    sink = ReadSink((N // 4,), torch.float32, ((wrong.data_ptr(), N),))
    survivor = next(i for i in range(COUNT) if i not in damaged)
    assert await asyncio.to_thread(be.read_into, key(survivor), sink) is False  # another dtype: kept
    assert path_of(be.root, key(survivor)).exists() and be.stats()["read_mismatch"] == 1
