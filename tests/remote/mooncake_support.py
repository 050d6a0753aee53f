"""Starting the Mooncake Store of the mooncake tests (test_remote_mooncake*.py and the fixtures
of conftest.py): without the Mooncake wheel or its binaries the tests skip with the reason, unless
``LMCACHE_ASYNC_REQUIRE_MOONCAKE=1`` (set by ``nox -s tests``) turns the skip into a failure."""

from __future__ import annotations

import os
from typing import Any, NoReturn

import pytest

from lmcache_async.testing.servers import MooncakeServers, ServerError, mooncake_binaries

REQUIRE_ENV = "LMCACHE_ASYNC_REQUIRE_MOONCAKE"
REQUIRE_MOONCAKE = os.environ.get(REQUIRE_ENV) == "1"


def missing(reason: str) -> NoReturn:
    """Skip for ``reason``, or fail when the run requires Mooncake."""
    if REQUIRE_MOONCAKE:
        pytest.fail(f"{reason} ({REQUIRE_ENV}=1 requires it)")
    pytest.skip(reason)


def _available() -> None:
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        missing(f"the Mooncake Store client cannot be imported ({exc}); pip install lmcache-async[mooncake]")
    if mooncake_binaries() is None:
        missing("no mooncake_master/mooncake_client binaries")


def _start(**kw: Any) -> MooncakeServers:
    _available()
    try:
        return MooncakeServers(**kw).start()
    except ServerError as exc:
        missing(f"the Mooncake store did not start: {exc}")
