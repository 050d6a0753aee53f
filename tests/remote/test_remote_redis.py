"""Redis/Valkey/Cluster specifics: atomic parts, namespaces, TTL, corruption, cancellation,
round trips, large entries and authentication. Real servers only. Failures of the server and
sharing between managers are tested in test_remote_redis_failures.py."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
import torch
from redis.exceptions import RedisError

from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import HeapAllocator, MemoryObj, PoolAllocator
from lmcache_async.remote import RemoteBackend
from lmcache_async.testing import make_key, make_obj
from lmcache_async.testing.servers import RedisClusterServers, RedisServer

from .redis_support import keys_under, same


# ---- layout, atomic parts, namespaces ---------------------------------------------------------------
async def test_multipart_entry_is_one_record_plus_its_parts(
    redis_server: RedisServer, open_backend: Any, src_pool: PoolAllocator, prefix: str
) -> None:
    be = await open_backend(redis_server.url, part_size=64 << 10)
    src = make_obj(src_pool, (1000, 100), torch.float32, seed=1)  # 400,000 bytes -> 7 parts
    assert await be.put(make_key(1), src)
    names = keys_under(redis_server, prefix)
    record = be.entry_name(make_key(1)).record.encode()
    assert record in names
    assert len(names) == 1 + 7
    assert all(n.startswith(record + b":") for n in names if n != record)
    assert await be.remove(make_key(1))
    assert keys_under(redis_server, prefix) == []
    src.ref_count_down()


async def test_reader_never_sees_a_partial_multipart_entry(
    redis_server: RedisServer, open_backend: Any, src_pool: PoolAllocator
) -> None:
    writer = await open_backend(redis_server.url, part_size=32 << 10)
    reader = await open_backend(redis_server.url, part_size=32 << 10)
    objs = [make_obj(src_pool, (256, 1024), torch.float32, seed=i) for i in range(8)]  # 1 MiB each
    keys = [make_key(50 + i) for i in range(8)]
    seen_hits = 0

    async def read_loop() -> None:
        nonlocal seen_hits
        for _ in range(200):
            for k, o in zip(keys, objs, strict=True):
                got = await reader.get(k)
                if got is not None:
                    assert same(got, o)
                    got.ref_count_down()
                    seen_hits += 1
            if seen_hits >= 4 * len(keys):
                return

    async def write_all() -> None:
        for k, o in zip(keys, objs, strict=True):
            assert await writer.put(k, o)
            await asyncio.sleep(0)

    await asyncio.gather(read_loop(), write_all())
    assert reader.stats()["corrupt"] == 0 and reader.stats()["vanished"] == 0
    for o in objs:
        o.ref_count_down()


async def test_concurrent_writers_of_one_key_leave_one_entry_and_no_orphans(
    redis_server: RedisServer, open_backend: Any, src_pool: PoolAllocator, prefix: str
) -> None:
    bes = [await open_backend(redis_server.url, part_size=16 << 10) for _ in range(4)]
    objs = [make_obj(src_pool, (64, 1024), torch.float32, seed=i) for i in range(4)]  # 16 parts
    key = make_key(7)
    assert all(await asyncio.gather(*(be.put(key, o) for be, o in zip(bes, objs, strict=True))))
    got = await bes[0].get(key)
    assert got is not None and any(same(got, o) for o in objs)
    got.ref_count_down()
    assert len(keys_under(redis_server, prefix)) == 1 + 16
    for o in objs:
        o.ref_count_down()


async def test_prefixes_isolate_deployments_on_one_server(
    redis_server: RedisServer, open_backend: Any, src_pool: PoolAllocator, prefix: str
) -> None:
    a = await open_backend(redis_server.url, prefix=prefix + "-a")
    b = await open_backend(redis_server.url, prefix=prefix + "-b")
    src = make_obj(src_pool, seed=3)
    key = make_key(3)
    assert await a.put(key, src)
    assert await a.contains(key)
    assert not await b.contains(key)
    assert await b.get(key) is None
    await b.clear()
    assert await a.contains(key)
    src.ref_count_down()


async def test_keys_carry_prefix_and_percent_encoded_model(
    redis_server: RedisServer, open_backend: Any, src_pool: PoolAllocator, prefix: str
) -> None:
    be = await open_backend(redis_server.url)
    src = make_obj(src_pool, (4, 4), seed=4)
    assert await be.put(make_key(4, model="org/model:{x}"), src)
    (name,) = keys_under(redis_server, prefix)
    assert name.startswith(f"{prefix}:org%2Fmodel%3A%7Bx%7D:{{".encode())
    src.ref_count_down()


async def test_ttl_applies_to_record_and_parts(
    redis_server: RedisServer, open_backend: Any, src_pool: PoolAllocator, prefix: str
) -> None:
    be = await open_backend(redis_server.url, part_size=16 << 10, ttl_s=300.0)
    src = make_obj(src_pool, (64, 256), torch.float32, seed=5)  # 4 parts
    assert await be.put(make_key(5), src)
    names = keys_under(redis_server, prefix)
    assert len(names) == 5
    for n in names:
        assert 0 < redis_server.command("PTTL", n) <= 300_000
    src.ref_count_down()


# ---- bad records --------------------------------------------------------------------------------------
async def _stored(be: Any, src_pool: PoolAllocator, i: int) -> tuple[CacheEngineKey, str, MemoryObj]:
    """Entry ``i`` put into ``be``: its key, the name of its record and its source (the caller
    releases it)."""
    src = make_obj(src_pool, seed=i)
    key = make_key(i)
    assert await be.put(key, src)
    return key, be.entry_name(key).record, src


async def test_corrupt_payload_is_a_counted_miss_and_removed(
    redis_server: RedisServer, open_backend: Any, src_pool: PoolAllocator
) -> None:
    be = await open_backend(redis_server.url)
    key, record, src = await _stored(be, src_pool, 6)
    size = redis_server.command("STRLEN", record)
    redis_server.command("SETRANGE", record, size - 10, b"\xff\x00\xff")
    assert await be.get(key) is None
    assert be.stats()["corrupt"] == 1
    assert redis_server.command("EXISTS", record) == 0
    src.ref_count_down()


async def test_truncated_record_is_a_counted_miss(
    redis_server: RedisServer, open_backend: Any, src_pool: PoolAllocator
) -> None:
    be = await open_backend(redis_server.url)
    key, record, src = await _stored(be, src_pool, 6)
    value = redis_server.command("GET", record)
    redis_server.command("SET", record, value[: len(value) // 2])
    assert await be.get(key) is None
    assert be.stats()["corrupt"] == 1
    src.ref_count_down()


async def test_record_of_another_key_is_a_miss_and_kept(
    redis_server: RedisServer, open_backend: Any, src_pool: PoolAllocator
) -> None:
    be = await open_backend(redis_server.url)
    src = make_obj(src_pool, seed=8)
    await be.put(make_key(8), src)
    a, b = be.entry_name(make_key(8)).record, be.entry_name(make_key(9)).record
    redis_server.command("SET", b, redis_server.command("GET", a))  # as if the digests collided
    assert await be.get(make_key(9)) is None
    assert await be.remove(make_key(9)) is False
    assert be.stats()["foreign"] == 1
    assert redis_server.command("EXISTS", b) == 1
    src.ref_count_down()


async def test_missing_part_is_a_miss_and_the_entry_is_cleaned_up(
    redis_server: RedisServer, open_backend: Any, src_pool: PoolAllocator, prefix: str
) -> None:
    be = await open_backend(redis_server.url, part_size=16 << 10)
    src = make_obj(src_pool, (64, 256), torch.float32, seed=9)
    key = make_key(9)
    await be.put(key, src)
    record = be.entry_name(key).record.encode()
    part = next(n for n in keys_under(redis_server, prefix) if n != record)
    redis_server.command("UNLINK", part)  # e.g. evicted by maxmemory
    assert await be.get(key) is None
    assert be.stats()["vanished"] == 1
    assert keys_under(redis_server, prefix) == []
    assert not await be.contains(key)
    src.ref_count_down()


# ---- a request executed but its reply lost ----------------------------------------------------------
class ReplyCuttingProxy:
    """A loopback TCP proxy in front of a real server. Once :meth:`arm` is called, the next
    connection that sends a ``MULTI`` gets its whole request forwarded and executed by the
    server, and is then cut before any byte of the replies reaches the client."""

    MULTI = b"*1\r\n$5\r\nMULTI\r\n"
    EXEC = b"*1\r\n$4\r\nEXEC\r\n"

    def __init__(self, host: str, port: int) -> None:
        self._target = (host, port)
        self._armed = False
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []
        self.cut = 0
        self.port = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def arm(self) -> None:
        self._armed = True

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()
        for w in self._writers:
            w.transport.abort()
        for t in list(self._handlers):
            t.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        for _ in range(2):  # aborted transports finish closing in a loop callback
            await asyncio.sleep(0)

    async def _accept(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        self._writers.append(cwriter)
        try:
            sreader, swriter = await asyncio.open_connection(*self._target)
            self._writers.append(swriter)
            doomed = asyncio.Event()
            executed = asyncio.Event()

            async def upstream() -> None:
                tail = b""
                while data := await creader.read(1 << 16):
                    seen = tail + data
                    if self._armed and self.MULTI in seen:
                        self._armed = False
                        doomed.set()  # before the server can answer anything of it
                    swriter.write(data)
                    if doomed.is_set() and self.EXEC in seen:
                        swriter.write(b"*1\r\n$4\r\nPING\r\n")  # its reply marks the end
                        executed.set()
                    await swriter.drain()
                    tail = seen[-16:]
                swriter.close()

            async def downstream() -> None:
                held = b""
                while data := await sreader.read(1 << 16):
                    if not doomed.is_set():
                        cwriter.write(data)
                        await cwriter.drain()
                        continue
                    held = (held + data)[-16:]
                    if executed.is_set() and held.endswith(b"+PONG\r\n"):
                        self.cut += 1
                        cwriter.transport.abort()  # executed; the replies never arrive
                        swriter.transport.abort()
                        return
                cwriter.close()

            await asyncio.gather(upstream(), downstream(), return_exceptions=True)
        finally:
            self._handlers.discard(task)


async def test_retried_multipart_put_keeps_the_parts_of_its_own_record(
    redis_server: RedisServer, open_backend: Any, src_pool: PoolAllocator, prefix: str
) -> None:
    proxy = ReplyCuttingProxy(redis_server.host, redis_server.port)
    await proxy.start()
    try:
        be = await open_backend(f"redis://127.0.0.1:{proxy.port}", part_size=64 << 10)
        src = make_obj(src_pool, (1000, 100), torch.float32, seed=11)  # 7 parts
        key = make_key(11)
        proxy.arm()
        # EXISTS on the pooled connection, then MULTI..EXEC: executed, its reply cut; the
        # retry's SET NX finds the record the first try published.
        assert await be.put(key, src)
        assert proxy.cut == 1
        assert len(keys_under(redis_server, prefix)) == 1 + 7  # the record and all its parts
        got = await be.get(key)
        assert got is not None and same(got, src)
        got.ref_count_down()
        st = be.stats()
        assert st["retries"] == 1 and st["lost_races"] == 0 and st["replayed_puts"] == 1
        assert st["vanished"] == 0
        src.ref_count_down()
    finally:
        await proxy.close()


# ---- cancellation -----------------------------------------------------------------------------------
async def test_cancelled_gets_leave_no_half_read_reply_on_pooled_connections(
    redis_server: RedisServer, open_backend: Any, src_pool: PoolAllocator
) -> None:
    be = await open_backend(redis_server.url + "?max_connections=4", part_size=128 << 10)
    objs = [make_obj(src_pool, (256 * (1 + i % 4), 256), torch.float32, seed=i) for i in range(12)]
    keys = [make_key(600 + i) for i in range(12)]
    assert all(await be.batched_put(list(zip(keys, objs, strict=True))))
    rng = random.Random(1)
    for _ in range(60):
        tasks = [asyncio.create_task(be.get(k)) for k in keys]
        await asyncio.sleep(rng.uniform(0, 0.004))
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for t, o in zip(tasks, objs, strict=True):
            if t.cancelled():
                continue
            got = t.result()  # raises what the get raised: nothing may fail here
            if got is not None:
                assert same(got, o)
                got.ref_count_down()
        if be.stats()["connections_dropped"] >= 5:
            break
    assert be.stats()["connections_dropped"] > 0, "no command was cancelled mid-flight"
    # Every following reply belongs to its own request.
    for _ in range(3):
        got = await asyncio.gather(*(be.get(k) for k in keys))
        for g, o in zip(got, objs, strict=True):
            assert g is not None and same(g, o)
            g.ref_count_down()
    flags = await be.batched_contains(keys + [make_key(999)])
    assert flags == [True] * 12 + [False]
    for o in objs:
        o.ref_count_down()


async def test_cancelled_puts_publish_whole_entries_or_nothing(
    redis_server: RedisServer, open_backend: Any, src_pool: PoolAllocator, prefix: str
) -> None:
    be = await open_backend(redis_server.url, part_size=64 << 10)
    objs = [make_obj(src_pool, (512, 256), torch.float32, seed=i) for i in range(10)]  # 512 KiB
    keys = [make_key(700 + i) for i in range(10)]
    rng = random.Random(2)
    for _round in range(5):
        tasks = [asyncio.create_task(be.put(k, o)) for k, o in zip(keys, objs, strict=True)]
        await asyncio.sleep(rng.uniform(0, 0.01))
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for k, o in zip(keys, objs, strict=True):
            got = await be.get(k)
            if got is not None:
                assert same(got, o)
                got.ref_count_down()
        await be.clear()
    assert be.stats()["corrupt"] == 0 and be.stats()["vanished"] == 0
    assert keys_under(redis_server, prefix) == []
    for o in objs:
        o.ref_count_down()


# ---- round trips --------------------------------------------------------------------------------------
async def test_batched_contains_of_256_keys_is_one_round_trip(
    redis_server: RedisServer, open_backend: Any, src_pool: PoolAllocator
) -> None:
    be = await open_backend(redis_server.url)
    keys = [make_key(1000 + i) for i in range(256)]
    src = make_obj(src_pool, (4, 4), seed=1)
    for k in keys[:100]:
        await be.put(k, src)
    before = be.stats()["round_trips"]
    flags = await be.batched_contains(keys)
    assert be.stats()["round_trips"] - before == 1
    assert flags == [True] * 100 + [False] * 156
    src.ref_count_down()


async def test_cluster_batched_contains_is_one_round_trip_per_node(
    redis_cluster: RedisClusterServers, open_backend: Any, src_pool: PoolAllocator, prefix: str
) -> None:
    be = await open_backend(redis_cluster.url)
    keys = [make_key(2000 + i) for i in range(256)]
    src = make_obj(src_pool, (4, 4), seed=1)
    for k in keys[::3]:
        await be.put(k, src)
    before = be.stats()["round_trips"]
    flags = await be.batched_contains(keys)
    assert be.stats()["round_trips"] - before == len(redis_cluster.nodes)
    assert flags == [i % 3 == 0 for i in range(256)]
    per_node = [len(n.command("KEYS", f"{prefix}:*")) for n in redis_cluster.nodes]
    assert sum(per_node) == len(keys[::3]) and min(per_node) > 0  # spread over every node
    src.ref_count_down()


# ---- large entries ----------------------------------------------------------------------------------
async def test_64mib_entry_round_trips_exactly(redis_server: RedisServer, open_backend: Any) -> None:
    be = await open_backend(redis_server.url)
    heap = HeapAllocator("big")
    src = heap.allocate((64 << 20,), torch.uint8)
    src.tensor.random_(0, 256, generator=torch.Generator().manual_seed(64))
    key = make_key(64)
    assert await be.put(key, src)
    got = await be.get(key, lambda s, d, f: heap.allocate(s, d, f))
    assert got is not None
    assert torch.equal(got.tensor, src.tensor)
    got.ref_count_down()
    src.ref_count_down()


# ---- authentication -------------------------------------------------------------------------------
async def test_acl_user_and_password_come_from_the_url(
    acl_server: RedisServer, open_backend: Any, src_pool: PoolAllocator
) -> None:
    assert "cache-user:" in acl_server.url
    be = await open_backend(acl_server.url)
    src = make_obj(src_pool, seed=11)
    assert await be.put(make_key(11), src)
    got = await be.get(make_key(11))
    assert got is not None and same(got, src)
    got.ref_count_down()
    src.ref_count_down()


async def test_wrong_password_raises_to_the_manager_not_a_wrong_answer(
    password_server: RedisServer, make_ctx: Any, prefix: str
) -> None:
    url = password_server.url.replace("s3cr", "nope", 1)
    be = RemoteBackend(make_ctx(), url, prefix=prefix)
    try:
        with pytest.raises(RedisError):
            await be.get(make_key(1))
        with pytest.raises(RedisError):
            await be.contains(make_key(1))
    finally:
        await be.close()
