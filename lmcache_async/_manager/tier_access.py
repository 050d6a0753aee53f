"""Reaching the tiers' declared capabilities through a manager's tier stack.

Pure functions over the CPU tier's backend and the lower tiers' guards (search order) that pick
the tier an integration asks for: the leases of a tier declaring
:class:`~lmcache_async.tiers.Leasing`, the first :class:`~lmcache_async.tiers.Describer`, the
:class:`~lmcache_async.tiers.BatchLookup` of a manager's only tier, and a tier's backend by name
(for tests and tools).
"""

from __future__ import annotations

from collections.abc import Sequence

from lmcache_async._manager.tier_guard import TierGuard
from lmcache_async.tiers import BatchLookup, Describer, PromiseLeases, StorageBackend

__all__ = ["backend_named", "describer_of", "leases_of", "sole_batch_reader"]


def leases_of(lower: Sequence[TierGuard], ttl_s: float, tier: str | None) -> PromiseLeases | None:
    """The leases (``ttl_s`` seconds) of tier ``tier`` among ``lower``, or (None) of the first
    persistent tier declaring leasing, else the first declaring tier; None when none does.
    ``ValueError`` (from the tier) unless ``ttl_s`` > 0."""
    leasing = [(g.backend.persistent, i, lz) for i, g in enumerate(lower) if (lz := g.backend.as_leasing())]
    if tier is not None:
        leasing = [x for x in leasing if x[2].name == tier]
    if not leasing:
        return None
    return min(leasing, key=lambda x: (not x[0], x[1]))[2].leases(ttl_s)


def describer_of(lower: Sequence[TierGuard]) -> Describer | None:
    """The :class:`~lmcache_async.tiers.Describer` of the first of ``lower`` declaring one."""
    for g in lower:
        d = g.backend.as_describer()
        if d is not None:
            return d
    return None


def sole_batch_reader(cpu: StorageBackend | None, lower: Sequence[TierGuard]) -> BatchLookup | None:
    """The batch lookup of the only tier when there is no CPU tier ``cpu`` and one lower tier."""
    if cpu is not None or len(lower) != 1:
        return None
    return lower[0].backend.as_batch_lookup()


def backend_named(cpu: StorageBackend | None, lower: Sequence[TierGuard], name: str) -> StorageBackend | None:
    """The backend of tier ``name``: the CPU tier ``cpu`` or one of ``lower``; None when absent."""
    if cpu is not None and cpu.name == name:
        return cpu
    for t in lower:
        if t.name == name:
            return t.backend
    return None
