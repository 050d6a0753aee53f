"""The client tier ``server``: entries live in the node cache server's shared pool.

Enabled by ``cache_server_socket: PATH`` and placed in ``tier_order`` like any tier (alone, or
after a small private ``cpu`` tier). The namespace is ``cache_server_namespace``, else the
metadata's model name, else ``"default"``; ``cache_server_token`` is presented at admission.

Two surfaces:

* the :class:`~lmcache_async.tiers.LocalTier` calls (``lookup``, ``contains_nowait``,
  ``prefix_len``, ``present_flags``, ``touch``) answer on the caller's thread over a blocking
  socket, one round trip per batch, each bounded by ``remote_timeout_s``;
* the backend coroutines (loop thread) run the same blocking calls in the manager's executor,
  so the loop never waits on the socket.

A read copies the entry out of the shared pool into a buffer from the read allocator (the
manager's staging area unless the caller passes one); the caller owns that buffer. A read into
caller memory (:meth:`ServerTier.read_into_many`, the
:class:`~lmcache_async.tiers.DirectReader` call ``read_into_sync`` makes) copies straight from
the pool into the caller's pieces, one round trip per batch. A write from the manager's put path
(:meth:`ServerTier.put_direct`, the :class:`~lmcache_async.tiers.DirectPut` call, used
when there is no CPU tier) copies the caller's tensor straight into the block the server
granted: one copy, on the caller's thread, readable by every client when it returns. Holds
(:meth:`ServerTier.hold`) pin entries for readers in other processes (the encoder-cache
connector backs its promises to workers with them).

Trouble (server down, restarted, slow, malformed answer) is a miss/False, counted in
``stats()``; the client's circuit breaker skips the server while it is down and the first call
after the back-off reconnects and maps the new pool. A call that finds its connection closed by
a server that restarted meanwhile reconnects at once and is answered.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import HeapAllocator, MemoryFormat, MemoryObj
from lmcache_async.read_sinks import ReadSink
from lmcache_async.server.client import ServerClient
from lmcache_async.server.protocol import MAX_BATCH
from lmcache_async.tiers import UNKNOWN, Allocate, BackendContext, CannotTell, RemovalReason, StorageBackend

if TYPE_CHECKING:
    from lmcache_async.server.leases import ServerHolds

__all__ = ["ServerTier", "create"]


def _kb(key: CacheEngineKey) -> bytes:
    return key.to_string().encode("utf-8")


_BORROWED = HeapAllocator("server-tier borrowed tensors", pin=False)
"""The nominal allocator of :func:`_borrow`'s objects: it owns none of their memory."""


def _borrow(tensor: torch.Tensor, fmt: MemoryFormat) -> MemoryObj:
    """The caller's ``tensor`` as a :class:`MemoryObj` for the length of one put: it reserves
    nothing (size 0), so dropping it frees nothing; the caller keeps the tensor."""
    return MemoryObj(_BORROWED, 0, 0, tensor, tuple(tensor.shape), tensor.dtype, fmt)


class ServerTier(StorageBackend):
    """A client of one namespace on a node cache server; see the module docstring."""

    name = "server"

    def __init__(self, client: ServerClient, ctx: BackendContext) -> None:
        self.client = client
        self._staging: Allocate = ctx.staging
        self._loop = ctx.loop
        self._executor = ctx.executor
        #: Direct puts stored, and those refused or unanswered (caller threads; a race may
        #: miss an increment).
        self.direct_puts = 0
        self.direct_put_failures = 0

    # ---- capabilities ----------------------------------------------------------------------------
    @property
    def persistent(self) -> bool:
        """Entries live in the server process: they outlive this client, not the server."""
        return True

    @property
    def shared(self) -> bool:
        return True

    @property
    def is_remote(self) -> bool:
        return True

    # ---- caller-thread surface (LocalTier) --------------------------------------------------------
    @property
    def call_timeout_s(self) -> float:
        """The bound on one caller-thread call (``remote_timeout_s``; the wait for the
        connection, shared by threads, included)."""
        return self.client.timeout_s

    # ---- declared capabilities -------------------------------------------------------------------
    def as_local(self) -> ServerTier:
        return self

    def as_batch_lookup(self) -> ServerTier:
        return self

    def as_direct_reader(self) -> ServerTier:
        return self

    def as_direct_put(self) -> ServerTier:
        return self

    def as_locator(self) -> ServerTier:
        return self

    def as_leasing(self) -> ServerTier:
        return self

    def as_describer(self) -> ServerTier:
        return self

    def leases(self, ttl_s: float) -> ServerHolds:
        """Holds on this tier's server (:class:`~lmcache_async.tiers.Leasing`)."""
        from lmcache_async.server.leases import ServerHolds

        return ServerHolds(self, ttl_s)

    @property
    def evicted_elsewhere(self) -> bool:
        """The server evicts from its shared pool on its own and publishes that itself."""
        return True

    @property
    def reports_removals(self) -> bool:
        """Removals made through this client are reported (the server's own evictions are the
        server's to publish)."""
        return True

    def locate_many(self, keys: Sequence[CacheEngineKey]) -> list[bool | None] | CannotTell:
        """Per key: True when the entry is in the server's shared pool (a read is a memory
        copy), False when only the server's own lower tiers hold it (a read stages it back
        first), None when the server does not hold it; :data:`~lmcache_async.tiers.UNKNOWN`
        when it could not be asked. Two round trips at most (the pool, then the rest)."""
        raw = [_kb(k) for k in keys]
        in_pool = self.client.contains(raw, pool_only=True)
        if in_pool is None:
            return UNKNOWN
        rest = [i for i, f in enumerate(in_pool) if not f]
        below = self.client.contains([raw[i] for i in rest]) if rest else []
        if below is None:
            return UNKNOWN
        out: list[bool | None] = [True if f else None for f in in_pool]
        for i, f in zip(rest, below, strict=True):
            out[i] = False if f else None
        return out

    def lookup(self, key: CacheEngineKey) -> MemoryObj | None:
        """The entry copied into a staging buffer the caller owns, or None (miss or trouble)."""
        got = self.client.get([_kb(key)], self._staging)
        return None if not got else got[0]

    def lookup_many(self, keys: Sequence[CacheEngineKey], alloc: Allocate | None = None) -> list[MemoryObj | None]:
        """One result per key (one round trip); buffers from ``alloc`` (default: staging)."""
        got = self.client.get([_kb(k) for k in keys], alloc or self._staging)
        return [None] * len(keys) if got is None else got

    def read_into_many(self, keys: Sequence[CacheEngineKey], sinks: Sequence[ReadSink], prefix: bool) -> list[bool]:
        """Each entry copied from the shared pool straight into its sink, on the caller's thread
        (:class:`~lmcache_async.tiers.DirectReader`; one round trip for the batch, none for
        entries whose location this client remembers); all False when the server could not be
        asked (counted by the client). See :meth:`ServerClient.read_into
        <lmcache_async.server.client.ServerClient.read_into>`."""
        got = self.client.read_into([_kb(k) for k in keys], sinks, prefix)
        return [False] * len(keys) if got is None else got

    def describe(self, keys: Sequence[CacheEngineKey], chunks: Sequence[Any]) -> list[bool] | None:
        """Tell the server which vLLM blocks the committed entries ``keys`` hold (``chunks``:
        :class:`~lmcache_async.events.chunks.Chunk` each), so ``lmcache-async serve --events``
        publishes them; see :meth:`ServerClient.describe
        <lmcache_async.server.client.ServerClient.describe>`. Caller's thread, one round trip."""
        return self.client.describe([(_kb(k), c) for k, c in zip(keys, chunks, strict=True)])

    def contains_nowait(self, key: CacheEngineKey) -> bool | CannotTell:
        """Presence asked over the socket; :data:`~lmcache_async.tiers.UNKNOWN` when the server
        could not be asked."""
        got = self.client.contains([_kb(key)])
        return UNKNOWN if got is None else got[0]

    def prefix_len(self, keys: Sequence[CacheEngineKey]) -> int:
        """How many leading keys the server holds (0 when it could not be asked)."""
        flags = self.client.contains([_kb(k) for k in keys])
        if not flags:
            return 0
        n = 0
        for f in flags:
            if not f:
                break
            n += 1
        return n

    def present_flags(self, keys: Sequence[CacheEngineKey]) -> list[bool]:
        """Presence of each key (all False when the server could not be asked)."""
        flags = self.client.contains([_kb(k) for k in keys])
        return [False] * len(keys) if flags is None else flags

    def touch(self, keys: Sequence[CacheEngineKey]) -> None:
        """Mark the keys the server holds as recently used."""
        if keys:
            self.client.contains([_kb(k) for k in keys], touch=True)

    def put_many(self, items: Sequence[tuple[CacheEngineKey, MemoryObj]]) -> list[bool]:
        """Store each payload on the caller's thread; False per item not stored (or trouble)."""
        got = self.client.put([(_kb(k), o) for k, o in items])
        return [False] * len(items) if got is None else got

    def put_direct(
        self, items: Sequence[tuple[CacheEngineKey, torch.Tensor | MemoryObj]], fmt: MemoryFormat
    ) -> list[bool] | None:
        """Store each value (borrowed for the call) straight into a block granted by the server:
        one copy from the caller's memory (a single ``memmove`` for a contiguous CPU tensor),
        then one commit publishes the batch to every client. Per item True: stored or already
        present; False: the server had no room. None: it could not be asked. Caller's thread,
        bounded by ``remote_timeout_s`` per :data:`MAX_BATCH` items; see
        :class:`~lmcache_async.tiers.DirectPut`."""
        out: list[bool] = []
        for i in range(0, len(items), MAX_BATCH):
            part = [(_kb(k), v if isinstance(v, MemoryObj) else _borrow(v, fmt)) for k, v in items[i : i + MAX_BATCH]]
            got = self.client.put(part)
            if got is None:
                if not out:
                    self.direct_put_failures += len(items)
                    return None
                out.extend([False] * (len(items) - len(out)))  # the rest was not asked
                break
            out.extend(got)
        stored = sum(out)
        self.direct_puts += stored
        self.direct_put_failures += len(out) - stored
        return out

    @property
    def generation(self) -> int:
        """The pool generation of the server last connected to (0 before any connection)."""
        return self.client.generation

    # ---- holds: promises to readers in other processes (caller's thread) -------------------------
    def hold(self, keys: Sequence[CacheEngineKey], ttl_s: float) -> list[int]:
        """Pin each entry on the server for up to ``ttl_s`` seconds: a token per key, 0 for a
        miss, a refused hold or trouble. A held entry stays readable through
        :meth:`read_held` from any client of the namespace after its key is removed or evicted."""
        got = self.client.hold([_kb(k) for k in keys], ttl_s)
        return [0] * len(keys) if got is None else got

    def unhold(self, tokens: Sequence[int]) -> bool:
        """Drop holds (from any process); False when the server could not be told (the holds
        then end at their TTL)."""
        return self.client.unhold(tokens)

    def read_held(self, token: int) -> torch.Tensor | None:
        """A private copy (the caller owns it) of the entry held under ``token``, or None when
        the hold is gone (dropped, expired, a restarted server) or the server could not be asked."""
        got = self.client.get_held([token], self._staging)
        if not got or got[0] is None:
            return None
        obj = got[0]
        try:
            return obj.tensor.clone()
        finally:
            obj.ref_count_down()

    # ---- backend coroutines (loop thread; blocking work in the executor) -------------------------
    async def _run(self, fn: Any, *args: Any) -> Any:
        return await self._loop.run_in_executor(self._executor, fn, *args)

    async def put(self, key: CacheEngineKey, obj: MemoryObj) -> bool:
        res: list[bool] = await self._run(self.put_many, [(key, obj)])
        return res[0]

    async def batched_put(self, items: Sequence[tuple[CacheEngineKey, MemoryObj]]) -> list[bool]:
        if not items:
            return []
        res: list[bool] = await self._run(self.put_many, list(items))
        return res

    async def get(self, key: CacheEngineKey, alloc: Allocate | None = None) -> MemoryObj | None:
        return (await self.batched_get([key], alloc))[0]

    async def batched_get(
        self, keys: Sequence[CacheEngineKey], alloc: Allocate | None = None
    ) -> list[MemoryObj | None]:
        if not keys:
            return []
        fut = self._loop.run_in_executor(self._executor, self.lookup_many, list(keys), alloc)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            fut.add_done_callback(_release_all)  # buffers the executor still fills are released
            raise

    async def contains(self, key: CacheEngineKey) -> bool:
        got = await self._run(self.client.contains, [_kb(key)])
        return bool(got and got[0])

    async def batched_contains(self, keys: Sequence[CacheEngineKey]) -> list[bool]:
        if not keys:
            return []
        res: list[bool] = await self._run(self.present_flags, list(keys))
        return res

    async def remove(self, key: CacheEngineKey) -> bool:
        got = await self._run(self.client.remove, [_kb(key)])
        removed = bool(got and got[0])
        if removed:
            self.report_removed([key], RemovalReason.DELETED)
        return removed

    async def clear(self) -> None:
        await self._run(self.client.clear)

    async def close(self) -> None:
        self.client.close()

    def stats(self) -> dict[str, Any]:
        st = self.client.stats()
        return {
            "errors": st["errors"],
            "skipped": st["skipped"],
            "connects": st["connects"],
            "connected": int(st["connected"]),
            "circuit_open": int(st["circuit"] != "closed"),
            "generation": self.client.generation,
            "direct_puts": self.direct_puts,
            "direct_put_failures": self.direct_put_failures,
            "read_mismatch": st["read_mismatches"],
            "rereads": st["rereads"],
        }


def _release_all(fut: asyncio.Future[list[MemoryObj | None]]) -> None:
    if fut.cancelled() or fut.exception() is not None:
        return
    for obj in fut.result():
        if obj is not None:
            obj.ref_count_down()


def create(ctx: BackendContext) -> ServerTier | None:
    """The tier when ``cache_server_socket`` is set, else None."""
    cfg = ctx.config
    if not cfg.cache_server_socket:
        return None
    namespace = cfg.cache_server_namespace or getattr(ctx.metadata, "model_name", None) or "default"
    client = ServerClient(
        cfg.cache_server_socket,
        str(namespace),
        token=cfg.cache_server_token,
        timeout_s=cfg.remote_timeout_s,
        max_backoff_s=cfg.remote_breaker_max_backoff_s,
        remember_locations=cfg.cache_server_remember_locations,
        server_uid=cfg.cache_server_uid,
    )
    return ServerTier(client, ctx)
