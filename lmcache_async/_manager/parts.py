"""Building a manager's parts, each from the ones before it; none of them sees the manager.

:func:`build_parts` checks the arguments, allocates the pools (:func:`~lmcache_async._manager.staging.manager_memory`),
starts the loop thread and the I/O executor, builds the tiers (:func:`~lmcache_async._manager.tier_stack.build_tiers`,
an immutable :class:`~lmcache_async._manager.tier_stack.TierStack`), then the write-through, the
:class:`~lmcache_async._manager.front.Front`, the lower tiers' searches, the put path, read-into, the tier
map, the loop-side work and last the :class:`~lmcache_async._manager.lifecycle.Lifecycle` (which is
tracked for interpreter exit from then on). The tiers are not started: the lifecycle does that.
"""

from __future__ import annotations

import concurrent.futures
import logging
from dataclasses import dataclass

from lmcache_async._manager.front import Front
from lmcache_async._manager.lifecycle import Lifecycle
from lmcache_async._manager.loop_work import LoopWork
from lmcache_async._manager.lower_tiers import LowerTiers
from lmcache_async._manager.put_path import PutPath
from lmcache_async._manager.read_into import ReadInto
from lmcache_async._manager.staging import StagingArea, manager_memory
from lmcache_async._manager.tier_stack import RemovalFanout, TierStack, build_tiers
from lmcache_async._manager.where import TierMap
from lmcache_async._manager.write_through import WriteThrough
from lmcache_async.config import LMCacheEngineConfig
from lmcache_async.config.check import raise_or_warn
from lmcache_async.loop import LoopThread
from lmcache_async.memory import PoolAllocator
from lmcache_async.metadata import NEUTRAL_METADATA, LMCacheEngineMetadata
from lmcache_async.sync_bridge import SyncBridge
from lmcache_async.tiers import BackendContext, configured_tiers

__all__ = ["ManagerParts", "build_parts"]


@dataclass(frozen=True, slots=True)
class ManagerParts:
    """Every part of one manager, built by :func:`build_parts`."""

    config: LMCacheEngineConfig
    name: str
    metadata: LMCacheEngineMetadata
    pool: PoolAllocator | None
    staging_pool: PoolAllocator | None
    staging: StagingArea
    lt: LoopThread
    bridge: SyncBridge
    removals: RemovalFanout
    stack: TierStack
    wt: WriteThrough
    front: Front
    tiers: LowerTiers
    put: PutPath
    read_into: ReadInto
    where: TierMap
    loop_work: LoopWork
    life: Lifecycle


def build_parts(
    config: LMCacheEngineConfig,
    metadata: LMCacheEngineMetadata | None,
    name: str,
    cpu_size_gib: float | None,
    cpu_size_key: str,
    lower_tiers: bool,
    log: logging.Logger,
) -> ManagerParts:
    """The parts of a manager named ``name`` (arguments as for ``StorageManager``), its tiers
    built but not started. ``TypeError`` for a config or metadata of the wrong type; a
    configuration error raises (or warns) as :func:`~lmcache_async.config.check.raise_or_warn`
    says. A tier that fails to build stops the loop and the executor before the error goes on."""
    if not isinstance(config, LMCacheEngineConfig):
        raise TypeError(f"config must be an LMCacheEngineConfig, got {type(config).__name__}")
    if metadata is not None and not isinstance(metadata, LMCacheEngineMetadata):
        raise TypeError(f"metadata must be an LMCacheEngineMetadata, got {type(metadata).__name__}")
    raise_or_warn(config, f"{name} manager")  # unknown tiers, bad URLs, pools that never fit: one line
    metadata = metadata if metadata is not None else NEUTRAL_METADATA
    timeout = float(config.blocking_timeout_secs)
    size_gib = config.max_local_cpu_size if cpu_size_gib is None else cpu_size_gib
    wants_lower = lower_tiers and any(t != "cpu" for t in configured_tiers(config))
    pool, staging_pool, staging = manager_memory(config, name, size_gib, cpu_size_key, wants_lower)
    lt = LoopThread(name)
    executor = concurrent.futures.ThreadPoolExecutor(
        max_workers=config.executor_workers, thread_name_prefix=f"lmcache-async-{name}-io"
    )
    bridge = SyncBridge(lt, timeout)
    removals = RemovalFanout()
    ctx = BackendContext(
        config=config,
        metadata=metadata,
        cache_name=name,
        loop=lt.loop,
        executor=executor,
        staging=staging.allocate,
        staging_pool=staging_pool,
        pool=pool,
        on_removed=removals.report,
    )
    try:
        stack = build_tiers(ctx, lower_tiers=lower_tiers, sync_timeout=timeout, log=log)
    except BaseException:
        lt.stop()  # build_tiers closed what it built
        executor.shutdown(wait=False, cancel_futures=True)
        raise
    wt = WriteThrough(lt, stack.guards)
    front = Front(stack, pool, staging, wt)
    tiers = LowerTiers(stack.guards, front, log=log)
    put = PutPath(name, front, tiers, log)
    read_into = ReadInto(front, tiers, bridge)
    where = TierMap(front, stack.guards)
    parts = (front, read_into, where, put, tiers)
    life = Lifecycle(name, timeout, lt, executor, tiers, wt, cpu=front.cpu, pool=pool, staging=staging, parts=parts)
    work = LoopWork(front, wt, tiers)
    return ManagerParts(
        config, name, metadata, pool, staging_pool, staging, lt, bridge, removals, stack, wt, front, tiers, put,
        read_into, where, work, life,
    )  # fmt: skip
