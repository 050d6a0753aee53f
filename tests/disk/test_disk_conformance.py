"""The disk tier passes the backend conformance suite (persistent: entries survive a reopen)."""

from __future__ import annotations

from pathlib import Path

from lmcache_async.disk.tier import DiskBackend
from lmcache_async.testing import PersistentBackendConformanceTests
from lmcache_async.tiers import BackendContext


class TestDiskConformance(PersistentBackendConformanceTests):
    async def make_backend(self, ctx: BackendContext, location: Path) -> DiskBackend:
        return DiskBackend(location, 1 << 30, executor=ctx.executor, staging=ctx.staging)

    async def make_bounded_backend(self, ctx: BackendContext, location: Path, capacity_bytes: int) -> DiskBackend:
        return DiskBackend(location, capacity_bytes, executor=ctx.executor, staging=ctx.staging)


class TestDiskConformanceFsyncFull(PersistentBackendConformanceTests):
    async def make_backend(self, ctx: BackendContext, location: Path) -> DiskBackend:
        return DiskBackend(location, 1 << 30, executor=ctx.executor, staging=ctx.staging, fsync="full")

    async def make_bounded_backend(self, ctx: BackendContext, location: Path, capacity_bytes: int) -> DiskBackend:
        return DiskBackend(location, capacity_bytes, executor=ctx.executor, staging=ctx.staging, fsync="full")
