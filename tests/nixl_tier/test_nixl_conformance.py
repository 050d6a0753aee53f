"""The NIXL tier (POSIX plugin, real files) passes the backend conformance suite in each layout."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmcache_async.nixl.tier import NixlBackend, NixlSettings
from lmcache_async.testing import PersistentBackendConformanceTests
from lmcache_async.tiers import BackendContext

pytestmark = pytest.mark.nixl


class TestNixlPosixFilesConformance(PersistentBackendConformanceTests):
    """One file per entry (``nixl_pool_size: 0``)."""

    async def make_backend(self, ctx: BackendContext, location: Path) -> NixlBackend:
        return NixlBackend(ctx, NixlSettings(plugin="POSIX", path=str(location), max_bytes=256 << 20))

    async def make_bounded_backend(self, ctx: BackendContext, location: Path, capacity_bytes: int) -> NixlBackend:
        return NixlBackend(ctx, NixlSettings(plugin="POSIX", path=str(location), max_bytes=capacity_bytes))


class TestNixlPosixSlotsConformance(PersistentBackendConformanceTests):
    """Pre-created slot files (``nixl_pool_size: 64``)."""

    async def make_backend(self, ctx: BackendContext, location: Path) -> NixlBackend:
        return NixlBackend(ctx, NixlSettings(plugin="POSIX", path=str(location), pool_size=64, max_bytes=256 << 20))

    async def make_bounded_backend(self, ctx: BackendContext, location: Path, capacity_bytes: int) -> NixlBackend:
        return NixlBackend(
            ctx, NixlSettings(plugin="POSIX", path=str(location), pool_size=64, max_bytes=capacity_bytes)
        )
