"""One blocking connection to the node cache server: handshake, pool mapping, request/answer.

Used under :class:`~lmcache_async.server.client.ServerClient`'s lock (one request at a time per
connection); nothing here retries, counts or logs: callers turn the exceptions into misses.

* :func:`connect` checks who serves the socket (``SO_PEERCRED``: the peer's uid must be ours or
  the one configured) before it sends anything, runs the handshake and maps the namespace pool
  handed over as a memfd; ``ServerUnavailable`` when the server is not who we expect, refuses us
  or answers something else, ``OSError`` when it cannot be reached, all bounded by the deadline.
  A server that refused us before reading our hello (its connection cap) is still heard: when
  the hello cannot be sent, its answer is read and its refusal raised.
* :func:`exchange` sends one request (after any unanswered frames) and reads its answer;
  ``ConnectionError`` when the server closed the connection (a server that stopped or
  restarted), ``TimeoutError`` at the deadline, ``ProtocolError`` for an answer of another request.

After the handshake the socket is a plain blocking socket whose waits are bounded by the
kernel (``SO_RCVTIMEO``/``SO_SNDTIMEO``): a request is one ``send`` and, in the usual case, one
``recv_into`` of the whole answer, with no ``poll`` and no mode switch per call. The kernel
timeouts are re-armed only when a call's remaining time differs from them by more than
:data:`TIMEOUT_SLACK_S`, so a call waits at most that much past its deadline.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import socket
import struct
import time
from typing import NoReturn

import torch

from lmcache_async.server.protocol import (
    FRAME,
    HELLO,
    MAGIC,
    MAX_BODY,
    REFUSALS,
    VERSION,
    WELCOME,
    EntryMeta,
    Mode,
    ProtocolError,
    Status,
)
from lmcache_async.server.shm import PoolMapping

__all__ = [
    "TIMEOUT_SLACK_S",
    "Connection",
    "ServerUnavailable",
    "connect",
    "copy_bytes",
    "exchange",
    "peer_open",
    "send_frames",
    "server_uid_of",
]

#: How far past its deadline a blocking wait may end (the kernel timeouts are not re-armed
#: for every call; see the module docstring).
TIMEOUT_SLACK_S = 0.002

_TIMEVAL = struct.Struct("@ll")
_HEAD = FRAME.size


class ServerUnavailable(ConnectionError):
    """The server could not be reached or admitted us (internal; never leaves this module's callers)."""


class Connection:
    """One admitted connection and its pool mapping (used under the client's lock)."""

    def __init__(
        self, sock: socket.socket, mapping: PoolMapping | None, align: int, ttl_s: float, io_timeout_s: float = 2.0
    ) -> None:
        #: False once the connection was closed (a view taken on it is no longer backed by a lease).
        self.open = True
        self.sock = sock
        self.mapping = mapping
        self.align = max(align, 1)
        self.ttl_s = ttl_s
        self.seq = itertools.count(1)
        self.pid = os.getpid()
        self.grants: dict[int, list[tuple[int, int, float]]] = {}  # block size -> [(gid, offset, expiry)]
        #: No cached grant expires before this time (monotonic), so none needs returning yet.
        self.grants_checked_until = float("inf")
        #: Locations of entries READ told this connection: key -> (version, offset, metadata);
        #: valid while the pool's version table agrees (see :mod:`lmcache_async.server.shm`).
        self.where: dict[bytes, tuple[int, int, EntryMeta]] = {}
        #: Keys read from ``where`` since the last TOUCH (sent with the next request).
        self.touched: list[bytes] = []
        self.rbuf = bytearray(64 << 10)
        self.rview = memoryview(self.rbuf)
        self._armed = [-1.0, -1.0]  # the kernel's receive and send timeouts now set on the socket
        sock.settimeout(None)  # blocking; every wait bounded by the kernel timeouts armed below
        self.arm(socket.SO_RCVTIMEO, 0, max(io_timeout_s, 0.001))
        self.arm(socket.SO_SNDTIMEO, 1, max(io_timeout_s, 0.001))

    def arm(self, opt: int, slot: int, seconds: float) -> None:
        """Set the kernel timeout ``opt`` to ``seconds`` unless it is within the slack already."""
        if abs(self._armed[slot] - seconds) <= TIMEOUT_SLACK_S:
            return
        sec = int(seconds)
        usec = max(int((seconds - sec) * 1e6), 1 if sec == 0 else 0)
        self.sock.setsockopt(socket.SOL_SOCKET, opt, _TIMEVAL.pack(sec, usec))
        self._armed[slot] = seconds

    def block_size(self, nbytes: int) -> int:
        a = self.align
        return max(1, -(-nbytes // a)) * a

    def cached_grants(self) -> int:
        return sum(len(v) for v in self.grants.values())

    def close(self) -> None:
        """Close the socket (the server then reclaims this connection's leases and grants)."""
        self.open = False
        try:
            self.sock.close()
        except OSError:
            pass


_PEERCRED = struct.Struct("3i")


def server_uid_of(sock: socket.socket) -> int:
    """The uid of the process serving the connected Unix socket ``sock`` (``SO_PEERCRED``)."""
    _pid, uid, _gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return int(uid)


def connect(
    path: str,
    namespace: str,
    token: str | None,
    mode: Mode,
    deadline: float,
    io_timeout_s: float | None = None,
    server_uid: int | None = None,
) -> Connection:
    """Handshake on ``path`` and map the namespace pool (mode CLIENT) before ``deadline``.

    The server's uid must be ours or ``server_uid``; a socket served by anyone else (a
    user who created the socket's directory first) gets no token and no payload:
    ``ServerUnavailable``. ``io_timeout_s`` bounds each later blocking wait on the connection
    (default: the time left until ``deadline``); callers pass their per-call timeout.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        sock.connect(path)
        mine = os.getuid()
        got = server_uid_of(sock)
        if got != mine and got != server_uid:
            also = "" if server_uid is None or server_uid == mine else f" or {server_uid}"
            raise ServerUnavailable(f"{path} is served by uid {got}, not by uid {mine}{also} (nothing sent)")
        ns = namespace.encode("utf-8")
        tok = (token or "").encode("utf-8")
        try:
            sock.sendall(HELLO.pack(MAGIC, VERSION, int(mode), len(ns), len(tok)) + ns + tok)
        except (BrokenPipeError, ConnectionResetError) as exc:
            _raise_answer(sock, deadline, exc)  # a server that refused us before reading: its answer
        msg, fds = _recv_welcome(sock, deadline)
        try:
            gen, pool_bytes, data_off, align, ttl_ms = _check_welcome(msg)
            mapping = None
            if mode == Mode.CLIENT:
                if len(fds) != 1:
                    raise ServerUnavailable("no pool descriptor in the handshake")
                fd = fds.pop()
                try:
                    mapping = PoolMapping(fd, gen, pool_bytes, data_off, align)
                except ValueError as exc:
                    raise ServerUnavailable(str(exc)) from None
        finally:
            for fd in fds:
                os.close(fd)
        left = deadline - time.monotonic()
        return Connection(sock, mapping, align, ttl_ms / 1000.0, io_timeout_s if io_timeout_s else max(left, 0.001))
    except BaseException:
        sock.close()
        raise


def _recv_welcome(sock: socket.socket, deadline: float) -> tuple[bytes, list[int]]:
    """The server's WELCOME (at most its size) and the descriptors that came with it."""
    sock.settimeout(max(deadline - time.monotonic(), 0.001))
    msg, fds, _flags, _addr = socket.recv_fds(sock, WELCOME.size, 1)
    return msg, fds


def _raise_answer(sock: socket.socket, deadline: float, send_error: OSError) -> NoReturn:
    """Our hello could not be sent: raise the refusal the server sent before it closed (a
    server at its connection cap may answer FULL and close without reading), else ``send_error``."""
    try:
        msg, fds = _recv_welcome(sock, deadline)
    except OSError:
        raise send_error from None
    for fd in fds:
        os.close(fd)
    _check_welcome(msg)  # raises the refusal when there is one
    raise send_error


def _check_welcome(msg: bytes) -> tuple[int, int, int, int, int]:
    """(generation, pool_bytes, data_offset, align, lease_ttl_ms) of an OK WELCOME;
    ``ServerUnavailable`` saying why for a refusal or an answer that is not a WELCOME."""
    if len(msg) < 6:
        raise ServerUnavailable("short handshake answer")
    if msg[:4] != MAGIC:
        raise ServerUnavailable("not a cache server")
    version = struct.unpack_from("<H", msg, 4)[0]
    if version != VERSION:
        raise ServerUnavailable(f"cache server speaks protocol version {version}, this client {VERSION}")
    if len(msg) != WELCOME.size:
        raise ServerUnavailable("short handshake answer")
    _magic, _version, status, gen, pool_bytes, data_off, align, _ml, _mg, ttl_ms = WELCOME.unpack(msg)
    if status != Status.OK:
        names = {int(v): v.name for v in Status}
        why = REFUSALS.get(Status(status)) if status in names else None
        raise ServerUnavailable(f"admission refused: {names.get(status, status)}" + (f": {why}" if why else ""))
    return gen, pool_bytes, data_off, align, ttl_ms


def peer_open(conn: Connection) -> bool:
    """False when the server has closed this connection (it stopped, restarted or died: the
    kernel closed its end), as far as one non-blocking peek can tell; no wait."""
    try:
        return conn.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


def send_frames(conn: Connection, data: bytes, deadline: float) -> None:
    """Send ``data`` (whole frames) before ``deadline``; ``TimeoutError`` when the server does
    not take it in time (the connection must then be dropped: a frame may be half sent)."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("cache server did not answer in time")
    conn.arm(socket.SO_SNDTIMEO, 1, remaining)
    try:
        conn.sock.sendall(data)
    except BlockingIOError:
        raise TimeoutError("cache server did not take the request in time") from None


def _recv(conn: Connection, start: int, deadline: float) -> int:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("cache server did not answer in time")
    conn.arm(socket.SO_RCVTIMEO, 0, remaining)
    try:
        k = conn.sock.recv_into(conn.rview[start:])
    except BlockingIOError:
        raise TimeoutError("cache server did not answer in time") from None
    if k == 0:
        raise ConnectionError("cache server closed the connection")
    return k


def exchange(conn: Connection, op: int, body: bytes, deadline: float, pre: bytes = b"") -> memoryview:
    """Send one request (after the unanswered frames in ``pre``) and read its answer's body.

    The answer is a view of the connection's receive buffer, valid until its next exchange.
    """
    seq = next(conn.seq) & 0xFFFFFFFF
    send_frames(conn, pre + FRAME.pack(len(body), op, seq) + body, deadline)
    got = _recv(conn, 0, deadline)  # usually the whole answer
    while got < _HEAD:
        got += _recv(conn, got, deadline)
    length, rop, rseq = FRAME.unpack_from(conn.rbuf, 0)
    if rop != op or rseq != seq or length > MAX_BODY:
        raise ProtocolError("answer does not match the request")
    total = _HEAD + length
    if got != total:
        if got > total:  # one request is outstanding at a time: nothing else may follow its answer
            raise ProtocolError("bytes after the answer")
        if total > len(conn.rbuf):
            grown = bytearray(total)
            grown[:got] = conn.rview[:got]
            conn.rview.release()
            conn.rbuf = grown
            conn.rview = memoryview(grown)
        while got < total:
            got += _recv(conn, got, deadline)
        if got != total:
            raise ProtocolError("bytes after the answer")
    return conn.rview[_HEAD:total]


def copy_bytes(t: torch.Tensor, addr: int, data: torch.Tensor, off: int, nbytes: int, *, out_of_pool: bool) -> None:
    """Copy ``nbytes`` between a tensor's bytes and the pool at ``addr`` (``data[off:]`` as a
    uint8 tensor, ``addr`` its address): into ``t`` when ``out_of_pool``, else into the pool.

    A single-threaded ``memmove`` for contiguous CPU tensors of exactly that size (torch's
    parallel ``copy_`` waits on its worker threads, which costs milliseconds when the cores are
    busy); other tensors go through ``copy_`` on a view of the pool bytes.
    """
    if t.device.type == "cpu" and t.is_contiguous() and t.numel() * t.element_size() == nbytes:
        if out_of_pool:
            ctypes.memmove(t.data_ptr(), addr, nbytes)
        else:
            ctypes.memmove(addr, t.data_ptr(), nbytes)
        return
    pool_view = data[off : off + nbytes]
    if out_of_pool:
        t.copy_(pool_view.view(t.dtype).view(t.shape))
    else:
        flat = t.reshape(-1).view(torch.uint8) if t.numel() else t.new_empty(0, dtype=torch.uint8)
        pool_view.copy_(flat)
