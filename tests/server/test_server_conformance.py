"""The backend conformance suite against the client tier ``server`` and a real server process."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmcache_async.server.client import ServerClient
from lmcache_async.server.tier import ServerTier
from lmcache_async.testing import PersistentBackendConformanceTests
from lmcache_async.testing.cache_server import CacheServerProcess, private_dir
from lmcache_async.tiers import BackendContext


class TestServerTier(PersistentBackendConformanceTests):
    """Entries live in the server, so a reopened client finds them (one namespace per location)."""

    state_machine_examples = 8

    @pytest.fixture(autouse=True)
    def _server(self, shared_server) -> None:
        self.socket = shared_server.socket

    async def make_backend(self, ctx: BackendContext, location: Path) -> ServerTier:
        namespace = "conf-" + hashlib.sha256(str(location).encode()).hexdigest()[:16]
        # A generous timeout: the suite checks semantics, not latency, on a possibly busy machine.
        return ServerTier(ServerClient(self.socket, namespace, timeout_s=30.0), ctx)

    @pytest.fixture(autouse=True)
    def _bounded_servers(self) -> Iterator[None]:
        self.bounded: list[CacheServerProcess] = []
        yield
        for srv in self.bounded:
            srv.kill()

    async def make_bounded_backend(self, ctx: BackendContext, location: Path, capacity_bytes: int) -> ServerTier:
        """A client of a server of its own whose shared pool is ``capacity_bytes``."""
        srv = CacheServerProcess(
            private_dir(location.parent / "bounded-server"), max_local_cpu_size=capacity_bytes / (1 << 30)
        )
        self.bounded.append(srv)
        srv.start()
        return ServerTier(ServerClient(srv.socket, "bounded", timeout_s=30.0), ctx)
