"""Fixtures of the node cache server tests: a real ``lmcache-async serve`` process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmcache_async.server.client import query_status

HERE = Path(__file__).resolve().parent


class ServerProcess:
    """``lmcache-async serve`` in a child process, on ``socket`` with a YAML config of ``settings``."""

    def __init__(self, workdir: Path, **settings: object) -> None:
        self.workdir = workdir
        self.sockdir = workdir / "sock"
        self.socket = str(self.sockdir / "cache.sock")
        self.config = workdir / "server.yaml"
        base: dict[str, object] = {"max_local_cpu_size": 1 / 32, "cache_server_pretouch": False}
        base.update(settings)
        self.config.write_text("".join(f"{k}: {v}\n" for k, v in base.items()))
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = workdir / "server.log"
        token = settings.get("cache_server_token")
        self.token = None if token is None else str(token)

    def start(self, timeout: float = 60.0) -> ServerProcess:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "lmcache_async.cli",
                    "serve",
                    "--socket",
                    self.socket,
                    "--config",
                    str(self.config),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"cache server exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                query_status(self.socket, token=self.token, timeout_s=2.0)
                return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"cache server did not start: {self.log.read_text()[-2000:]}")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def status(self) -> dict[str, object]:
        return query_status(self.socket, token=self.token, timeout_s=10.0)

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM and wait; the exit status."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def rss_bytes(self) -> int:
        """Private resident memory (``RssAnon``): the shared pools' pages are not counted."""
        with open(f"/proc/{self.pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no RssAnon")


def private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)
    return path


@pytest.fixture
def make_server(tmp_path: Path) -> Iterator[type[ServerProcess]]:
    """Factory of servers (each in its own work directory), killed at the end of the test."""
    made: list[ServerProcess] = []
    n = [0]

    def make(**settings: object) -> ServerProcess:
        n[0] += 1
        srv = ServerProcess(private_dir(tmp_path / f"srv{n[0]}"), **settings)
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
