"""Fixtures of the Omni stage-connector tests: stores over real tiers, a real node cache server
and a real redis-server; the connector tests need vllm_omni (scripts/omni_env.sh builds the venv).

Without vllm_omni the connector tests skip with the reason, unless ``LMCACHE_ASYNC_REQUIRE_OMNI=1``
(the ``omni`` nox session), which turns the skip into a failure. The framework-free store and
codec tests run everywhere.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from server.conftest import ServerProcess

from lmcache_async.integration.omni import OmniStageStore, load_stage_options
from lmcache_async.testing.cache_server import private_dir
from lmcache_async.testing.servers import RedisServer, find_server_binary

REQUIRE_OMNI_ENV = "LMCACHE_ASYNC_REQUIRE_OMNI"
# Read once at import: the suite-wide fixture that isolates tests from LMCACHE_* variables runs later.
REQUIRE_OMNI = os.environ.get(REQUIRE_OMNI_ENV) == "1"


def omni_available() -> str | None:
    """None when vllm_omni's connector API imports here, else why not."""
    try:
        # vLLM and Omni raise deprecation warnings of their own dependencies at import (the
        # suite turns warnings into errors): import them once with warnings silenced.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from vllm_omni.distributed.omni_connectors import OmniConnectorBase, OmniConnectorFactory  # noqa: F401
            from vllm_omni.distributed.omni_connectors.utils import serialization  # noqa: F401
    except Exception as exc:  # ImportError, or vLLM failing to import
        return f"vllm_omni does not import here ({type(exc).__name__}: {exc}); run scripts/omni_env.sh"
    return None


@pytest.fixture(scope="session")
def omni() -> None:
    """Skip (or fail, with LMCACHE_ASYNC_REQUIRE_OMNI=1) where vllm_omni is absent."""
    why = omni_available()
    if why is not None:
        if REQUIRE_OMNI:
            pytest.fail(f"{why} ({REQUIRE_OMNI_ENV}=1 requires it)")
        pytest.skip(why)


SMALL: dict[str, Any] = {
    "max_local_cpu_size": 1 / 32,
    "staging_size": 1 / 64,
    "blocking_timeout_secs": 10,
    "payload_buffer_size": 1 / 64,
}


@pytest.fixture
def make_store() -> Iterator[Callable[..., OmniStageStore]]:
    """Factory of stores from an ``extra``-style dict (small pools by default), closed at the end."""
    made: list[OmniStageStore] = []

    def make(**extra: Any) -> OmniStageStore:
        cfg, opts = load_stage_options({**SMALL, **extra})
        store = OmniStageStore(cfg, opts)
        made.append(store)
        return store

    yield make
    for s in made:
        s.close()


@pytest.fixture
def cache_server(tmp_path: Path) -> Iterator[ServerProcess]:
    """A real ``lmcache-async serve`` (64 MiB per namespace) for one test."""
    srv = ServerProcess(private_dir(tmp_path / "srv"), max_local_cpu_size=1 / 16).start()
    yield srv
    srv.kill()


def server_extra(srv: ServerProcess) -> dict[str, Any]:
    """Connector ``extra`` of a client whose only tier is the node server."""
    return {
        "tier_order": ["server"],
        "local_cpu": False,
        "cache_server_socket": srv.socket,
        "remote_timeout_s": 2.0,
        "staging_size": 1 / 32,
    }


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    binary = find_server_binary()
    if binary is None:
        if os.environ.get("LMCACHE_ASYNC_REQUIRE_SERVERS") == "1":
            pytest.fail("no redis-server or valkey-server binary")
        pytest.skip("no redis-server or valkey-server binary (apt-get install redis-server)")
    with RedisServer(binary) as srv:
        yield srv.url
