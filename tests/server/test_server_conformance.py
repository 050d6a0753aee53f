"""The backend conformance suite against the client tier ``server`` and a real server process."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from lmcache_async.backends.server_tier import ServerTier
from lmcache_async.server.client import ServerClient
from lmcache_async.testing import PersistentBackendConformanceTests
from lmcache_async.tiers import BackendContext


class TestServerTier(PersistentBackendConformanceTests):
    """Entries live in the server, so a reopened client finds them (one namespace per location)."""

    state_machine_examples = 8

    @pytest.fixture(autouse=True)
    def _server(self, shared_server) -> None:  # type: ignore[no-untyped-def]
        self.socket = shared_server.socket

    async def make_backend(self, ctx: BackendContext, location: Path) -> ServerTier:
        namespace = "conf-" + hashlib.sha256(str(location).encode()).hexdigest()[:16]
        # A generous timeout: the suite checks semantics, not latency, on a possibly busy machine.
        return ServerTier(ServerClient(self.socket, namespace, timeout_s=30.0), ctx)
