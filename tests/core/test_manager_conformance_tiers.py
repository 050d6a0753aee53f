"""The disk tier and the ``fs://`` remote tier pass the manager-level conformance suite, with
their record files read directly from the directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lmcache_async.config import LMCacheEngineConfig
from lmcache_async.disk.tier import DiskBackend
from lmcache_async.remote import RemoteBackend
from lmcache_async.testing import RecordDirectoryMedium
from lmcache_async.testing.manager_conformance import ManagerConformanceTests
from lmcache_async.tiers import BackendContext


class TestDiskUnderManager(RecordDirectoryMedium, ManagerConformanceTests):
    record_suffix = ".lmc"

    def make_tier(self, ctx: BackendContext, location: Path) -> DiskBackend:
        return DiskBackend(location, 1 << 30, executor=ctx.executor, staging=ctx.staging)


class TestSharedFilesystemUnderManager(RecordDirectoryMedium, ManagerConformanceTests):
    record_suffix = ".rec"
    stats_counts_entries = False  # counting would list the shared directory

    def manager_config(self, tier_name: str, **overrides: Any) -> LMCacheEngineConfig:
        # Semantics, not latency: a generous remote bound on a busy machine (the hang test
        # passes its own).
        overrides.setdefault("remote_timeout_s", 30.0)
        return super().manager_config(tier_name, **overrides)

    def make_tier(self, ctx: BackendContext, location: Path) -> RemoteBackend:
        return RemoteBackend(ctx, f"fs://{location}", prefix="conformance")
