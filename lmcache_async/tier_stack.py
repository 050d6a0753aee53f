"""Building a manager's tiers from its configuration, by registry name, in search order.

:func:`build_tiers` asks the registry (:mod:`lmcache_async.backend`) for each name of
``tier_order`` that is configured and sorts what it gets into a :class:`TierStack`:

* the **pool tier** — the first tier implementing :class:`~lmcache_async.backend.PoolTier` over
  the manager's CPU pool (the built-in ``cpu`` tier): the write front, always searched first;
* the **lower tiers**, each behind its :class:`~lmcache_async.tier_guard.TierGuard`, in order;
  those that also implement :class:`~lmcache_async.backend.LocalTier` are listed again in
  :attr:`TierStack.local`, answered on the caller's thread before any loop hop.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from lmcache_async.backend import (
    BackendContext,
    LocalTier,
    PoolTier,
    StorageBackend,
    get_backend_factory,
    is_configured,
)
from lmcache_async.tier_guard import TierGuard

__all__ = ["BUILTIN_LOWER", "TierStack", "build_tiers"]

logger = logging.getLogger(__name__)

#: Built-in tier names below the pool tier whose configuration key says whether they are on.
BUILTIN_LOWER = ("nixl", "disk", "remote")


@dataclass
class TierStack:
    """The tiers of one manager. ``pool_tier`` and ``pool_backend`` are the same object (None
    without a CPU pool); ``guards`` are the lower tiers in search order; ``local`` the lower
    tiers that answer on the caller's thread, in the same order."""

    pool_tier: PoolTier | None = None
    pool_backend: StorageBackend | None = None
    guards: list[TierGuard] = field(default_factory=list)
    local: list[LocalTier] = field(default_factory=list)


def build_tiers(
    ctx: BackendContext,
    *,
    lower_tiers: bool,
    sync_timeout: float,
    into: list[TierGuard],
    log: logging.Logger = logger,
) -> TierStack:
    """Build the tiers ``ctx.config.tier_order`` names, appending lower-tier guards to ``into``
    (the list the manager's searches and write-through already hold).

    Local lower tiers get half of ``sync_timeout`` per call so a stuck tier yields a miss, not
    a ``TimeoutError`` in the caller; remote tiers (:attr:`StorageBackend.is_remote`) get
    ``remote_timeout_s``. ``lower_tiers=False`` builds the pool tier only. A factory that raises
    propagates (the manager aborts its start); one returning None is skipped."""
    config = ctx.config
    stack = TierStack(guards=into)
    order = list(config.tier_order)
    if "cpu" in order:  # the CPU tier always answers first, on the caller's thread
        order.remove("cpu")
        order.insert(0, "cpu")
    for tier_name in order:
        if tier_name == "cpu" and ctx.pool is None:
            continue
        if tier_name != "cpu" and not lower_tiers:
            continue
        if not is_configured(tier_name, config):
            continue
        backend = get_backend_factory(tier_name)(ctx)
        if backend is None:
            continue
        if stack.pool_tier is None and isinstance(backend, PoolTier) and backend.pool is ctx.pool:
            stack.pool_tier = backend
            stack.pool_backend = backend
            continue
        timeout = config.remote_timeout_s if backend.is_remote else sync_timeout / 2
        guard = TierGuard(backend, timeout, config.remote_breaker_max_backoff_s, log=log)
        if guard.local is not None:
            stack.local.append(guard.local)
        into.append(guard)
    return stack
