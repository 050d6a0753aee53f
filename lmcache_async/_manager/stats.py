"""A manager's figures, assembled from its parts: what ``StorageManager.stats()`` returns.

Reads counters only (no lock, no I/O): any thread, the metrics exporter's included; figures may
trail the loop by a few calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lmcache_async._manager.front import Front
from lmcache_async._manager.put_path import PutPath
from lmcache_async._manager.read_into import ReadInto
from lmcache_async._manager.tier_guard import TierGuard

__all__ = ["manager_stats"]


def manager_stats(
    name: str, front: Front, lower: Sequence[TierGuard], put: PutPath, read_into: ReadInto
) -> dict[str, Any]:
    """The figures of the manager named ``name``: per tier (the CPU tier's from ``front``, with
    its hit and miss counts; each lower tier's from its guard), the pool and staging usage (None
    without one, and after close), pending writes, refused puts and ``read_into``'s counts."""
    tiers: dict[str, dict[str, Any]] = {}
    cpu = front.cpu_backend
    if cpu is not None:
        figures = cpu.stats()
        figures.update(hits=front.hits, misses=front.misses, errors=0)
        tiers[cpu.name] = figures
    for t in lower:
        tiers[t.name] = t.stats()
    pool, staging = front.pool, front.staging
    return {
        "name": name,
        "tiers": tiers,
        "pool": pool.stats() if pool is not None else None,
        "staging": staging.pool.stats() if staging.pool is not None else None,
        "pending_writes": len(front.pending),
        "put_rejected": put.put_rejected,
        "put_too_large": put.put_too_large,
        "one_off_refused": staging.one_off_refused,
        "read_into": read_into.stats(),
    }
