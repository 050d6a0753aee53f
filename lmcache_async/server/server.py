"""The node cache server: one asyncio process serving every cache client on the machine.

``CacheServer`` listens on a Unix socket (0600, in a 0700 directory it owns), admits clients of
one namespace each (optional shared token), hands them that namespace's shared pool as a
memfd, then answers batched control messages (:mod:`lmcache_async.server.protocol`).

Thread affinity: everything runs on the server's event loop; a request is handled to the end
before the next one of the same connection is read. Trouble on one connection (a malformed or
hostile message, a client that vanished) closes that connection only and reclaims what it held.

Trust model: the socket's mode admits processes of the server's user (root too), and the peer
uid is checked again with ``SO_PEERCRED``. A namespace may be bound to other Unix users or groups
and/or a token of its own (``cache_server_namespaces``): then only those peers join it (the socket
is then reachable by every user; the peer check decides). Clients admitted to a namespace map its
whole pool writable, so they can overwrite that namespace's committed entries; they never receive
another namespace's pool, and they see, clear and write only their own namespace. Processes of one
uid are one trust domain (they can read each other's memory). Every offset, size, count and key a
client sends is checked before it is used; a client can only release its own leases and commit its
own grants.

Limits: a connection cap (``cache_server_max_connections``: beyond it a client is answered FULL
once its hello is read; status connections of our user or root have a small reserve past it),
a timeout on partial frames and on idle connections, and a server-wide bound on the bytes of
partial frames held (a connection over it stops being read until others drain). Namespaces with
no client are released after ``cache_server_namespace_idle_s`` (at once when they hold nothing and
a new namespace needs the slot).

Layout: this module accepts and serves connections; each request's handler is
:mod:`~lmcache_async.server.ops`'s, who may join a namespace :mod:`~lmcache_async.server.policies`'
and :mod:`~lmcache_async.server.admission`'s (which also reads and answers the handshake), and
where the socket lives :mod:`~lmcache_async.server.socket_dir`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import resource
import signal
import socket
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from lmcache_async.ratelog import RateLimitedLog
from lmcache_async.server.admission import (
    HELLO_WAIT_S,
    OVER_CAP_PENDING,
    STATUS_RESERVE,
    Admission,
    Hello,
    WelcomeLimits,
    answer_full,
    peer_credentials,
    read_hello,
    send_welcome,
)
from lmcache_async.server.frames import MAY_WAIT, Conn, FrameProtocol
from lmcache_async.server.growth import PoolGrowth, check_pool_size
from lmcache_async.server.lower import LowerStore, wants_lower_tiers
from lmcache_async.server.namespace import Namespace
from lmcache_async.server.ops import RequestHandlers
from lmcache_async.server.policies import NamespacePolicy, parse_namespace_policies
from lmcache_async.server.protocol import REFUSALS, VERSION, Mode, Op, ProtocolError, Reader, Status
from lmcache_async.server.socket_dir import default_socket_path, prepare_socket_dir

if TYPE_CHECKING:
    from lmcache_async.config import LMCacheEngineConfig
    from lmcache_async.server.events import ServerEvents

__all__ = [
    "STATUS_RESERVE",
    "CacheServer",
    "NamespacePolicy",
    "default_socket_path",
    "parse_namespace_policies",
    "prepare_socket_dir",
]

logger = logging.getLogger(__name__)

_HANDSHAKE_TIMEOUT_S = 5.0


class CacheServer:
    """Serves namespaces of shared pools over a Unix socket; see the module docstring.

    ``config`` gives the pool size per namespace (``max_local_cpu_size`` GiB) and the
    ``cache_server_*`` limits. :meth:`serve` runs until :meth:`stop` (or SIGTERM in
    :func:`run_server`); it must run on the loop that owns this object.
    """

    def __init__(
        self, config: LMCacheEngineConfig, socket_path: str | os.PathLike[str], events: ServerEvents | None = None
    ) -> None:
        """``events``: publishes the pool's KV events (``serve --events``; None: none)."""
        from lmcache_async.memory import gib_to_bytes

        self.config = config
        self.events = events
        self.socket_path = Path(socket_path)
        self.pool_bytes = gib_to_bytes(config.max_local_cpu_size)
        if self.pool_bytes <= 0:
            raise ValueError("max_local_cpu_size must be > 0 GiB for the cache server's pools")
        reserve = None if config.memory_reserve_size is None else gib_to_bytes(config.memory_reserve_size)
        check_pool_size(self.pool_bytes, reserve)  # one that can never fit is refused at start
        self.token = config.cache_server_token
        self.lease_ttl_s = float(config.cache_server_lease_ttl_s)
        self.max_leases = int(config.cache_server_max_leases)
        self.max_grants = int(config.cache_server_max_grants)
        self.max_namespaces = int(config.cache_server_max_namespaces)
        self.max_holds = int(config.cache_server_max_holds)
        self.max_client_holds = int(config.cache_server_max_client_holds)
        self.max_namespace_leases = int(config.cache_server_max_namespace_leases)
        self.max_pinned_fraction = float(config.cache_server_max_pinned_fraction)
        self.namespace_idle_s = float(config.cache_server_namespace_idle_s)
        self.max_connections = int(config.cache_server_max_connections)
        self.idle_timeout_s = float(config.cache_server_idle_timeout_s)
        self.frame_timeout_s = float(config.cache_server_frame_timeout_s)
        #: Bytes of partial frames all connections together may hold (see FrameProtocol).
        self.max_buffered = int(config.cache_server_max_buffered_bytes)
        self.buffered = 0
        self._budget_waiting: set[FrameProtocol] = set()
        self.policies = parse_namespace_policies(config.cache_server_namespaces)
        self._uid = os.getuid()
        #: Who may join what (the namespaces' uid/gid bindings and tokens).
        self.admission = Admission(self.policies, self.token, self._uid)
        self._welcome = WelcomeLimits(self.max_leases, self.max_grants, self.lease_ttl_s)
        #: Whether a namespace admits users other than ours (the socket is then open to all).
        self.shared_socket = any((p.uids - {self._uid}) or p.gids for p in self.policies.values())
        self._reserve = None if config.memory_reserve_size is None else gib_to_bytes(config.memory_reserve_size)
        #: Commits the namespace pools step by step as they fill (see growth.py).
        self.growth = PoolGrowth(self._reserve)
        self.namespaces: dict[str, Namespace] = {}
        self.lower: LowerStore | None = LowerStore(config) if wants_lower_tiers(config) else None
        self._conns: dict[int, Conn] = {}
        self._protos: dict[int, FrameProtocol] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        #: Connections past the cap: waiting for their hello, or status ones in the reserve.
        self._over: set[asyncio.Task[None]] = set()
        self._reserve_used = 0
        self._ids = itertools.count(1)
        self._listener: socket.socket | None = None
        self._stopping: asyncio.Event | None = None
        self._log = RateLimitedLog(logger)
        self.started = time.time()
        self.protocol_errors = 0
        self.rejected = 0
        self.connections_total = 0
        self.refused_connections = 0
        self.timed_out_connections = 0
        self.reclaimed_namespaces = 0
        #: The handler of each request op (:mod:`lmcache_async.server.ops`).
        self.handlers = RequestHandlers(self)

    # ---- lifecycle -----------------------------------------------------------------------------
    def bind(self) -> None:
        """Create the listening socket (mode 0600). Call before :meth:`serve`."""
        path = prepare_socket_dir(self.socket_path, shared=self.shared_socket)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            sock.bind(str(path))
            # Other users bound to a namespace must be able to connect; SO_PEERCRED decides.
            os.chmod(path, 0o666 if self.shared_socket else 0o600)
        except OSError as exc:
            sock.close()
            raise ValueError(f"cannot create the socket {path}: {exc.strerror or exc}") from None
        finally:
            os.umask(old)
        sock.listen(256)
        sock.setblocking(False)
        self._listener = sock

    async def serve(self) -> None:
        """Accept and serve until :meth:`stop`; then close every connection and namespace."""
        if self._listener is None:
            self.bind()
        assert self._listener is not None
        loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        if self.events is not None:
            self.events.start(loop)
        sweeper = asyncio.ensure_future(self._sweep())
        accept = asyncio.ensure_future(self._accept_loop(loop, self._listener))
        try:
            await self._stopping.wait()
        finally:
            accept.cancel()
            sweeper.cancel()
            for t in (accept, sweeper):
                with contextlib.suppress(asyncio.CancelledError):
                    await t
            await self._shutdown()

    def stop(self) -> None:
        """Stop accepting and end :meth:`serve` (call on the server's loop)."""
        if self._stopping is not None:
            self._stopping.set()

    async def _shutdown(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            with contextlib.suppress(OSError):
                self.socket_path.unlink()
        tasks = [*self._tasks, *self._over]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.lower is not None:  # flush the write-through (bounded) before the pools go
            try:
                await self.lower.close()
            except Exception as exc:
                logger.warning("cache server: closing the lower tiers failed: %s: %s", type(exc).__name__, exc)
        self.growth.close()
        for ns in self.namespaces.values():
            ns.close()
        self.namespaces.clear()

    async def _sweep(self) -> None:
        limits = [self.lease_ttl_s, self.frame_timeout_s, self.idle_timeout_s, self.namespace_idle_s]
        interval = min(1.0, *(t / 4 for t in limits if t > 0))
        while True:
            await asyncio.sleep(interval)
            self.sweep_once()

    def sweep_once(self) -> None:
        """Expire leases, holds and quarantined grants; close connections stalled inside a
        frame or idle past their timeouts; release namespaces nobody uses."""
        for ns in self.namespaces.values():
            ns.expire()
        if self.events is not None:
            self.events.tick()
        now = time.monotonic()
        for proto in list(self._protos.values()):
            why = proto.stalled(now, self.frame_timeout_s, self.idle_timeout_s)
            if why is not None:
                self.timed_out_connections += 1
                self._log.warning("cache server: closing a connection %s", why, key="timeout")
                proto.close_by_server()
        for name in [n for n, ns in self.namespaces.items() if ns.reclaimable(self.namespace_idle_s)]:
            self._release_namespace(name)

    def _release_namespace(self, name: str) -> None:
        ns = self.namespaces.pop(name)
        ns.close()
        self.reclaimed_namespaces += 1
        logger.info("cache server: namespace %r released (no clients)", name)

    # ---- the bound on partial-frame bytes (called by FrameProtocol) ----------------------------------
    def buffer_wait(self, proto: FrameProtocol) -> None:
        """``proto`` holds partial-frame bytes past the server-wide bound: it is not read until
        others drain (see :meth:`buffer_drained`)."""
        self._budget_waiting.add(proto)

    def buffer_drained(self, proto: FrameProtocol | None = None) -> None:
        """Partial-frame bytes were freed: let waiting connections read again while the bound holds."""
        if proto is not None:
            self._budget_waiting.discard(proto)
        while self._budget_waiting and self.buffered <= self.max_buffered:
            self._budget_waiting.pop().resume_budget()

    async def _accept_loop(self, loop: asyncio.AbstractEventLoop, listener: socket.socket) -> None:
        while True:
            try:
                conn, _ = await loop.sock_accept(listener)
            except asyncio.CancelledError:
                raise
            except OSError as exc:  # e.g. out of descriptors: back off, keep serving the others
                self._log.warning("cache server: accept failed: %s", exc, key="accept")
                await asyncio.sleep(0.05)
                continue
            if len(self._tasks) < self.max_connections:
                tasks, task = self._tasks, asyncio.ensure_future(self._handle(loop, conn))
            elif len(self._over) < OVER_CAP_PENDING + STATUS_RESERVE:
                tasks, task = self._over, asyncio.ensure_future(self._over_cap(loop, conn))
            else:  # too many waiting already: answered without reading its hello (the client reads it)
                self._refuse_full(conn)
                continue
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    async def _over_cap(self, loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
        """A connection past the cap: its hello is read (for at most :data:`HELLO_WAIT_S`) before
        it is answered FULL, so the client's send never meets a closed socket; a status connection
        of our user or root is served within the reserve (:data:`STATUS_RESERVE`) instead."""
        try:
            hello: Hello | None = await asyncio.wait_for(read_hello(loop, sock), HELLO_WAIT_S)
        except (OSError, EOFError, ProtocolError, TimeoutError):
            hello = None
        except asyncio.CancelledError:
            sock.close()
            raise
        uid = peer_credentials(sock)[0]
        if (
            hello is None
            or hello.mode != Mode.STATUS
            or self._reserve_used >= STATUS_RESERVE
            or (not self.admission.may_use_reserve(uid))
        ):
            self._refuse_full(sock)
            return
        self._reserve_used += 1
        try:
            await self._handle(loop, sock, hello)
        finally:
            self._reserve_used -= 1

    def _refuse_full(self, sock: socket.socket) -> None:
        self.refused_connections += 1
        self._log.warning("cache server: %d connections, refusing one more", len(self._tasks), key="cap")
        answer_full(sock, self._welcome)

    # ---- one connection --------------------------------------------------------------------------
    async def _handle(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, hello: Hello | None = None) -> None:
        """Admit and serve one connection until it closes (``hello``: already read)."""
        conn: Conn | None = None
        proto: FrameProtocol | None = None
        try:
            conn = await asyncio.wait_for(self._handshake(loop, sock, hello), _HANDSHAKE_TIMEOUT_S)
            if conn is None:
                return
            if conn.ns is not None:  # client connections only: status queries are not counted
                self.connections_total += 1
            self._conns[conn.ident] = conn
            closed: asyncio.Future[None] = loop.create_future()
            proto = FrameProtocol(self, conn, closed)
            self._protos[conn.ident] = proto
            await loop.connect_accepted_socket(lambda: proto, sock=sock)
            await closed
        except asyncio.CancelledError:
            raise
        except ProtocolError as exc:
            self.protocol_errors += 1
            self._log.warning("cache server: closing a connection after a malformed message: %s", exc, key="proto")
        except (OSError, asyncio.IncompleteReadError, TimeoutError, EOFError):
            pass  # the client went away or stalled: reclaimed below
        except Exception as exc:  # never let one connection take the server down
            self._log.warning("cache server: connection failed: %s: %s", type(exc).__name__, exc, key="conn")
        finally:
            if proto is not None:
                proto.shut()  # before the reclaim: a request still running must not touch its state
            if conn is not None:
                self._conns.pop(conn.ident, None)
                self._protos.pop(conn.ident, None)
                if conn.ns is not None and conn.state is not None:
                    # Grants of a client that closed its own side are free; of one the server
                    # closed, they wait for its process to exit (it may be copying into them).
                    conn.ns.drop_client(conn.state, writer_gone=proto is None or proto.peer_closed)
            with contextlib.suppress(OSError):
                sock.close()

    def admits(self, name: str, uid: int, gid: int, token: bytes) -> bool:
        """Whether a peer of ``uid``/``gid`` presenting ``token`` may join (and see) namespace
        ``name`` (see :class:`~lmcache_async.server.admission.Admission`)."""
        return self.admission.admits(name, uid, gid, token)

    async def _handshake(
        self, loop: asyncio.AbstractEventLoop, sock: socket.socket, hello: Hello | None = None
    ) -> Conn | None:
        """Read the hello (unless given), decide and answer it: the admitted connection, or None
        after a refusal was sent. ``ProtocolError`` for a malformed hello."""
        uid, gid, pid = peer_credentials(sock)
        if hello is None:
            hello = await read_hello(loop, sock)
        status: Status | None = None
        ns: Namespace | None = None
        name = hello.name()
        if hello.version != VERSION:
            status = Status.BAD_VERSION
        elif hello.mode == Mode.STATUS:
            status = self.admission.status_refusal(uid, gid, hello.token)
        elif name is None:
            status = Status.BAD_NAMESPACE
        else:
            status = self.admission.refusal(name, uid, gid, hello.token)
            if status is None and (ns := self.namespaces.get(name)) is None:
                ns, status = self._new_namespace(name)
        if status is not None and status is not Status.OK:
            self.rejected += 1
            logger.info(
                "cache server: refused pid %d (uid %d, namespace %r): %s",
                pid, uid, hello.namespace.decode("utf-8", "replace"), REFUSALS.get(status, status.name),
            )  # fmt: skip
            self._send_welcome(sock, status, None)
            return None
        ident = next(self._ids)
        if ns is not None:
            logger.info("cache server: admitted pid %d (uid %d) to namespace %r", pid, uid, ns.name)
        state = ns.add_client(ident, pid) if ns is not None else None
        try:
            self._send_welcome(sock, Status.OK, ns)
        except BaseException:
            if ns is not None and state is not None:
                ns.drop_client(state)
            raise
        return Conn(ident, ns, state, uid, pid, gid, hello.token)

    def _new_namespace(self, name: str) -> tuple[Namespace | None, Status]:
        """A new namespace (its pool created) and OK; or None and why not: the server holds its
        cap of them and none can be released (an unused one holding no entry is released for
        it), or its pool could not be created (logged)."""
        if len(self.namespaces) >= self.max_namespaces:
            victims = [n for n, ns in self.namespaces.items() if not len(ns) and ns.reclaimable(0.0)]
            if not victims:
                return None, Status.TOO_MANY_NAMESPACES
            self._release_namespace(victims[0])
        try:
            ns = Namespace(
                name,
                self.pool_bytes,
                lease_ttl_s=self.lease_ttl_s,
                max_leases=self.max_leases,
                max_grants=self.max_grants,
                max_holds=self.max_holds,
                max_client_holds=self.max_client_holds,
                max_namespace_leases=self.max_namespace_leases,
                max_pinned_fraction=self.max_pinned_fraction,
                reserve_bytes=self._reserve,
                pretouch=bool(self.config.cache_server_pretouch),
                committed_bytes=0,
                listener=self.events,
            )
        except (OSError, ValueError) as exc:
            self._log.warning("cache server: cannot create the pool of namespace %r: %s", name, exc, key="ns")
            return None, Status.NO_POOL
        self.namespaces[name] = ns
        self.growth.maybe_grow(ns.pool)  # the first step, in the background
        logger.info(
            "cache server: namespace %r created (%d bytes, generation %x)", name, ns.pool.capacity, ns.generation
        )
        return ns, Status.OK

    def _send_welcome(self, sock: socket.socket, status: Status, ns: Namespace | None) -> None:
        send_welcome(sock, status, ns, self._welcome)

    def dispatch_now(self, conn: Conn, op: Op, r: Reader) -> bytes | None:
        """:meth:`dispatch` run to its end on the caller's stack; only for requests that
        :meth:`needs_task` says never wait (no lower tiers involved)."""
        coro = self.dispatch(conn, op, r)
        try:
            coro.send(None)
        except StopIteration as stop:
            answer: bytes | None = stop.value
            return answer
        coro.close()
        raise RuntimeError(f"{op.name} waited on the event loop on the direct path")

    def fast_handlers(self) -> dict[int, Callable[[Conn, Reader], bytes | None]]:
        """Handlers of the hot requests that never wait, by op code, for the connection's fast
        path (:meth:`RequestHandlers.fast <lmcache_async.server.ops.RequestHandlers.fast>`)."""
        return self.handlers.fast()

    def needs_task(self, op: Op, conn: Conn | None = None) -> bool:
        """True when a request of ``op`` on ``conn`` may wait and so runs as a task: on the lower
        tiers, or a GRANT while its namespace's pool is short of committed room (it may wait for
        the pool to grow)."""
        if self.lower is not None and op in MAY_WAIT:
            return True
        ns = conn.ns if conn is not None else None
        return op is Op.GRANT and ns is not None and self.growth.short(ns.pool)

    # ---- operations ---------------------------------------------------------------------------------
    def dispatch(self, conn: Conn, op: Op, r: Reader) -> Coroutine[Any, Any, bytes | None]:
        """The coroutine of the handler :attr:`handlers` has for ``op``: the answer body of a
        request of ``op`` on ``conn`` (None: not answered); see :mod:`lmcache_async.server.ops`."""
        return self.handlers.dispatch(conn, op, r)

    # ---- figures ------------------------------------------------------------------------------------
    def stats(self, conn: Conn | None = None) -> dict[str, Any]:
        """Tiers, clients, namespaces (entries, bytes, hit rates, leases) of this server; asked
        on connection ``conn``, only the namespaces that connection's peer may join."""
        names = [n for n in self.namespaces if conn is None or self.admits(n, conn.uid, conn.gid, conn.token)]
        return {
            "pid": os.getpid(),
            "socket": str(self.socket_path),
            "uptime_s": round(time.time() - self.started, 3),
            "tiers": ["shm", *(self.lower.tier_names if self.lower is not None else [])],
            "lower": self.lower.stats() if self.lower is not None else None,
            "pool_bytes_per_namespace": self.pool_bytes,
            "pool_growth_steps": self.growth.steps,
            "pool_growth_refused": self.growth.refused,
            "clients": sum(c.ns is not None for c in self._conns.values()),  # status connections not counted
            "connections_total": self.connections_total,
            "rejected": self.rejected,
            "refused_connections": self.refused_connections,
            "timed_out_connections": self.timed_out_connections,
            "reclaimed_namespaces": self.reclaimed_namespaces,
            "buffered_bytes": self.buffered,
            "protocol_errors": self.protocol_errors,
            "lease_ttl_s": self.lease_ttl_s,
            "namespaces": {name: self.namespaces[name].stats() for name in names},
            "events": self.events.stats() if self.events is not None else None,
        }


def run_server(
    config: LMCacheEngineConfig,
    socket_path: str | os.PathLike[str],
    events_endpoint: str | None = None,
    on_listening: Callable[[str, int, int], None] | None = None,
) -> int:
    """Run a server in the foreground until SIGTERM or SIGINT; returns the exit status (0).

    Uses uvloop when it is installed, unless ``LMCACHE_ASYNC_SERVER_LOOP=asyncio``
    (``uvloop`` there requires it). Logs go to the root logger (stderr under the CLI).
    ``events_endpoint``: publish the pools' KV events there (:mod:`lmcache_async.server.events`).
    ``on_listening(socket_path, pid, pool_bytes)``: called once the socket accepts clients, on
    the server's loop (None: nobody is told).
    """
    events = None
    if events_endpoint is not None:
        from lmcache_async.server.events import ServerEvents

        events = ServerEvents(events_endpoint)
    try:
        return _run(CacheServer(config, socket_path, events), on_listening)
    finally:
        if events is not None:
            events.close()


def _run(server: CacheServer, on_listening: Callable[[str, int, int], None] | None = None) -> int:
    """Bind ``server`` and serve it in the foreground (see :func:`run_server`)."""
    _raise_descriptor_limit(server.max_connections)
    server.bind()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, server.stop)
        logger.info(
            "cache server listening on %s (pid %d, pools of up to %.2f GiB per namespace, committed as they fill)",
            server.socket_path,
            os.getpid(),
            server.pool_bytes / (1 << 30),
        )
        if on_listening is not None:
            on_listening(str(server.socket_path), os.getpid(), server.pool_bytes)
        await server.serve()
        logger.info("cache server stopped")

    factory = event_loop_factory(os.environ.get(LOOP_ENV, "auto"))
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main())
    return 0


def _raise_descriptor_limit(connections: int) -> None:
    """Raise the soft descriptor limit to the hard one, so the connection cap (one descriptor
    per connection, one per namespace pool, a few more) is reached before the descriptor limit;
    log when it still is not."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    if soft != resource.RLIM_INFINITY and connections + 64 > soft:
        logger.warning(
            "cache server: %d descriptors allowed, cache_server_max_connections is %d: clients past the "
            "descriptor limit get misses", soft, connections,
        )  # fmt: skip


LOOP_ENV = "LMCACHE_ASYNC_SERVER_LOOP"
"""Which event loop ``lmcache-async serve`` runs: ``auto`` (uvloop when installed), ``uvloop``
or ``asyncio``."""


def event_loop_factory(kind: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The loop factory for ``kind`` (None: asyncio's default loop). ``ValueError`` naming
    :data:`LOOP_ENV` for another value, or for ``uvloop`` when it is not installed."""
    if kind not in ("auto", "uvloop", "asyncio"):
        raise ValueError(f"{LOOP_ENV} must be auto, uvloop or asyncio, got {kind!r}")
    if kind == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if kind == "uvloop":
            raise ValueError(f"{LOOP_ENV}=uvloop but uvloop is not installed") from None
        return None
    return cast("Callable[[], asyncio.AbstractEventLoop]", uvloop.new_event_loop)
