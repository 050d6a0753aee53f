"""Encryption at rest on the NIXL tier (``encryption_key_file``, real files through the real
POSIX plugin): no plaintext of a stored tensor in any file; a record under another key (or
none) is a miss and its file stays; a flipped byte is a miss and the record goes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lmcache_async import LMCacheEngineConfig
from lmcache_async.encryption import RecordCipher, load_cipher, write_key_file
from lmcache_async.memory import HeapAllocator, MemoryFormat, MemoryObj
from lmcache_async.nixl.io import RECORD_SUFFIX
from lmcache_async.nixl.tier import NixlBackend, NixlSettings, create
from lmcache_async.records import decode_header, encode_header, payload_checksum
from lmcache_async.testing import PersistentBackendConformanceTests, make_key
from lmcache_async.tiers import BackendContext

pytestmark = pytest.mark.nixl

MiB = 1 << 20
LAYOUTS = [pytest.param(0, id="files"), pytest.param(8, id="slots")]
CHUNK = 1 * MiB


class TestSealedNixlConformance(PersistentBackendConformanceTests):
    """The whole backend contract with every record sealed (files layout; the key file sits
    beside the storage directory, so a reopened backend has the same key)."""

    async def make_backend(self, ctx: BackendContext, location: Path) -> NixlBackend:
        settings = NixlSettings(plugin="POSIX", path=str(location), max_bytes=256 << 20, chunk_bytes=64 << 10)
        return NixlBackend(ctx, settings, cipher=_cipher(location.parent, "conformance.key"))

    async def make_bounded_backend(self, ctx: BackendContext, location: Path, capacity_bytes: int) -> NixlBackend:
        settings = NixlSettings(plugin="POSIX", path=str(location), max_bytes=capacity_bytes, chunk_bytes=64 << 10)
        return NixlBackend(ctx, settings, cipher=_cipher(location.parent, "conformance.key"))


def _cipher(tmp_path: Path, name: str) -> RecordCipher:
    path = tmp_path / name
    if not path.exists():
        write_key_file(path)
    return load_cipher(path)


async def _open(ctx: BackendContext, root: Path, cipher: RecordCipher | None, pool_size: int = 0) -> NixlBackend:
    settings = NixlSettings(plugin="POSIX", path=str(root), pool_size=pool_size, max_bytes=256 * MiB, chunk_bytes=CHUNK)
    be = NixlBackend(ctx, settings, cipher=cipher)
    await be.start()
    return be


def _obj(ctx: BackendContext, fill, nbytes: int, seed: int) -> MemoryObj:
    assert ctx.pool is not None
    return fill(ctx.pool.allocate((nbytes // 4,), torch.float32, MemoryFormat.KV_2LTD), seed)


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.name.endswith(RECORD_SUFFIX))


def _plain_absent(src: MemoryObj, root: Path) -> None:
    plain = bytes(src.byte_view())
    blobs = [p.read_bytes() for p in _files(root)]
    assert blobs
    for off in range(0, len(plain) - 32, 4096):
        run = plain[off : off + 32]
        assert all(run not in b for b in blobs)


def _record_of(be: NixlBackend, key) -> Path:
    entry = be._index[key]
    assert be.root is not None
    if isinstance(entry.location, int):
        return be.root / f"slot-{entry.location:06d}{RECORD_SUFFIX}"
    return be.root / f"{entry.location}{RECORD_SUFFIX}"


@pytest.mark.parametrize("pool_size", LAYOUTS)
@pytest.mark.parametrize("nbytes", [3 * MiB + 12, 4096, 0], ids=["segments", "one-segment", "empty"])
async def test_sealed_records_round_trip_and_the_files_hold_no_plaintext(
    big_context, tmp_path, fill, same_bytes, pool_size, nbytes
) -> None:
    ctx = big_context()
    root = tmp_path / "nixl"
    be = await _open(ctx, root, _cipher(tmp_path, "a"), pool_size)
    src = _obj(ctx, fill, nbytes, 1)
    assert await be.put(make_key(1), src)
    hdr = decode_header(_record_of(be, make_key(1)).read_bytes())
    assert hdr.seal is not None and hdr.seal.segments == max(1, -(-nbytes // CHUNK))
    _plain_absent(src, root)
    for restart in (False, True):
        if restart:  # the index rebuilt from the files
            await be.close()
            be = await _open(ctx, root, _cipher(tmp_path, "a"), pool_size)
        got = await be.get(make_key(1))
        assert got is not None and same_bytes(got, src)
        got.ref_count_down()
        assert be.stats()["sealed"] and be.stats()["corrupt"] == 0 and be.stats()["read_failures"] == 0
    src.ref_count_down()
    await be.close()


async def test_reads_into_unregistered_buffers_and_writes_from_them_round_trip(
    big_context, tmp_path, fill, same_bytes
) -> None:
    ctx = big_context()
    be = await _open(ctx, tmp_path / "nixl", _cipher(tmp_path, "a"))
    heap = HeapAllocator("nixl-sealed-heap")
    src = fill(heap.allocate((5 * MiB,), torch.uint8), 4)
    assert await be.put(make_key(4), src)
    got = await be.get(make_key(4), lambda s, d, f: heap.allocate(s, d, f))
    assert got is not None and same_bytes(got, src)
    got.ref_count_down()
    src.ref_count_down()
    await be.close()


@pytest.mark.parametrize("pool_size", LAYOUTS)
async def test_records_of_another_key_no_key_or_plain_are_foreign_misses_and_kept(
    big_context, tmp_path, fill, same_bytes, pool_size
) -> None:
    ctx = big_context()
    root = tmp_path / "nixl"
    be = await _open(ctx, root, _cipher(tmp_path, "a"), pool_size)
    src = _obj(ctx, fill, 2 * MiB, 2)
    assert await be.put(make_key(2), src)
    path = _record_of(be, make_key(2))
    await be.close()
    for cipher in (_cipher(tmp_path, "b"), None):
        other = await _open(ctx, root, cipher, pool_size)
        assert await other.get(make_key(2)) is None and not await other.contains(make_key(2))
        st = other.stats()
        assert st["foreign_key"] == 1 and st["corrupt"] == 0 and st["reaped"] == 0
        await other.close()
        assert path.exists() and decode_header(path.read_bytes()).seal is not None
    owner = await _open(ctx, root, _cipher(tmp_path, "a"), pool_size)
    got = await owner.get(make_key(2))
    assert got is not None and same_bytes(got, src)
    got.ref_count_down()
    await owner.close()
    plain_root = tmp_path / "plain"
    plain = await _open(ctx, plain_root, None, pool_size)
    assert await plain.put(make_key(3), src)
    await plain.close()
    sealed_reader = await _open(ctx, plain_root, _cipher(tmp_path, "a"), pool_size)
    assert await sealed_reader.get(make_key(3)) is None
    assert sealed_reader.stats()["foreign_key"] == 1
    await sealed_reader.close()
    assert any(decode_header(p.read_bytes()).seal is None for p in _files(plain_root) if p.stat().st_size)
    src.ref_count_down()


@pytest.mark.parametrize("pool_size", LAYOUTS)
@pytest.mark.parametrize("checksum", ["stale", "recomputed"])
async def test_a_flipped_byte_of_a_sealed_record_is_a_miss_and_removed(
    big_context, tmp_path, fill, pool_size, checksum
) -> None:
    """With the payload checksum fixed up, the flip is caught by the tag alone."""
    ctx = big_context()
    be = await _open(ctx, tmp_path / "nixl", _cipher(tmp_path, "a"), pool_size)
    key = make_key(5)
    src = _obj(ctx, fill, 3 * MiB, 5)
    assert await be.put(key, src)
    path = _record_of(be, key)
    data = bytearray(path.read_bytes())
    hdr = decode_header(data)
    end = hdr.header_len + hdr.payload_len
    data[end - 100] ^= 0x01  # in the last segment's ciphertext
    if checksum == "recomputed":
        assert hdr.seal is not None
        head = encode_header(hdr.key, hdr.shape, hdr.dtype, hdr.fmt, payload_checksum(data[hdr.header_len : end]),
                             seal=hdr.seal)  # fmt: skip
        data[: len(head)] = head
    with open(path, "r+b") as f:
        f.write(data)
    assert await be.get(key) is None
    st = be.stats()
    assert st["corrupt"] == 1 and st["foreign_key"] == 0 and st["entries"] == 0
    if not pool_size:
        assert not path.exists()
    src.ref_count_down()
    await be.close()


async def test_the_factory_seals_with_the_key_file_and_refuses_the_object_plugin(big_context, tmp_path) -> None:
    key_file = tmp_path / "k"
    write_key_file(key_file)
    ctx = big_context(LMCacheEngineConfig.from_defaults(nixl_path=str(tmp_path / "n"), nixl_backend="POSIX",
                                                        encryption_key_file=str(key_file)))  # fmt: skip
    be = create(ctx)
    assert be is not None and be.stats()["sealed"]
    await be.close()
    with pytest.raises(ValueError, match="encryption_key_file"):
        NixlBackend(
            big_context(),
            NixlSettings(plugin="OBJ", path="prefix", params={"bucket": "b"}),
            cipher=load_cipher(key_file),
        )
    assert os.path.exists(key_file)
