"""``lmcache-async serve`` in a child process, for tests of the node cache server and of the
engines and connectors that use it.

The server listens on ``<workdir>/sock/cache.sock`` (a 0700 directory) with a YAML config
written from keyword settings; its stdout and stderr go to ``<workdir>/server.log``, whose tail
is in the error when it does not start.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from lmcache_async.server.client import query_status

__all__ = ["CacheServerProcess", "private_dir"]

#: The settings every test server starts with (a small pool, no pre-touch thread).
DEFAULT_SETTINGS: dict[str, object] = {"max_local_cpu_size": 1 / 32, "cache_server_pretouch": False}


def private_dir(path: Path) -> Path:
    """``path`` created (if needed) with mode 0700, as the server requires of its socket's parent."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


class CacheServerProcess:
    """One ``lmcache-async serve`` child; ``settings`` are config keys over :data:`DEFAULT_SETTINGS`.

    ``loop`` picks the server's event loop (``LMCACHE_ASYNC_SERVER_LOOP``: ``auto``, ``uvloop``
    or ``asyncio``); None leaves the environment as it is.

    Not thread-safe (a test drives it). :meth:`kill` is safe to call at any time, also twice.
    """

    def __init__(self, workdir: Path, *, loop: str | None = None, **settings: object) -> None:
        self.loop = loop
        self.workdir = private_dir(workdir)
        self.sockdir = private_dir(workdir / "sock")
        self.socket = str(self.sockdir / "cache.sock")
        self.config = workdir / "server.yaml"
        merged = {**DEFAULT_SETTINGS, **settings}
        self.config.write_text("".join(f"{k}: {v}\n" for k, v in merged.items()))
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = workdir / "server.log"
        token = settings.get("cache_server_token")
        self.token = None if token is None else str(token)

    def start(self, timeout: float = 60.0) -> CacheServerProcess:
        """Start the server and wait (up to ``timeout`` s) until it answers a status query;
        ``RuntimeError`` with the log's tail when it exits or does not answer in time."""
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "lmcache_async.cli", "serve", "--socket", self.socket,
                 "--config", str(self.config)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=None if self.loop is None else {**os.environ, "LMCACHE_ASYNC_SERVER_LOOP": self.loop},
            )  # fmt: skip
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
        assert self.proc is not None, "the server was not started"
        return self.proc.pid

    def status(self) -> dict[str, Any]:
        """What ``lmcache-async status`` prints, as a dict (``OSError`` when it does not answer)."""
        return query_status(self.socket, token=self.token, timeout_s=10.0)

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM and wait; the exit status."""
        assert self.proc is not None, "the server was not started"
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        """SIGKILL and reap, when it is running."""
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
