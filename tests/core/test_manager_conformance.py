"""The in-memory reference backend, registered with ``register_backend`` from this test and no
core change, passes the manager-level conformance suite below a real CPU tier."""

from __future__ import annotations

from pathlib import Path

from lmcache_async.testing import InMemoryBackend
from lmcache_async.testing.manager_conformance import ManagerConformanceTests
from lmcache_async.tiers import BackendContext, StorageBackend


class TestInMemoryUnderManager(ManagerConformanceTests):
    def make_tier(self, ctx: BackendContext, location: Path) -> InMemoryBackend:
        return InMemoryBackend(ctx, name=self.tier_name)

    def medium_keys(self, backend: StorageBackend, location: Path) -> set[str] | None:
        assert isinstance(backend, InMemoryBackend)
        return set(backend.snapshot())

    def medium_bytes(self, backend: StorageBackend, location: Path, key: str) -> bytes | None:
        assert isinstance(backend, InMemoryBackend)
        record = backend.snapshot().get(key)
        return None if record is None else record.payload
