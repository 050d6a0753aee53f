"""Admission to the node cache server: who may join which namespace, and the handshake's bytes.

:class:`Admission` decides, from the peer's kernel credentials (``SO_PEERCRED``) and the token it
presents, whether it may join a namespace (or open a status connection), and if not why:
``NOT_ALLOWED`` when its uid/gid is not bound to the namespace, ``BAD_TOKEN`` when it is but the
token is wrong. :func:`read_hello` reads and checks a client's HELLO, :func:`send_welcome`
answers it, and :func:`answer_full` refuses a connection past the server's connection cap so
that the client always reads the refusal (it reads the hello first, then closes gracefully).

Nothing here keeps connections or touches the event loop's state: :mod:`~lmcache_async.server.server`
calls these on its loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import socket
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lmcache_async.server.policies import NamespacePolicy
from lmcache_async.server.protocol import (
    HELLO,
    MAGIC,
    MAX_NAMESPACE_BYTES,
    MAX_TOKEN_BYTES,
    VERSION,
    WELCOME,
    Mode,
    ProtocolError,
    Status,
)
from lmcache_async.server.shm import HEADER_BYTES

if TYPE_CHECKING:
    from lmcache_async.server.namespace import Namespace

__all__ = [
    "HELLO_WAIT_S",
    "OVER_CAP_PENDING",
    "STATUS_RESERVE",
    "Admission",
    "Hello",
    "WelcomeLimits",
    "answer_full",
    "peer_credentials",
    "read_hello",
    "send_welcome",
]

#: Status connections of the server's own user (or root) let in past the connection cap, so an
#: operator can inspect a full server.
STATUS_RESERVE = 2
#: How long a connection past the cap is given to send its hello before it is answered FULL.
HELLO_WAIT_S = 1.0
#: Connections past the cap waiting for their hello (beyond the status reserve) at once; more
#: are answered FULL without reading their hello (the client still reads that answer).
OVER_CAP_PENDING = 16

_PEERCRED = struct.Struct("3i")


@dataclass(frozen=True, slots=True)
class Hello:
    """A client's HELLO: protocol ``version``, ``mode`` (a :class:`Mode` value), the namespace's
    name and the token, as sent."""

    version: int
    mode: int
    namespace: bytes
    token: bytes

    def name(self) -> str | None:
        """The namespace's name; None when it is empty, not UTF-8 or holds control characters."""
        try:
            name = self.namespace.decode("utf-8")
        except UnicodeDecodeError:
            return None
        if not name or any(ord(c) < 32 for c in name):
            return None
        return name


@dataclass(frozen=True, slots=True)
class WelcomeLimits:
    """The per-client limits every WELCOME carries."""

    max_leases: int
    max_grants: int
    lease_ttl_s: float


class Admission:
    """Who may join what: ``policies`` by namespace name (:class:`NamespacePolicy`), the server's
    ``token`` (None: none) and the server's own ``uid``. Unbound namespaces (and status
    connections that no binding admits) admit that uid and root only."""

    def __init__(self, policies: dict[str, NamespacePolicy], token: str | None, uid: int) -> None:
        self.policies = policies
        self.token = token
        self.uid = uid

    def uid_allowed(self, name: str, uid: int, gid: int) -> bool:
        """Whether a peer of ``uid``/``gid`` is bound to namespace ``name`` (root always is)."""
        pol = self.policies.get(name)
        if pol is None or not (pol.uids or pol.gids):
            return uid in (self.uid, 0)
        return uid == 0 or uid in pol.uids or gid in pol.gids

    def token_ok(self, name: str, token: bytes) -> bool:
        """Whether ``token`` is the one namespace ``name`` wants (its own, else the server's)."""
        pol = self.policies.get(name)
        want = pol.token if pol is not None and pol.token is not None else self.token
        return want is None or hmac.compare_digest(token, want.encode())

    def admits(self, name: str, uid: int, gid: int, token: bytes) -> bool:
        """Whether a peer of ``uid``/``gid`` presenting ``token`` may join (and see) ``name``."""
        return self.uid_allowed(name, uid, gid) and self.token_ok(name, token)

    def refusal(self, name: str, uid: int, gid: int, token: bytes) -> Status | None:
        """None when the peer may join ``name``; else ``NOT_ALLOWED`` (its uid/gid is not bound
        to it, whatever the token) or ``BAD_TOKEN`` (bound, but the token is wrong)."""
        if not self.uid_allowed(name, uid, gid):
            return Status.NOT_ALLOWED
        return None if self.token_ok(name, token) else Status.BAD_TOKEN

    def status_refusal(self, uid: int, gid: int, token: bytes) -> Status | None:
        """None when the peer may open a status connection (our user or root with the server's
        token, or a peer some bound namespace admits: it then sees only those); else
        ``NOT_ALLOWED`` when no namespace binds its uid/gid, ``BAD_TOKEN`` when one does."""
        names = ["", *self.policies]
        allowed = [n for n in names if self.uid_allowed(n, uid, gid)]
        if not allowed:
            return Status.NOT_ALLOWED
        return None if any(self.token_ok(n, token) for n in allowed) else Status.BAD_TOKEN

    def may_use_reserve(self, uid: int) -> bool:
        """Whether a status connection of ``uid`` may use the reserve past the connection cap
        (:data:`STATUS_RESERVE`): the server's own user and root only."""
        return uid in (self.uid, 0)


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(uid, gid, pid) of the peer of ``sock`` (-1, -1, 0 when the kernel cannot tell)."""
    try:
        pid, uid, gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    except OSError:
        return -1, -1, 0
    return uid, gid, pid


async def _recv_exact(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = await loop.sock_recv(sock, n - len(buf))
        if not chunk:
            raise EOFError("peer closed during the handshake")
        buf += chunk
    return bytes(buf)


async def read_hello(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> Hello:
    """The HELLO on the non-blocking ``sock``; ``ProtocolError`` for a bad magic, mode or sizes,
    ``EOFError`` when the peer closes first. Unbounded: callers bound it with a timeout."""
    magic, version, mode, ns_len, tok_len = HELLO.unpack(await _recv_exact(loop, sock, HELLO.size))
    if magic != MAGIC:
        raise ProtocolError("bad handshake magic")
    if ns_len > MAX_NAMESPACE_BYTES or tok_len > MAX_TOKEN_BYTES or mode not in (Mode.CLIENT, Mode.STATUS):
        raise ProtocolError("bad handshake fields")
    rest = await _recv_exact(loop, sock, ns_len + tok_len)
    return Hello(version, mode, rest[:ns_len], rest[ns_len:])


def send_welcome(sock: socket.socket, status: Status, ns: Namespace | None, limits: WelcomeLimits) -> None:
    """Answer a hello with ``status``; with ``ns``, its pool's size and memfd (SCM_RIGHTS).

    A fresh socket's send buffer is empty, so this small message never blocks."""
    msg = WELCOME.pack(
        MAGIC,
        VERSION,
        int(status),
        ns.generation if ns is not None else 0,
        ns.pool.capacity if ns is not None else 0,
        HEADER_BYTES,
        ns.pool.align if ns is not None else 0,
        limits.max_leases,
        limits.max_grants,
        int(limits.lease_ttl_s * 1000),
    )
    if ns is not None:
        socket.send_fds(sock, [msg], [ns.pool.fd])
    else:
        sock.send(msg)


def answer_full(sock: socket.socket, limits: WelcomeLimits) -> None:
    """Answer FULL and close ``sock``, ending our side's writing first so the client reads the
    answer before it sees the end (errors of a peer that went away are ignored)."""
    with contextlib.suppress(OSError):
        send_welcome(sock, Status.FULL, None, limits)
        sock.shutdown(socket.SHUT_WR)
    with contextlib.suppress(OSError):
        sock.close()
