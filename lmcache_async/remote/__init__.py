"""The remote tier (``remote_url``): entries in a distributed store shared by many machines.

Connectors are chosen by URL scheme (:mod:`.connector`): Redis/Valkey (``redis://``,
``rediss://``, ``valkey://``, ``unix://``), Redis Cluster (``redis+cluster://h:p,h:p``), a
shared filesystem (``fs:///dir``) and an S3 bucket (``s3://BUCKET/PREFIX``, :mod:`.s3`);
``mooncake://master:port`` is the Mooncake Store tier (:mod:`.mooncake`). Every entry is one self-describing record
(:mod:`lmcache_async.records`), verified on read; names are namespaced by
``remote_key_prefix`` and the model name (:mod:`.naming`), so deployments sharing a server
never read each other's entries.

The backend reports ``is_remote``: the StorageManager runs each call under
``remote_timeout_s`` and the tier's circuit breaker. Connector errors therefore propagate
(counted by the manager, answered as "unknown"); corrupt or foreign records are misses counted
here. See ``docs/remote.md``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from lmcache_async.encryption import cipher_for
from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import MemoryObj
from lmcache_async.tiers import UNKNOWN, Allocate, BackendContext, CannotTell, StorageBackend

from .connector import (
    Connector,
    ConnectorSettings,
    S3Settings,
    known_schemes,
    make_connector,
    register_connector,
)
from .naming import EntryName, check_prefix, entry_name
from .url import RemoteURL, parse_remote_url, redact

logger = logging.getLogger(__name__)

__all__ = [
    "Connector",
    "ConnectorSettings",
    "RemoteBackend",
    "RemoteURL",
    "create",
    "known_schemes",
    "make_connector",
    "parse_remote_url",
    "register_connector",
]

_BATCH_CONCURRENCY = 8


class RemoteBackend(StorageBackend):
    """A tier over one :class:`~.connector.Connector`.

    ``url``, ``prefix``, ``part_size``, ``ttl_s`` and ``timeout_s`` default to the context's
    ``remote_url``, ``remote_key_prefix``, ``remote_part_size``, ``remote_ttl_s`` and
    ``remote_timeout_s``. Construction validates them (``ValueError``/``TypeError`` naming the
    key) but does not connect; :meth:`start` or the first call does.
    """

    name = "remote"

    def __init__(
        self,
        ctx: BackendContext,
        url: str | None = None,
        *,
        prefix: str | None = None,
        part_size: int | None = None,
        ttl_s: float | None = None,
        timeout_s: float | None = None,
    ) -> None:
        cfg = ctx.config
        url = url if url is not None else cfg.remote_url
        if not url:
            raise ValueError("remote_url is not set")
        part_size = cfg.remote_part_size if part_size is None else part_size
        if not isinstance(part_size, int) or isinstance(part_size, bool) or part_size <= 0:
            raise ValueError(f"remote_part_size must be a positive int, got {part_size!r}")
        ttl = cfg.remote_ttl_s if ttl_s is None else ttl_s
        if ttl is not None and not ttl > 0:
            raise ValueError(f"remote_ttl_s must be > 0 or None, got {ttl!r}")
        timeout = cfg.remote_timeout_s if timeout_s is None else timeout_s
        if not timeout > 0:
            raise ValueError(f"remote_timeout_s must be > 0, got {timeout!r}")
        self._ctx = ctx
        self._prefix = check_prefix(cfg.remote_key_prefix if prefix is None else prefix)
        self._url = url
        self._alloc = ctx.staging
        cipher = cipher_for(cfg)
        settings = ConnectorSettings(
            timeout_s=timeout,
            part_size=part_size,
            ttl_s=ttl,
            executor=ctx.executor,
            cipher=cipher,
            s3=_s3_settings(cfg),
        )
        self.connector: Connector = make_connector(url, settings)
        if cipher is not None and not self.connector.seals:
            raise ValueError(
                f"encryption_key_file is set but the {self.connector.scheme}:// tier does not seal records"
            )
        self._sem: asyncio.Semaphore | None = None
        self._closed = False

    # ---- capabilities ------------------------------------------------------------------------
    @property
    def persistent(self) -> bool:
        return self.connector.persistent

    @property
    def shared(self) -> bool:
        return self.connector.shared

    @property
    def supports_delete(self) -> bool:
        return True

    @property
    def is_remote(self) -> bool:
        return True

    @property
    def prefix(self) -> str:
        """The namespace of this backend's entries."""
        return self._prefix

    def entry_name(self, key: CacheEngineKey) -> EntryName:
        """Where ``key``'s entry lives (for tools and tests)."""
        return entry_name(self._prefix, key)

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Connect eagerly. An unreachable store raises (the manager logs and counts it) and
        later calls connect again by themselves."""
        try:
            await self.connector.start()
        except Exception as exc:
            logger.debug("remote tier %s is not reachable yet: %s", redact(self._url), exc)
            raise

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self.connector.close()

    # ---- core --------------------------------------------------------------------------------
    async def put(self, key: CacheEngineKey, obj: MemoryObj) -> bool:
        return await self.connector.put(entry_name(self._prefix, key), obj)

    async def get(self, key: CacheEngineKey, alloc: Allocate | None = None) -> MemoryObj | None:
        return await self.connector.get(entry_name(self._prefix, key), alloc or self._alloc)

    async def contains(self, key: CacheEngineKey) -> bool:
        return (await self.connector.exists([entry_name(self._prefix, key)]))[0]

    async def remove(self, key: CacheEngineKey) -> bool:
        return await self.connector.remove(entry_name(self._prefix, key))

    async def batched_contains(self, keys: Sequence[CacheEngineKey]) -> list[bool]:
        """Presence of every key in one round trip (one per server for a cluster)."""
        return await self.connector.exists([entry_name(self._prefix, k) for k in keys])

    async def _bounded(self, coros: list[Any]) -> list[Any]:
        if self._sem is None:
            self._sem = asyncio.Semaphore(_BATCH_CONCURRENCY)
        sem = self._sem

        async def run(c: Any) -> Any:
            async with sem:
                return await c

        # Wait for every call before reporting a failure: a put still running after its
        # batch was given up would read a block the manager may already have released.
        results = await asyncio.gather(*(run(c) for c in coros), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return list(results)

    async def batched_put(self, items: Sequence[tuple[CacheEngineKey, MemoryObj]]) -> list[bool]:
        return await self._bounded([self.put(k, o) for k, o in items])

    async def batched_get(
        self, keys: Sequence[CacheEngineKey], alloc: Allocate | None = None
    ) -> list[MemoryObj | None]:
        """One result per key. If any read fails, buffers already read are released and the
        error propagates (the manager answers "unknown" for the batch)."""
        if self._sem is None:
            self._sem = asyncio.Semaphore(_BATCH_CONCURRENCY)
        sem = self._sem

        async def one(k: CacheEngineKey) -> MemoryObj | None:
            async with sem:
                return await self.get(k, alloc)

        tasks = [asyncio.ensure_future(one(k)) for k in keys]
        if not tasks:
            return []
        try:
            await asyncio.wait(tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            _release_results(tasks)
            raise
        for t in tasks:
            exc = t.exception()
            if exc is not None:
                _release_results(tasks)
                raise exc
        return [t.result() for t in tasks]

    async def clear(self) -> None:
        """Delete every entry below this backend's prefix (all models)."""
        await self.connector.clear(self._prefix)

    def contains_nowait(self, key: CacheEngineKey) -> bool | CannotTell:
        """The connector's answer without I/O (UNKNOWN when it has none: the loop asks)."""
        r = self.connector.exists_nowait(entry_name(self._prefix, key))
        return UNKNOWN if r is None else r

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"scheme": self.connector.scheme, "prefix": self._prefix}
        out.update(self.connector.stats())
        return out


def _secret(value: Any) -> str | None:
    """The text of a ``SecretStr`` (or str) configuration value, None when unset."""
    if value is None:
        return None
    return str(value.get_secret_value()) if hasattr(value, "get_secret_value") else str(value)


def _s3_settings(cfg: Any) -> S3Settings:
    return S3Settings(
        endpoint=cfg.s3_endpoint,
        region=cfg.s3_region,
        access_key_id=_secret(cfg.s3_access_key_id),
        secret_access_key=_secret(cfg.s3_secret_access_key),
        allow_http=cfg.s3_allow_http,
        max_concurrency=cfg.s3_max_concurrency,
    )


def _release_results(tasks: Sequence[asyncio.Future[MemoryObj | None]]) -> None:
    for t in tasks:
        if t.done() and not t.cancelled() and t.exception() is None:
            obj = t.result()
            if obj is not None:
                obj.ref_count_down()


def create(ctx: BackendContext) -> StorageBackend | None:
    """Registry factory: a remote tier when ``remote_url`` is set, else None.

    ``mooncake://`` URLs get the Mooncake Store tier (:mod:`.mooncake`, which needs the
    context's pool and staging memory to register them); every other scheme a connector."""
    if not ctx.config.remote_url:
        return None
    if ctx.config.remote_url.strip().lower().startswith("mooncake://"):
        from .mooncake import MooncakeBackend

        return MooncakeBackend(ctx)
    return RemoteBackend(ctx)
