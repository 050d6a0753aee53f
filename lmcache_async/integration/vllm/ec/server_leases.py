"""Server holds for the encoder-cache connector: the ``server`` tier's leases.

The holds themselves are the ``server`` tier's :class:`~lmcache_async.tiers.Leasing` capability
(:class:`lmcache_async.server.leases.ServerHolds`), reached through
:meth:`StorageManager.leases <lmcache_async.storage_manager.StorageManager.leases>`; this module
keeps the connector's choice (server holds only without a ``disk`` tier) and the older names.
"""

from __future__ import annotations

from lmcache_async.deprecation import moved_names
from lmcache_async.storage_manager import StorageManager
from lmcache_async.tiers import PromiseLeases

__all__ = ["server_holds_of"]


def server_holds_of(sm: StorageManager, ttl_s: float) -> PromiseLeases | None:
    """Holds on the manager's ``server`` tier, or None when it has none (or also has a ``disk``
    tier, whose disk leases are used instead)."""
    if "server" not in sm.tier_names or "disk" in sm.tier_names:
        return None
    return sm.leases(ttl_s, tier="server")


# Moved beside the server tier; kept for one release.
__getattr__ = moved_names(__name__, dict.fromkeys(("LEASE_PREFIX", "ServerHolds"), "lmcache_async.server.leases"))
