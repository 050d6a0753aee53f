"""``lmcache-async serve`` in a child process for the real-engine tests of the server tier."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


class CacheServer:
    """``lmcache-async serve`` on a socket in ``workdir`` (a 0700 directory)."""

    def __init__(self, workdir: Path) -> None:
        sockdir = workdir / "s"
        sockdir.mkdir(mode=0o700)
        os.chmod(sockdir, 0o700)
        self.socket = str(sockdir / "cache.sock")
        self.config = workdir / "server.yaml"
        self.config.write_text("max_local_cpu_size: 0.0625\ncache_server_pretouch: false\n")
        self.log = workdir / "server.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> CacheServer:
        from lmcache_async.server.client import query_status

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
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"cache server exited: {self.log.read_text()[-2000:]}")
            try:
                query_status(self.socket, timeout_s=2.0)
                return self
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"cache server did not start: {self.log.read_text()[-2000:]}")

    def status(self) -> dict[str, Any]:
        from lmcache_async.server.client import query_status

        return query_status(self.socket, timeout_s=10.0)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
