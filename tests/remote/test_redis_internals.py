"""The redis-py private members the Redis connector relies on still exist and mean what it uses.

These tests run against a real server; a redis-py release that renames or changes ``_writer``,
``_parser.on_disconnect`` or ``_close`` fails them loudly (see
:mod:`lmcache_async.remote.redis_internals`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from redis.asyncio.connection import Connection
from redis.exceptions import ConnectionError as RedisConnectionError

from lmcache_async.remote import redis_internals
from lmcache_async.remote.connector import ConnectorSettings
from lmcache_async.remote.redis_conn import connection_factory
from lmcache_async.remote.redis_wire import pack, send
from lmcache_async.remote.url import parse_remote_url
from lmcache_async.testing.servers import RedisServer


@pytest.fixture
async def conn(redis_server: RedisServer) -> AsyncIterator[Connection]:
    url = parse_remote_url(f"redis://127.0.0.1:{redis_server.port}")
    c = connection_factory(url, ConnectorSettings(timeout_s=5.0, part_size=1 << 20, ttl_s=None))()
    assert isinstance(c, Connection)
    await c.connect()
    try:
        yield c
    finally:
        await c.disconnect()


def test_installed_redis_py_is_within_the_checked_range() -> None:
    version = redis_internals.redis_py_version()
    assert redis_internals.MIN_REDIS_PY <= version[:2] < redis_internals.MAX_REDIS_PY, version


async def test_a_connected_connection_has_every_member_the_adapter_uses(conn: Connection) -> None:
    assert redis_internals.check_internals(conn) == []


async def test_the_writer_is_the_stream_the_connection_sends_on(conn: Connection) -> None:
    writer = redis_internals.stream_writer(conn)
    assert isinstance(writer, asyncio.StreamWriter)
    transport = redis_internals.stream_transport(conn)
    assert transport is writer.transport and not transport.is_closing()
    # Bytes written to it are the connection's requests: the reply is read by redis-py.
    await send(conn, pack([[b"PING"]]), 5.0)
    assert await conn.read_response(disable_decoding=True) == b"PONG"


async def test_a_disconnected_connection_has_no_writer(conn: Connection) -> None:
    await conn.disconnect()
    assert redis_internals.stream_writer(conn) is None
    assert redis_internals.stream_transport(conn) is None


async def test_drop_discards_a_half_read_reply_and_the_connection_reconnects(conn: Connection) -> None:
    value = b"x" * (1 << 20)
    await send(conn, pack([[b"SET", b"lmcache-async-internals", value]]), 5.0)
    assert await conn.read_response(disable_decoding=True) == b"OK"
    # A request whose reply is never read, then a drop: the reply must not reach the next read.
    await send(conn, pack([[b"GET", b"lmcache-async-internals"]]), 5.0)
    transport = redis_internals.stream_transport(conn)
    redis_internals.drop_connection(conn)
    assert transport is not None and transport.is_closing()
    assert redis_internals.stream_writer(conn) is None
    with pytest.raises(RedisConnectionError):
        await conn.read_response(disable_decoding=True)
    await conn.connect()
    await send(conn, pack([[b"ECHO", b"fresh"]]), 5.0)
    assert await conn.read_response(disable_decoding=True) == b"fresh"
    await send(conn, pack([[b"DEL", b"lmcache-async-internals"]]), 5.0)
    assert await conn.read_response(disable_decoding=True) == 1


def test_the_check_names_what_is_missing() -> None:
    class Bare:
        pass

    problems = redis_internals.check_internals(Bare())  # type: ignore[arg-type]
    assert problems == ["no _writer attribute", "no _parser attribute", "no _close() method"]
