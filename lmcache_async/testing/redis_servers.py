"""Real Redis/Valkey servers (one, or a cluster) on loopback for tests, benchmarks and chaos
runs; see :mod:`lmcache_async.testing.servers`."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any
from urllib.parse import quote

from lmcache_async.testing.server_support import (
    ServerError,
    TLSFiles,
    _encode,
    _port_free,
    _Reader,
    _Started,
    find_server_binary,
    free_port,
    make_tls_files,
)

__all__ = ["RedisClusterServers", "RedisServer", "server_supports_tls"]

CLUSTER_SLOTS = 16384

_live: weakref.WeakSet[RedisServer] = weakref.WeakSet()


@atexit.register
def _kill_all() -> None:  # pragma: no cover - interpreter exit
    for srv in list(_live):
        with contextlib.suppress(Exception):
            srv.kill()


class RedisServer(_Started):
    """One ``redis-server``/``valkey-server`` process on ``127.0.0.1`` (see the module docstring).

    ``password``/``username`` enable authentication (an ACL user when ``username`` is given);
    ``tls`` serves TLS only (``rediss://``); ``unix_socket`` also listens on a socket in the
    work directory (:attr:`unix_url`); ``cluster`` enables cluster mode (for
    :class:`RedisClusterServers`). ``extra_args`` are passed to the server as given.
    """

    def __init__(
        self,
        binary: str | None = None,
        *,
        port: int | None = None,
        password: str | None = None,
        username: str | None = None,
        tls: TLSFiles | None = None,
        unix_socket: bool = False,
        cluster: bool = False,
        workdir: str | os.PathLike[str] | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        found = binary or find_server_binary()
        if found is None:
            raise ServerError("no redis-server/valkey-server binary found")
        self.binary = found
        self.password = password
        self.username = username
        self.tls = tls
        self.cluster = cluster
        self.extra_args = tuple(extra_args)
        self._own_dir = workdir is None
        self.workdir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="lmcache-async-redis-"))
        self._fixed_port = port is not None
        self.port = port if port is not None else free_port(with_bus=cluster)
        self.unix_path = str(self.workdir / f"redis-{self.port}.sock") if unix_socket else None
        self.proc: subprocess.Popen[bytes] | None = None
        self.paused = False

    # ---- addresses ---------------------------------------------------------------------------
    @property
    def host(self) -> str:
        return "127.0.0.1"

    def _auth(self) -> str:
        if self.password is None:
            return ""
        user = quote(self.username, safe="") if self.username else ""
        return f"{user}:{quote(self.password, safe='')}@"

    @property
    def url(self) -> str:
        """``redis://`` (or ``rediss://`` with the CA as an option) URL with credentials."""
        if self.tls is not None:
            ca = quote(self.tls.ca_cert, safe="/")
            return f"rediss://{self._auth()}{self.host}:{self.port}?ssl_ca_certs={ca}"
        return f"redis://{self._auth()}{self.host}:{self.port}"

    @property
    def unix_url(self) -> str:
        """``unix://`` URL of the socket (``ServerError`` unless started with ``unix_socket``)."""
        if self.unix_path is None:
            raise ServerError("server was not started with unix_socket=True")
        return f"unix://{self._auth()}{self.unix_path}"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"redis-{self.port}.log"

    # ---- process control ---------------------------------------------------------------------
    def _argv(self) -> list[str]:
        argv = [self.binary, "--bind", self.host, "--save", "", "--appendonly", "no"]
        argv += ["--dir", str(self.workdir), "--logfile", str(self.log_path), "--daemonize", "no"]
        argv += ["--protected-mode", "no", "--maxclients", "1000"]
        if self.tls is not None:
            argv += ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", self.tls.cert]
            argv += ["--tls-key-file", self.tls.key, "--tls-ca-cert-file", self.tls.ca_cert]
            argv += ["--tls-auth-clients", "no"]
            if self.cluster:
                argv += ["--tls-cluster", "yes", "--tls-replication", "yes"]
        else:
            argv += ["--port", str(self.port)]
        if self.unix_path is not None:
            argv += ["--unixsocket", self.unix_path, "--unixsocketperm", "700"]
        if self.password is not None:
            if self.username:
                argv += ["--user", "default", "off", "--user", self.username, "on", f">{self.password}"]
                argv += ["~*", "&*", "+@all"]
            else:
                argv += ["--requirepass", self.password]
            if self.cluster:
                argv += ["--masterauth", self.password]
                if self.username:
                    argv += ["--masteruser", self.username]
        if self.cluster:
            argv += ["--cluster-enabled", "yes", "--cluster-node-timeout", "2000"]
            argv += ["--cluster-config-file", str(self.workdir / f"nodes-{self.port}.conf")]
        argv += list(self.extra_args)
        return argv

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start the process and wait until it answers PING (``ServerError`` otherwise)."""
        if self.proc is not None and self.proc.poll() is None:
            return self
        self.workdir.mkdir(parents=True, exist_ok=True)
        attempts = 1 if self._fixed_port else 3
        for attempt in range(attempts):
            self.proc = subprocess.Popen(
                self._argv(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
            )
            _live.add(self)
            self.paused = False
            try:
                self._wait_ready(timeout)
                return self
            except ServerError:
                self.kill()
                if attempt + 1 == attempts:
                    raise
                self.port = free_port(with_bus=self.cluster)  # the port was taken meanwhile
                if self.unix_path is not None:
                    self.unix_path = str(self.workdir / f"redis-{self.port}.sock")
        return self  # pragma: no cover

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise ServerError(f"{self.binary} exited with {self.proc.returncode}: {err[-400:]}{self._log_tail()}")
            try:
                if self.command("PING") == "PONG":
                    return
            except (OSError, ServerError, ssl.SSLError) as exc:
                last = exc
            time.sleep(0.02)
        raise ServerError(f"server on port {self.port} not ready after {timeout}s ({last}){self._log_tail()}")

    def _log_tail(self) -> str:
        try:
            return "\nlog: " + self.log_path.read_text(errors="replace")[-800:]
        except OSError:
            return ""

    @property
    def alive(self) -> bool:
        """The process runs (possibly paused)."""
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the server (clients see their connections reset)."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            if self.paused:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        if proc.stderr is not None:
            proc.stderr.close()
        self.paused = False

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 5 s) and remove its own work directory."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            if self.paused:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        if proc is not None and proc.stderr is not None:
            proc.stderr.close()
        self.paused = False
        _live.discard(self)
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def pause(self) -> None:
        """SIGSTOP: the server keeps its sockets but answers nothing (a hung server)."""
        if self.alive:
            assert self.proc is not None
            os.kill(self.proc.pid, signal.SIGSTOP)
            self.paused = True

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        if self.alive and self.paused:
            assert self.proc is not None
            os.kill(self.proc.pid, signal.SIGCONT)
            self.paused = False

    def restart(self, timeout: float = 10.0) -> RedisServer:
        """Kill (if running) and start again on the same port; the data is gone."""
        self.kill()
        deadline = time.monotonic() + timeout
        while not _port_free(self.port, reuse=True) and time.monotonic() < deadline:
            time.sleep(0.05)
        self._fixed_port = True
        return self.start(timeout)

    # ---- a synchronous command channel ---------------------------------------------------------
    def _connect(self, timeout: float) -> socket.socket:
        sock = socket.create_connection((self.host, self.port), timeout=timeout)
        if self.tls is not None:
            ctx = ssl.create_default_context(cafile=self.tls.ca_cert)
            ctx.check_hostname = False
            sock = ctx.wrap_socket(sock, server_hostname=self.host)
        return sock

    def command(self, *args: Any, timeout: float = 5.0) -> Any:
        """Run one command on a fresh connection (authenticating first); errors are raised."""
        with self._connect(timeout) as sock:
            reader = _Reader(sock)
            if self.password is not None:
                auth = ("AUTH", self.username, self.password) if self.username else ("AUTH", self.password)
                sock.sendall(_encode(auth))
                r = reader.reply()
                if isinstance(r, Exception):
                    raise r
            sock.sendall(_encode(args))
            reply = reader.reply()
        if isinstance(reply, Exception):
            raise reply
        return reply

    def __repr__(self) -> str:
        state = "paused" if self.paused else ("running" if self.alive else "stopped")
        return f"RedisServer(port={self.port}, {state}, binary={Path(self.binary).name})"


# ---- a cluster ------------------------------------------------------------------------------------
class RedisClusterServers(_Started):
    """``n`` cluster-mode servers (primaries only) with the slots split evenly between them."""

    def __init__(
        self,
        n: int = 3,
        binary: str | None = None,
        *,
        password: str | None = None,
        workdir: str | os.PathLike[str] | None = None,
    ) -> None:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        self._own_dir = workdir is None
        self.workdir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="lmcache-async-cluster-"))
        self.password = password
        self.nodes = [
            RedisServer(binary, password=password, cluster=True, workdir=self.workdir / f"node{i}") for i in range(n)
        ]

    @property
    def url(self) -> str:
        auth = f":{quote(self.password, safe='')}@" if self.password is not None else ""
        return "redis+cluster://" + auth + ",".join(f"{s.host}:{s.port}" for s in self.nodes)

    def start(self, timeout: float = 30.0) -> RedisClusterServers:
        """Start the nodes, assign slots, join them and wait for ``cluster_state:ok``."""
        deadline = time.monotonic() + timeout
        for srv in self.nodes:
            srv.start(timeout)
        n = len(self.nodes)
        for i, srv in enumerate(self.nodes):
            if "cluster_state:ok" in self.info(srv):
                continue
            with contextlib.suppress(ServerError):
                srv.command("CLUSTER", "SET-CONFIG-EPOCH", i + 1)
            lo, hi = i * CLUSTER_SLOTS // n, (i + 1) * CLUSTER_SLOTS // n - 1
            with contextlib.suppress(ServerError):  # already assigned on a restart
                srv.command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
        first = self.nodes[0]
        for srv in self.nodes[1:]:
            first.command("CLUSTER", "MEET", srv.host, srv.port)
        self.wait_ok(max(0.5, deadline - time.monotonic()))
        return self

    @staticmethod
    def info(srv: RedisServer) -> str:
        reply = srv.command("CLUSTER", "INFO")
        return reply.decode() if isinstance(reply, bytes) else str(reply)

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Wait until every running node reports ``cluster_state:ok`` and knows all others."""
        deadline = time.monotonic() + timeout
        want = f"cluster_known_nodes:{len(self.nodes)}"
        while True:
            try:
                infos = [self.info(s) for s in self.nodes if s.alive]
                if infos and all("cluster_state:ok" in i and want in i for i in infos):
                    return
            except (OSError, ServerError):
                pass
            if time.monotonic() > deadline:
                raise ServerError(f"cluster not ready after {timeout}s")
            time.sleep(0.05)

    def stop(self) -> None:
        for srv in self.nodes:
            srv.stop()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def kill(self) -> None:
        for srv in self.nodes:
            srv.kill()

    def restart(self, timeout: float = 30.0) -> RedisClusterServers:
        """Restart every node on its port (the cluster configuration survives; data does not)."""
        for srv in self.nodes:
            srv.restart(timeout)
        self.wait_ok(timeout)
        return self


def server_supports_tls(binary: str) -> bool:
    """True when ``binary`` was built with TLS (it accepts ``--tls-port``)."""
    with tempfile.TemporaryDirectory(prefix="lmcache-async-tlsprobe-") as d:
        files = make_tls_files(d)
        if files is None:
            return False
        srv = RedisServer(binary, tls=files, workdir=d)
        try:
            srv.start(timeout=10.0)
        except ServerError:
            return False
        finally:
            srv.stop()
    return True
