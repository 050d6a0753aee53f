"""Fixtures of the KV event tests: a node server publishing events, free port pairs, the
Dynamo and vLLM interpreters.

pyzmq and msgspec (the ``events`` extra) are test dependencies: without them these tests skip
with the reason, or fail under ``LMCACHE_ASYNC_REQUIRE_EVENTS=1`` (set by ``nox -s tests`` and
``nox -s events``). The router-agreement test needs NVIDIA Dynamo's index in a venv of its own
(``scripts/dynamo_env.sh``; its python in ``LMCACHE_ASYNC_DYNAMO_PYTHON``), and the decoder test
vLLM's (``LMCACHE_ASYNC_VLLM_PYTHON``): without them they skip with the reason, or fail under
``LMCACHE_ASYNC_REQUIRE_DYNAMO=1`` (``nox -s events``).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmcache_async.server.client import query_status
from lmcache_async.testing.cache_server import CacheServerProcess, private_dir

REQUIRE_EVENTS = os.environ.get("LMCACHE_ASYNC_REQUIRE_EVENTS") == "1"
REQUIRE_ROUTERS = os.environ.get("LMCACHE_ASYNC_REQUIRE_DYNAMO") == "1"


def missing(why: str, required: bool, variable: str) -> None:
    """Skip with ``why``, or fail when ``variable=1`` requires the thing."""
    if required:
        pytest.fail(f"{why} ({variable}=1 requires it)")
    pytest.skip(why)


@pytest.fixture(autouse=True)
def _events_extra(request: pytest.FixtureRequest) -> None:
    """Every test here but the pure ordering ones needs pyzmq and msgspec."""
    if request.node.path.name == "test_chunks.py":
        return
    try:
        import msgspec  # noqa: F401
        import zmq  # noqa: F401
    except ImportError as exc:
        missing(f"pyzmq and msgspec (the events extra) are not installed: {exc}", REQUIRE_EVENTS,
                "LMCACHE_ASYNC_REQUIRE_EVENTS")  # fmt: skip


def interpreter(variable: str, what: str) -> str:
    """The python named by ``variable``; skips (or fails under LMCACHE_ASYNC_REQUIRE_DYNAMO=1)."""
    path = os.environ.get(variable)
    if not path or not os.access(path, os.X_OK):
        missing(f"{what} is not available: set {variable} (nox -s events does)", REQUIRE_ROUTERS,
                "LMCACHE_ASYNC_REQUIRE_DYNAMO")  # fmt: skip
    assert path is not None
    return path


def free_port_pair() -> int:
    """A port p with p and p + 1 free on 127.0.0.1 (publish and replay)."""
    for _ in range(200):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            p = a.getsockname()[1]
            if p >= 65535:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", p + 1))
                except OSError:
                    continue
                return int(p)
    raise RuntimeError("no free port pair on 127.0.0.1")


class EventServer(CacheServerProcess):
    """``lmcache-async serve --events tcp://127.0.0.1:PORT`` in a child process."""

    def __init__(self, workdir: Path, port: int, *, loop: str | None = None, **settings: object) -> None:
        super().__init__(workdir, loop=loop, **settings)
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.replay_endpoint = f"tcp://127.0.0.1:{port + 1}"

    def start(self, timeout: float = 60.0) -> EventServer:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "lmcache_async.cli", "serve", "--socket", self.socket,
                 "--config", str(self.config), "--events", self.endpoint],
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"cache server exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                query_status(self.socket, timeout_s=2.0)
                return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"cache server did not start: {self.log.read_text()[-2000:]}")


@pytest.fixture
def make_event_server(tmp_path: Path) -> Iterator[type[EventServer]]:
    """Factory of servers publishing events (settings over a 1 MiB pool per namespace; ``port``
    keeps a restarted server's endpoints), killed at the end of the test."""
    made: list[EventServer] = []

    def make(port: int | None = None, *, loop: str | None = None, **settings: object) -> EventServer:
        merged: dict[str, object] = {"max_local_cpu_size": 1 / 1024, **settings}
        srv = EventServer(private_dir(tmp_path / f"srv{len(made)}"), port or free_port_pair(), loop=loop, **merged)
        made.append(srv)
        return srv

    yield make  # type: ignore[misc]
    for srv in made:
        srv.kill()
