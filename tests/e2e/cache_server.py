"""``lmcache-async serve`` in a child process for the real-engine tests of the server tier."""

from __future__ import annotations

from pathlib import Path

from lmcache_async.testing.cache_server import CacheServerProcess


class CacheServer(CacheServerProcess):
    """A server with a 64 MiB pool in ``workdir``, allowed 120 s to start (engines load beside it)."""

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir, max_local_cpu_size=0.0625)

    def start(self, timeout: float = 120.0) -> CacheServer:
        super().start(timeout)
        return self
