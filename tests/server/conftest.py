"""Fixtures of the node cache server tests: a real ``lmcache-async serve`` process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from lmcache_async.testing.cache_server import CacheServerProcess, private_dir

HERE = Path(__file__).resolve().parent


ServerProcess = CacheServerProcess


@pytest.fixture
def make_server(tmp_path: Path) -> Iterator[type[ServerProcess]]:
    """Factory of servers (each in its own work directory), killed at the end of the test."""
    made: list[ServerProcess] = []
    n = [0]

    def make(*, loop: str | None = None, **settings: object) -> ServerProcess:
        n[0] += 1
        srv = ServerProcess(private_dir(tmp_path / f"srv{n[0]}"), loop=loop, **settings)
        made.append(srv)
        return srv

    yield make  # type: ignore[misc]
    for srv in made:
        srv.kill()


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One server for a whole test module (namespaces keep tests apart)."""
    srv = ServerProcess(
        private_dir(tmp_path_factory.mktemp("cache-server")),
        max_local_cpu_size=1 / 32,
        cache_server_max_namespaces=100000,
    ).start()
    yield srv
    srv.kill()
