"""Building a manager's tiers from its configuration, by registry name, in search order.

:func:`build_tiers` asks the registry (:mod:`lmcache_async.tiers.registry`) for each tier
:func:`~lmcache_async.tiers.registry.configured_tiers` names and sorts what it gets into an
immutable :class:`TierStack`:

* the **pool tier** — the first tier declaring :meth:`~lmcache_async.tiers.StorageBackend.as_pool`
  over the manager's CPU pool (the built-in ``cpu`` tier): the write front, always searched first;
* the **lower tiers**, each behind its :class:`~lmcache_async._manager.tier_guard.TierGuard`, in order;
  those declaring :meth:`~lmcache_async.tiers.StorageBackend.as_local` are listed again in
  :attr:`TierStack.local`, answered on the caller's thread before any loop hop.

Each tier gets its validated settings (``ctx.settings``, its ``tiers:`` section) and has its
removal reports bound to ``ctx.on_removed``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from lmcache_async._manager.tier_guard import TierGuard
from lmcache_async.keys import CacheEngineKey
from lmcache_async.tiers import (
    BackendContext,
    LocalTier,
    PoolTier,
    RemovalListener,
    RemovalReason,
    StorageBackend,
    configured_tiers,
    get_tier_spec,
    tier_settings,
)

__all__ = ["RemovalFanout", "TierStack", "build_tiers"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TierStack:
    """The tiers of one manager, fixed once built. ``pool_tier`` is the pool tier's
    :class:`PoolTier` side and ``pool_backend`` the same tier as a backend (both None without a
    CPU pool); ``guards`` are the lower tiers in search order; ``local`` the lower tiers' declared
    :class:`LocalTier` sides, in the same order."""

    pool_tier: PoolTier | None = None
    pool_backend: StorageBackend | None = None
    guards: tuple[TierGuard, ...] = ()
    local: tuple[LocalTier, ...] = ()

    @property
    def names(self) -> list[str]:
        """Registry names of every tier, in search order."""
        first = [self.pool_backend.name] if self.pool_backend is not None else []
        return first + [g.name for g in self.guards]

    def wants_loop(self) -> bool:
        """True when a lower tier answers reads only on the loop (not on the caller's thread)."""
        return any(not g.answers_locally for g in self.guards)


class RemovalFanout:
    """The manager's end of its tiers' removal reports: :meth:`report` (bound as every tier's
    :attr:`~lmcache_async.tiers.BackendContext.on_removed`) hands each report to every listener
    added. Listeners run on the reporting thread, in the order added; one that raises is logged
    and skipped. Any thread."""

    def __init__(self) -> None:
        self._listeners: tuple[RemovalListener, ...] = ()
        self._lock = threading.Lock()

    def add(self, listener: RemovalListener) -> None:
        """Hear every later removal report (``(tier, keys, reason)``)."""
        if not callable(listener):
            raise TypeError("listener must be callable")
        with self._lock:
            self._listeners = (*self._listeners, listener)

    def discard(self, listener: RemovalListener) -> None:
        """Stop ``listener`` hearing reports (no error when it was not added)."""
        with self._lock:
            self._listeners = tuple(x for x in self._listeners if x is not listener)

    def report(self, tier: str, keys: Sequence[CacheEngineKey], reason: RemovalReason) -> None:
        """Hand one report to every listener (a lock-free read of the listener tuple)."""
        for listener in self._listeners:
            try:
                listener(tier, keys, reason)
            except Exception:
                logger.warning("a removal listener failed on a report of tier %s", tier, exc_info=True)


def _build_one(ctx: BackendContext, name: str, lower_tiers: bool) -> StorageBackend | None:
    """Tier ``name`` built with its settings and its removal reports bound; None when it is not
    to be built here (``cpu`` without a pool, a lower tier while ``lower_tiers`` is False) or
    its factory declined."""
    if (name == "cpu" and ctx.pool is None) or (name != "cpu" and not lower_tiers):
        return None
    tier_ctx = dataclasses.replace(
        ctx, settings=tier_settings(name, ctx.config), extra=dict(ctx.config.tiers.get(name, {}))
    )
    backend = get_tier_spec(name).build_factory()(tier_ctx)
    if backend is not None:
        backend.bind_removals(ctx.on_removed)
    return backend


def _close_built(ctx: BackendContext, built: Sequence[StorageBackend]) -> None:
    """Close tiers built before a later factory failed (bounded; on the manager's loop)."""
    for backend in built:
        try:
            asyncio.run_coroutine_threadsafe(backend.close(), ctx.loop).result(5.0)
        except Exception:
            logger.warning("tier %s did not close after a failed build", backend.name, exc_info=True)


def build_tiers(
    ctx: BackendContext,
    *,
    lower_tiers: bool,
    sync_timeout: float,
    log: logging.Logger = logger,
) -> TierStack:
    """Build the tiers ``ctx.config`` turns on, in search order (CPU first).

    Local lower tiers get half of ``sync_timeout`` per call so a stuck tier yields a miss, not
    a ``TimeoutError`` in the caller; remote tiers (:attr:`StorageBackend.is_remote`) get
    ``remote_timeout_s``. ``lower_tiers=False`` builds the pool tier only. A factory that raises
    propagates after the tiers built before it are closed, and so does an invalid ``tiers:``
    section (:class:`~lmcache_async.errors.ConfigError`); a factory returning None is skipped."""
    config = ctx.config
    built: list[StorageBackend] = []
    try:
        for name in configured_tiers(config):
            backend = _build_one(ctx, name, lower_tiers)
            if backend is not None:
                built.append(backend)
    except BaseException:
        _close_built(ctx, built)
        raise
    pool_tier: PoolTier | None = None
    pool_backend: StorageBackend | None = None
    guards: list[TierGuard] = []
    for backend in built:
        as_pool = backend.as_pool() if pool_tier is None else None
        if as_pool is not None and as_pool.pool is ctx.pool:
            pool_tier, pool_backend = as_pool, backend
            continue
        timeout = config.remote_timeout_s if backend.is_remote else sync_timeout / 2
        guards.append(TierGuard(backend, timeout, config.remote_breaker_max_backoff_s, log=log))
    local = tuple(g.local for g in guards if g.local is not None)
    return TierStack(pool_tier, pool_backend, tuple(guards), local)
