"""Server holds: entries kept readable on the node cache server until a worker in another process
has loaded them (the ``server`` tier's :class:`~lmcache_async.tiers.Leasing` capability).

When a scheduler promises an entry it asks the server to hold it (a namespace-wide pin with a
TTL); the lease string travels to the worker; the worker reads the held entry when the key itself
is gone (removed or evicted after the promise) and drops the hold once it loaded. A hold nobody
drops ends at its TTL on the server; a server restart ends every hold (the worker's read then
fails like any unreadable promise).

Every call is a blocking round trip bounded by the tier's ``remote_timeout_s``; none raises for
storage trouble. Lease strings look like ``server-hold:<generation hex>:<token hex>``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lmcache_async.keys import CacheEngineKey

if TYPE_CHECKING:
    from lmcache_async.server.tier import ServerTier

__all__ = ["LEASE_PREFIX", "ServerHolds"]

LEASE_PREFIX = "server-hold:"


def _parse(lease: str) -> tuple[int, int] | None:
    if not lease.startswith(LEASE_PREFIX):
        return None
    parts = lease[len(LEASE_PREFIX) :].split(":")
    if len(parts) != 2:
        return None
    try:
        gen, token = int(parts[0], 16), int(parts[1], 16)
    except ValueError:
        return None
    return (gen, token) if token > 0 else None


class ServerHolds:
    """Promise leases held on the cache server behind ``tier``; the same calls as
    :class:`~lmcache_async.integration.vllm.ec.leases.LeaseDir`. ``ttl_s`` bounds each hold."""

    def __init__(self, tier: ServerTier, ttl_s: float) -> None:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s!r}")
        self.tier = tier
        self.ttl_s = float(ttl_s)

    def take(self, key: CacheEngineKey) -> str | None:
        """Hold the entry of ``key``: the lease string, or None (not on the server, refused,
        or the server could not be asked)."""
        token = self.tier.hold([key], self.ttl_s)[0]
        if not token:
            return None
        return f"{LEASE_PREFIX}{self.tier.generation:x}:{token:x}"

    def drop(self, lease: str) -> bool:
        """Drop the hold named by ``lease``; False when it is not a server hold or the server
        could not be told (the hold then ends at its TTL)."""
        parsed = _parse(lease)
        return parsed is not None and self.tier.unhold([parsed[1]])

    def owns(self, lease: str) -> bool:
        """True when ``lease`` is a well-formed server-hold string (no I/O)."""
        return _parse(lease) is not None

    def read(self, lease: str, key: CacheEngineKey) -> torch.Tensor:
        """The held entry of ``key`` (a private copy). ``OSError`` when the hold is gone or the
        server could not be asked; ``ValueError`` when ``lease`` is not a server hold."""
        parsed = _parse(lease)
        if parsed is None:
            raise ValueError(f"not a server hold: {lease!r}")
        out = self.tier.read_held(parsed[1])
        if out is None:
            raise OSError(f"the server no longer holds {key.to_string()} (hold dropped, expired or server restarted)")
        return out

    def reap(self) -> int:
        """Nothing to reap here: the server ends holds at their TTL. Returns 0."""
        return 0
