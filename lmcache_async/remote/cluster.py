"""Redis Cluster connector (``redis+cluster://host:port[,host:port...]``, ``rediss+cluster://``).

The same records and commands as :mod:`.redis_conn`, routed by hash slot. An entry's record
and parts carry one hash tag, so they live in one slot and one MULTI/EXEC publishes them.
The slot map comes from ``CLUSTER SLOTS`` (asked of any known node); a ``MOVED``/``ASK`` reply
or a connection error makes the next call refresh it, so the connector follows failovers,
resharding and restarts by itself. ``exists`` over many keys sends one pipeline per node,
concurrently (one round trip of wall time).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from .connector import ConnectorSettings
from .redis_conn import ConnectionPool, Redirect, RedisConnector, _check, connection_factory
from .redis_wire import pack
from .url import RemoteURL, parse_remote_url, redact

__all__ = ["ClusterConnector", "create"]

SLOTS = 16384


class ClusterConnector(RedisConnector):
    """Records in a Redis Cluster; see the module docstring."""

    def __init__(self, url: RemoteURL, settings: ConnectorSettings) -> None:
        super().__init__(url, settings)
        self._known: list[tuple[str, int]] = list(url.hosts)
        self._slots: list[str | None] | None = None
        self._addr: dict[str, tuple[str, int]] = {}
        self._refresh_lock: asyncio.Lock | None = None
        self.slot_refreshes = 0

    def _pool_at(self, host: str, port: int) -> ConnectionPool:
        address = f"{host}:{port}"
        self._addr[address] = (host, port)
        return self._pool(address, connection_factory(self._url, self._settings, host, port))

    async def _refresh(self) -> list[str | None]:
        if self._refresh_lock is None:
            self._refresh_lock = asyncio.Lock()
        stale = self._slots
        async with self._refresh_lock:
            if self._slots is not None and self._slots is not stale:
                return self._slots  # another caller refreshed meanwhile
            last: BaseException | None = None
            seen: set[tuple[str, int]] = set()
            candidates = [*self._addr.values(), *self._known]
            for host, port in candidates:
                if (host, port) in seen:
                    continue
                seen.add((host, port))
                try:
                    (reply,) = await self._exchange(self._pool_at(host, port), pack([[b"CLUSTER", b"SLOTS"]]), 1)
                    table = self._table(_check(reply), host)
                except (RedisError, OSError) as exc:
                    last = exc
                    continue
                self._slots = table
                self.slot_refreshes += 1
                return table
            raise RedisConnectionError(f"no cluster node answered CLUSTER SLOTS ({last})")

    def _table(self, reply: Any, asked_host: str) -> list[str | None]:
        table: list[str | None] = [None] * SLOTS
        for entry in reply:
            lo, hi, primary = int(entry[0]), int(entry[1]), entry[2]
            host = primary[0].decode() if isinstance(primary[0], bytes) else str(primary[0])
            if not host or host == "?":
                host = asked_host
            port = int(primary[1])
            address = f"{host}:{port}"
            self._addr[address] = (host, port)
            if (host, port) not in self._known:
                self._known.append((host, port))
            for s in range(lo, hi + 1):
                table[s] = address
        return table

    async def _slot_table(self) -> list[str | None]:
        if self._closed:
            raise RedisConnectionError("the remote connector is closed")
        return self._slots if self._slots is not None else await self._refresh()

    async def _route(self, key: bytes) -> ConnectionPool:
        table = await self._slot_table()
        address = table[key_slot(key)]
        if address is None:
            self._slots = None
            raise RedisError(f"cluster slot {key_slot(key)} is not served")
        host, port = self._addr[address]
        return self._pool_at(host, port)

    async def _primaries(self) -> list[ConnectionPool]:
        table = await self._slot_table()
        return [self._pool_at(*self._addr[a]) for a in sorted({a for a in table if a is not None})]

    async def _redirected(self, redirect: Redirect) -> None:
        self._slots = None

    async def _group(self, keys: list[bytes]) -> list[list[int]]:
        table = await self._slot_table()
        groups: dict[str | None, list[int]] = {}
        for i, k in enumerate(keys):
            groups.setdefault(table[key_slot(k)], []).append(i)
        return list(groups.values())

    async def _exchange(
        self,
        pool: ConnectionPool,
        chunks: list[bytes | memoryview],
        count: int,
        on_reply: Callable[[int, Any], None] | None = None,
    ) -> list[Any]:
        try:
            return await super()._exchange(pool, chunks, count, on_reply)
        except (RedisConnectionError, OSError, TimeoutError):
            self._slots = None  # the node may have failed over: ask again next time
            raise

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        out["cluster_nodes"] = len({a for a in (self._slots or []) if a is not None})
        out["slot_refreshes"] = self.slot_refreshes
        return out


def create(url: str, settings: ConnectorSettings) -> ClusterConnector:
    """Registry factory for ``redis+cluster``/``rediss+cluster`` (and ``valkey`` spellings)."""
    parsed = parse_remote_url(url)
    if parsed.kind != "cluster":
        raise ValueError(f"remote_url {redact(url)!r} is not a cluster URL")
    return ClusterConnector(parsed, settings)
