"""The disk tier with ``encryption_key_file``: records sealed with AES-256-GCM, opened only
under the key that sealed them; another key's records are misses that stay, damaged ones go."""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from lmcache_async import StorageManager
from lmcache_async.disk.tier import DiskBackend
from lmcache_async.encryption import RecordCipher, load_cipher, write_key_file
from lmcache_async.memory import MemoryObj, PoolAllocator
from lmcache_async.records import decode_header, encode_header, payload_checksum
from lmcache_async.testing import PersistentBackendConformanceTests, make_key, make_obj
from lmcache_async.tiers import BackendContext


def _cipher(tmp_path: Path, name: str) -> RecordCipher:
    path = tmp_path / name
    write_key_file(path)
    return load_cipher(path)


class TestSealedDiskConformance(PersistentBackendConformanceTests):
    @pytest.fixture(autouse=True)
    def _key(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self.cipher = _cipher(tmp_path_factory.mktemp("key"), "key")

    async def make_backend(self, ctx: BackendContext, location: Path) -> DiskBackend:
        return DiskBackend(location, 1 << 30, executor=ctx.executor, staging=ctx.staging, cipher=self.cipher)

    async def make_bounded_backend(self, ctx: BackendContext, location: Path, capacity_bytes: int) -> DiskBackend:
        return DiskBackend(location, capacity_bytes, executor=ctx.executor, staging=ctx.staging, cipher=self.cipher)


def _files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*.lmc") if not p.name.startswith(".")]


@pytest.fixture
def src_pool() -> PoolAllocator:
    return PoolAllocator(32 << 20, name="sealed-src", pretouch=False)


async def _open(ctx: BackendContext, root: Path, cipher: RecordCipher | None) -> DiskBackend:
    be = DiskBackend(root, 1 << 30, executor=ctx.executor, staging=ctx.staging, cipher=cipher)
    await be.start()
    return be


def _same(a: MemoryObj, b: MemoryObj) -> bool:
    return bytes(a.byte_view()) == bytes(b.byte_view())


async def test_no_plaintext_of_a_stored_tensor_appears_in_any_file(
    backend_context: Callable[[], BackendContext], tmp_path: Path, src_pool: PoolAllocator
) -> None:
    be = await _open(backend_context(), tmp_path / "d", _cipher(tmp_path, "k"))
    srcs = [make_obj(src_pool, seed=i, shape=(64 << 10,), dtype=torch.float32) for i in range(3)]
    for i, s in enumerate(srcs):
        assert await be.put(make_key(i), s)
    await be.close()
    blobs = [p.read_bytes() for p in _files(tmp_path / "d")]
    assert len(blobs) == 3
    for s in srcs:
        plain = bytes(s.byte_view())
        for blob in blobs:
            for off in range(0, len(plain) - 32, 4096):
                assert plain[off : off + 32] not in blob
        s.ref_count_down()


async def test_a_record_read_under_another_key_file_is_a_miss_and_stays(
    backend_context: Callable[[], BackendContext], tmp_path: Path, src_pool: PoolAllocator
) -> None:
    ctx = backend_context()
    key_a = _cipher(tmp_path, "a")
    writer = await _open(ctx, tmp_path / "d", key_a)
    src = make_obj(src_pool, seed=1, shape=(4096,), dtype=torch.float32)
    assert await writer.put(make_key(1), src)
    await writer.close()
    for cipher in (_cipher(tmp_path, "b"), None):
        reader = await _open(ctx, tmp_path / "d", cipher)
        assert await reader.get(make_key(1)) is None
        assert reader.stats()["foreign_key"] == 1 and reader.stats()["corrupt"] == 0
        await reader.close()
    assert len(_files(tmp_path / "d")) == 1
    again = await _open(ctx, tmp_path / "d", load_cipher(tmp_path / "a"))
    got = await again.get(make_key(1))
    assert got is not None and _same(got, src)
    got.ref_count_down()
    src.ref_count_down()
    await again.close()


@pytest.mark.parametrize("keep_checksum", [False, True])
async def test_a_flipped_byte_is_a_miss_and_the_file_goes(
    backend_context: Callable[[], BackendContext], tmp_path: Path, src_pool: PoolAllocator, keep_checksum: bool
) -> None:
    ctx = backend_context()
    be = await _open(ctx, tmp_path / "d", _cipher(tmp_path, "k"))
    src = make_obj(src_pool, seed=2, shape=(4096,), dtype=torch.float32)
    assert await be.put(make_key(2), src)
    (path,) = _files(tmp_path / "d")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    if keep_checksum:  # only the authentication tag can tell
        hdr = decode_header(bytes(data))
        body = memoryview(data)[hdr.header_len :]
        head = encode_header(hdr.key, hdr.shape, hdr.dtype, hdr.fmt, payload_checksum(body), seal=hdr.seal)
        data = bytearray(head) + data[hdr.header_len :]
    path.write_bytes(bytes(data))
    assert await be.get(make_key(2)) is None
    assert be.stats()["corrupt"] == 1
    assert not path.exists()
    src.ref_count_down()
    await be.close()


async def test_sealed_records_carry_the_key_id_and_verify_without_the_key(
    backend_context: Callable[[], BackendContext], tmp_path: Path, src_pool: PoolAllocator
) -> None:
    cipher = _cipher(tmp_path, "k")
    be = await _open(backend_context(), tmp_path / "d", cipher)
    src = make_obj(src_pool, seed=3, shape=(1000,), dtype=torch.float32)
    assert await be.put(make_key(3), src)
    (path,) = _files(tmp_path / "d")
    data = path.read_bytes()
    hdr = decode_header(data)
    assert hdr.seal is not None and hdr.seal.key_id == cipher.key_id
    assert struct.unpack_from("<H", data, 8)[0] == 2
    assert hdr.plain_len == 4000 and hdr.payload_len == 4016
    assert payload_checksum(data[hdr.header_len :]) == hdr.checksum  # integrity checks need no key
    src.ref_count_down()
    await be.close()


def test_the_manager_seals_its_disk_tier_from_the_key_file(
    make_manager: Callable[..., StorageManager], tmp_path: Path
) -> None:
    key_file = tmp_path / "key"
    write_key_file(key_file)
    sm = make_manager(local_disk=str(tmp_path / "d"), max_local_disk_size=0.05, local_cpu=False,
                      encryption_key_file=str(key_file))  # fmt: skip
    t = torch.randn(64, 64)
    assert sm.put_sync(make_key(5), t)
    sm.flush_sync(30)
    got = sm.get_sync(make_key(5))
    assert got is not None
    with got:
        assert torch.equal(got.tensor, t)
    (path,) = _files(tmp_path / "d")
    assert decode_header(path.read_bytes()).seal is not None


def test_a_key_file_readable_by_its_group_is_refused(
    make_manager: Callable[..., StorageManager], tmp_path: Path
) -> None:
    key_file = tmp_path / "key"
    write_key_file(key_file)
    os.chmod(key_file, 0o640)
    with pytest.raises(ValueError, match="encryption_key_file"):
        make_manager(local_disk=str(tmp_path / "d"), max_local_disk_size=0.05, encryption_key_file=str(key_file))
