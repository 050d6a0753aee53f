"""The backend conformance suite against every connector, each on a real server."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from lmcache_async.config import LMCacheEngineConfig
from lmcache_async.encryption import write_key_file
from lmcache_async.remote import RemoteBackend
from lmcache_async.testing import PersistentBackendConformanceTests
from lmcache_async.testing.servers import RedisClusterServers, RedisServer
from lmcache_async.tiers import BackendContext


class _RemoteConformance(PersistentBackendConformanceTests):
    """Entries live on the server, so reopening the backend finds them (persistent)."""

    part_size = 2 << 20
    url = ""

    @pytest.fixture(autouse=True)
    def _namespace(self) -> None:
        self.prefix = f"c{uuid.uuid4().hex[:12]}"

    def url_for(self, location: Path) -> str:
        return self.url

    async def make_backend(self, ctx: BackendContext, location: Path) -> RemoteBackend:
        # A generous timeout: the suite checks semantics, not latency, on a possibly busy machine.
        return RemoteBackend(ctx, self.url_for(location), prefix=self.prefix, part_size=self.part_size, timeout_s=30.0)


class TestRedis(_RemoteConformance):
    @pytest.fixture(autouse=True)
    def _server(self, redis_server: RedisServer) -> None:
        self.url = redis_server.url


class TestRedisSmallParts(_RemoteConformance):
    """8 KiB parts: most entries of the suite are multi-part records."""

    part_size = 8 << 10

    @pytest.fixture(autouse=True)
    def _server(self, redis_server: RedisServer) -> None:
        self.url = redis_server.url


class TestUnixSocket(_RemoteConformance):
    @pytest.fixture(autouse=True)
    def _server(self, redis_server: RedisServer) -> None:
        self.url = redis_server.unix_url


class TestPassword(_RemoteConformance):
    @pytest.fixture(autouse=True)
    def _server(self, password_server: RedisServer) -> None:
        self.url = password_server.url


class TestTLS(_RemoteConformance):
    @pytest.fixture(autouse=True)
    def _server(self, tls_server: RedisServer) -> None:
        self.url = tls_server.url


class TestValkey(_RemoteConformance):
    @pytest.fixture(autouse=True)
    def _server(self, valkey_server: RedisServer) -> None:
        self.url = valkey_server.url.replace("redis://", "valkey://", 1)


class TestCluster(_RemoteConformance):
    part_size = 64 << 10

    @pytest.fixture(autouse=True)
    def _server(self, redis_cluster: RedisClusterServers) -> None:
        self.url = redis_cluster.url


class TestSharedFilesystem(_RemoteConformance):
    def url_for(self, location: Path) -> str:
        return f"fs://{location}"


class _Sealed:
    """Records sealed under a key file of the test (``encryption_key_file``)."""

    @pytest.fixture(autouse=True)
    def _key_file(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self.key_file = str(tmp_path_factory.mktemp("key") / "key")
        write_key_file(self.key_file)

    def make_config(self) -> LMCacheEngineConfig:
        return LMCacheEngineConfig.from_defaults(encryption_key_file=self.key_file)


class TestRedisSealedParts(_Sealed, _RemoteConformance):
    """Sealed, in 8 KiB parts: most entries are several segments, one per part."""

    part_size = 8 << 10

    @pytest.fixture(autouse=True)
    def _server(self, redis_server: RedisServer) -> None:
        self.url = redis_server.url


class TestSharedFilesystemSealed(_Sealed, _RemoteConformance):
    def url_for(self, location: Path) -> str:
        return f"fs://{location}"
