"""A Mooncake Store (metadata server, master, segment holder) on loopback for tests and
benchmarks; see :mod:`lmcache_async.testing.servers`."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Any

from lmcache_async.testing.server_support import ServerError, _port_free, _Started, free_port

__all__ = ["MooncakeServers", "is_loopback_listener", "loopback_shim", "mooncake_binaries", "tcp_listeners"]

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
