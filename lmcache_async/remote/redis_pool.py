"""Connections to one Redis/Valkey server: a bounded pool, and the factory that builds them.

One job: hand out ``redis.asyncio`` connections that are safe to use for one command each
(:class:`ConnectionPool`: bounded, cancellation-safe, a connection left mid-reply is dropped,
never reused), built for a parsed ``remote_url`` (:func:`connection_factory`: credentials, TLS,
socket timeouts, no client-side retries), and turn a reply into a value or the error it carries
(:func:`check_reply`; a MOVED/ASK reply as :class:`Redirect`). Loop thread only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

try:
    from redis.asyncio.connection import (
        AbstractConnection,
        Connection,
        SSLConnection,
        UnixDomainSocketConnection,
    )
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import RedisError, ResponseError
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(f"the Redis connector needs the 'redis' package ({exc})") from exc

from .connector import ConnectorSettings
from .redis_internals import drop_connection
from .redis_wire import tune
from .url import RemoteURL

__all__ = ["ConnectionPool", "Redirect", "check_reply", "connection_factory"]


class Redirect(RedisError):
    """A MOVED/ASK reply: the slot lives on another node."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        parts = message.split()
        self.slot = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else -1
        self.address = parts[2] if len(parts) > 2 else ""


def check_reply(reply: Any) -> Any:
    """``reply`` unless it is an error (raised; MOVED/ASK as :class:`Redirect`)."""
    if isinstance(reply, ResponseError):
        msg = str(reply)
        if msg.startswith(("MOVED ", "ASK ")):
            raise Redirect(msg)
        raise reply
    if isinstance(reply, Exception):
        raise reply
    return reply


class ConnectionPool:
    """A bounded pool of ``redis.asyncio`` connections to one server.

    ``acquire`` waits for a free slot (cancellable); ``release`` is synchronous, so a
    cancelled caller can never leak a slot. A connection released as unhealthy is closed at
    once and reconnects on its next use.
    """

    def __init__(self, factory: Callable[[], AbstractConnection], size: int, name: str) -> None:
        self._factory = factory
        self._size = size
        self._sem: asyncio.Semaphore | None = None
        self._free: list[AbstractConnection] = []
        self._all: list[AbstractConnection] = []
        self.name = name
        self.connects = 0
        self.dropped = 0
        self.closed = False

    async def acquire(self) -> tuple[AbstractConnection, bool]:
        """A connected connection and whether it was connected just now (``ConnectionError``
        when the server cannot be reached)."""
        if self.closed:
            raise RedisConnectionError(f"connection pool {self.name} is closed")
        if self._sem is None:
            self._sem = asyncio.Semaphore(self._size)
        await self._sem.acquire()
        conn: AbstractConnection | None = None
        try:
            if self._free:
                conn = self._free.pop()
            else:
                conn = self._factory()
                self._all.append(conn)
            if conn.is_connected and await conn.can_read():
                # Unread bytes or EOF on an idle connection: the peer went away (or a reply
                # was left behind); never hand it out.
                drop_connection(conn)
                self.dropped += 1
            fresh = not conn.is_connected
            if fresh:
                await conn.connect()  # type: ignore[no-untyped-call]
                self.connects += 1
                tune(conn)
            return conn, fresh
        except BaseException:
            if conn is not None:
                drop_connection(conn)
                self._free.append(conn)
            self._sem.release()
            raise

    def release(self, conn: AbstractConnection, healthy: bool) -> None:
        """Return ``conn``; an unhealthy one (error or cancellation mid-command) is closed."""
        if not healthy:
            self.dropped += 1
        if (not healthy or self.closed) and conn.is_connected:
            drop_connection(conn)
        self._free.append(conn)
        assert self._sem is not None
        self._sem.release()

    async def close(self) -> None:
        """Close every connection (also those in use: their commands fail)."""
        self.closed = True
        try:
            for conn in self._all:
                try:
                    await conn.disconnect()
                except Exception:
                    drop_connection(conn)
        except BaseException:
            for conn in self._all:
                drop_connection(conn)
            raise
        finally:
            self._free.clear()
        # Aborted transports finish closing in a loop callback: let it run before the loop may end.
        for _ in range(2):
            await asyncio.sleep(0)


def connection_factory(
    url: RemoteURL, settings: ConnectorSettings, host: str | None = None, port: int | None = None
) -> Callable[[], AbstractConnection]:
    """A callable building one ``redis.asyncio`` connection for ``url`` (``host``/``port``
    override the URL's address: cluster nodes share credentials and TLS settings)."""
    common: dict[str, Any] = {
        "username": url.username,
        "password": url.password,
        "db": url.db,
        "socket_timeout": settings.timeout_s,
        "socket_connect_timeout": settings.timeout_s,
        "retry": Retry(NoBackoff(), 0),
        "health_check_interval": 0,
        "socket_read_size": url.option_int("socket_read_size", 1 << 16, minimum=4096),
    }
    if url.options.get("client_name"):
        common["client_name"] = url.options["client_name"]
    if url.kind == "unix":
        path = str(url.path)
        return lambda: UnixDomainSocketConnection(path=path, **common)
    h, p = (host, port) if host is not None and port is not None else url.hosts[0]
    if url.tls:
        tls: dict[str, Any] = {
            "ssl_ca_certs": url.options.get("ssl_ca_certs"),
            "ssl_certfile": url.options.get("ssl_certfile"),
            "ssl_keyfile": url.options.get("ssl_keyfile"),
            "ssl_cert_reqs": url.options.get("ssl_cert_reqs", "required"),
            "ssl_check_hostname": url.option_bool("ssl_check_hostname", False),
        }
        return lambda: SSLConnection(host=h, port=p, **tls, **common)
    return lambda: Connection(host=h, port=p, **common)
