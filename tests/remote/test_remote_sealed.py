"""Encryption at rest on the Redis and fs:// tiers: no plaintext of a stored tensor in any value
or file; a record under another key file is a miss and stays; a flipped byte is a miss and goes."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from lmcache_async.encryption import write_key_file
from lmcache_async.memory import MemoryObj, PoolAllocator
from lmcache_async.records import decode_header, encode_header, payload_checksum
from lmcache_async.remote import RemoteBackend
from lmcache_async.testing import make_key, make_obj
from lmcache_async.testing.servers import RedisServer


@pytest.fixture
def src_pool() -> PoolAllocator:
    return PoolAllocator(32 << 20, name="sealed-remote-src", pretouch=False)


@pytest.fixture
async def open_backend(make_ctx: Any, prefix: str) -> AsyncIterator[Callable[..., Any]]:
    made: list[RemoteBackend] = []

    async def make(url: str, key_file: str | None, part_size: int = 4 << 20) -> RemoteBackend:
        be = RemoteBackend(make_ctx(encryption_key_file=key_file), url, prefix=prefix, part_size=part_size,
                           timeout_s=30.0)  # fmt: skip
        made.append(be)
        await be.start()
        return be

    yield make
    for be in made:
        await be.close()


def key_file(tmp_path: Path, name: str) -> str:
    path = str(tmp_path / name)
    write_key_file(path)
    return path


def _plain_absent(src: MemoryObj, blobs: list[bytes]) -> None:
    plain = bytes(src.byte_view())
    for blob in blobs:
        for off in range(0, len(plain) - 32, 4096):
            assert plain[off : off + 32] not in blob


def _redis_values(srv: RedisServer, prefix: str) -> list[bytes]:
    return [srv.command("GET", k) for k in srv.command("KEYS", f"{prefix}:*")]


def _fs_files(root: str) -> list[Path]:
    return [p for p in Path(root).rglob("*.rec")]


@pytest.mark.parametrize("part_size", [4 << 20, 16 << 10])
async def test_redis_values_hold_no_plaintext_and_other_keys_miss_and_keep_them(
    redis_server: RedisServer, open_backend: Any, src_pool: PoolAllocator, tmp_path: Path, prefix: str,
    part_size: int,
) -> None:  # fmt: skip
    writer = await open_backend(redis_server.url, key_file(tmp_path, "a"), part_size)
    src = make_obj(src_pool, seed=1, shape=(64 << 10,), dtype=torch.float32)
    assert await writer.put(make_key(1), src)
    _plain_absent(src, _redis_values(redis_server, prefix))
    for other in (await open_backend(redis_server.url, key_file(tmp_path, "b"), part_size),
                  await open_backend(redis_server.url, None, part_size)):  # fmt: skip
        assert await other.get(make_key(1)) is None
        assert other.stats()["foreign_key"] == 1 and other.stats()["corrupt"] == 0
    got = await writer.get(make_key(1))
    assert got is not None and bytes(got.byte_view()) == bytes(src.byte_view())
    got.ref_count_down()
    src.ref_count_down()


async def test_a_sealed_redis_value_with_a_flipped_byte_is_a_miss_and_goes(
    redis_server: RedisServer, open_backend: Any, src_pool: PoolAllocator, tmp_path: Path
) -> None:
    be = await open_backend(redis_server.url, key_file(tmp_path, "a"))
    src = make_obj(src_pool, seed=2, shape=(4096,), dtype=torch.float32)
    assert await be.put(make_key(2), src)
    rec = be.entry_name(make_key(2)).record
    data = bytearray(redis_server.command("GET", rec))
    data[-100] ^= 1
    hdr = decode_header(bytes(data))
    body = memoryview(data)[hdr.header_len :]
    head = encode_header(hdr.key, hdr.shape, hdr.dtype, hdr.fmt, payload_checksum(body), seal=hdr.seal)
    redis_server.command("SET", rec, head + bytes(body))  # the checksum holds: only the tag can tell
    assert await be.get(make_key(2)) is None
    assert be.stats()["corrupt"] == 1
    assert redis_server.command("EXISTS", rec) == 0
    src.ref_count_down()


async def test_fs_files_hold_no_plaintext_other_keys_miss_and_flipped_bytes_go(
    open_backend: Any, src_pool: PoolAllocator, tmp_path: Path, fs_root: str
) -> None:
    url = f"fs://{fs_root}"
    writer = await open_backend(url, key_file(tmp_path, "a"))
    src = make_obj(src_pool, seed=3, shape=(64 << 10,), dtype=torch.float32)
    assert await writer.put(make_key(3), src)
    (path,) = _fs_files(fs_root)
    _plain_absent(src, [path.read_bytes()])
    other = await open_backend(url, key_file(tmp_path, "b"))
    assert await other.get(make_key(3)) is None
    assert other.stats()["foreign_key"] == 1 and path.exists()
    assert await other.put(make_key(3), src)  # another key's record at the name stays
    got = await writer.get(make_key(3))  # still the writer's record
    assert got is not None and bytes(got.byte_view()) == bytes(src.byte_view())
    got.ref_count_down()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    assert await writer.get(make_key(3)) is None
    assert writer.stats()["corrupt"] == 1 and not path.exists()
    src.ref_count_down()


async def test_a_connector_that_cannot_seal_is_refused_a_key(make_ctx: Any, tmp_path: Path) -> None:
    from lmcache_async.remote import connector

    class Plain(connector.Connector):
        async def put(self, name: Any, obj: Any) -> bool:
            return True

        async def get(self, name: Any, alloc: Any) -> None:
            return None

        async def exists(self, names: Any) -> list[bool]:
            return [False] * len(names)

        async def remove(self, name: Any) -> bool:
            return False

        async def clear(self, prefix: str) -> None:
            return None

    connector.register_connector("plaintest", lambda url, settings: Plain())
    with pytest.raises(ValueError, match="encryption_key_file"):
        RemoteBackend(make_ctx(encryption_key_file=key_file(tmp_path, "k")), "plaintest://x")
