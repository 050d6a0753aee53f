"""One blocking connection to the node cache server: handshake, pool mapping, request/answer.

Used under :class:`~lmcache_async.server.client.ServerClient`'s lock (one request at a time per
connection); nothing here retries, counts or logs: callers turn the exceptions into misses.

* :func:`connect` runs the handshake and maps the namespace pool handed over as a memfd;
  ``ServerUnavailable`` when the server refuses us or answers something else, ``OSError`` when
  it cannot be reached, both bounded by the deadline.
* :func:`exchange` sends one request (after any unanswered frames) and reads its answer;
  ``ConnectionError`` when the server closed the connection (a server that stopped or
  restarted), ``TimeoutError`` at the deadline, ``ProtocolError`` for an answer of another request.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import socket
import time

import torch

from lmcache_async.server.protocol import (
    FRAME,
    HELLO,
    MAGIC,
    MAX_BODY,
    VERSION,
    WELCOME,
    Mode,
    ProtocolError,
    Status,
)
from lmcache_async.server.shm import PoolMapping

__all__ = ["Connection", "ServerUnavailable", "connect", "copy_bytes", "exchange", "recv_into"]


class ServerUnavailable(ConnectionError):
    """The server could not be reached or admitted us (internal; never leaves this module's callers)."""


class Connection:
    """One admitted connection and its pool mapping (used under the client's lock)."""

    def __init__(self, sock: socket.socket, mapping: PoolMapping | None, align: int, ttl_s: float) -> None:
        #: False once the connection was closed (a view taken on it is no longer backed by a lease).
        self.open = True
        self.sock = sock
        self.mapping = mapping
        self.align = max(align, 1)
        self.ttl_s = ttl_s
        self.seq = itertools.count(1)
        self.pid = os.getpid()
        self.grants: dict[int, list[tuple[int, int, float]]] = {}  # block size -> [(gid, offset, expiry)]
        self.rbuf = bytearray(64 << 10)

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


def connect(path: str, namespace: str, token: str | None, mode: Mode, deadline: float) -> Connection:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        sock.connect(path)
        ns = namespace.encode("utf-8")
        tok = (token or "").encode("utf-8")
        sock.sendall(HELLO.pack(MAGIC, VERSION, int(mode), len(ns), len(tok)) + ns + tok)
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        msg, fds, _flags, _addr = socket.recv_fds(sock, WELCOME.size, 1)
        try:
            if len(msg) != WELCOME.size:
                raise ServerUnavailable("short handshake answer")
            magic, version, status, gen, pool_bytes, data_off, align, _ml, _mg, ttl_ms = WELCOME.unpack(msg)
            if magic != MAGIC or version != VERSION:
                raise ServerUnavailable("not a cache server of this version")
            if status != Status.OK:
                names = {int(v): v.name for v in Status}
                raise ServerUnavailable(f"admission refused: {names.get(status, status)}")
            mapping = None
            if mode == Mode.CLIENT:
                if len(fds) != 1:
                    raise ServerUnavailable("no pool descriptor in the handshake")
                fd = fds.pop()
                try:
                    mapping = PoolMapping(fd, gen, pool_bytes, data_off)
                except ValueError as exc:
                    raise ServerUnavailable(str(exc)) from None
        finally:
            for fd in fds:
                os.close(fd)
        return Connection(sock, mapping, align, ttl_ms / 1000.0)
    except BaseException:
        sock.close()
        raise


def recv_into(conn: Connection, buf: memoryview, deadline: float) -> None:
    sock = conn.sock
    got = 0
    n = len(buf)
    while got < n:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("cache server did not answer in time")
        sock.settimeout(remaining)
        k = sock.recv_into(buf[got:])
        if k == 0:
            raise ConnectionError("cache server closed the connection")
        got += k


def exchange(conn: Connection, op: int, body: bytes, deadline: float, pre: bytes = b"") -> memoryview:
    """Send one request (after the unanswered frames in ``pre``) and read its answer's body."""
    seq = next(conn.seq) & 0xFFFFFFFF
    conn.sock.settimeout(max(deadline - time.monotonic(), 0.001))
    conn.sock.sendall(pre + FRAME.pack(len(body), int(op), seq) + body)
    head = bytearray(FRAME.size)
    recv_into(conn, memoryview(head), deadline)
    length, rop, rseq = FRAME.unpack(head)
    if rop != op or rseq != seq or length > MAX_BODY:
        raise ProtocolError("answer does not match the request")
    if length > len(conn.rbuf):
        conn.rbuf = bytearray(length)
    view = memoryview(conn.rbuf)[:length]
    recv_into(conn, view, deadline)
    return view


def copy_bytes(t: torch.Tensor, addr: int, pool_view: torch.Tensor, *, out_of_pool: bool) -> None:
    """Copy between a tensor's bytes and the pool at ``addr`` (``pool_view`` is those bytes).

    A single-threaded ``memmove`` for contiguous CPU tensors: torch's parallel ``copy_`` waits on
    its worker threads, which costs milliseconds when the cores are busy.
    """
    n = pool_view.numel()
    if t.device.type == "cpu" and t.is_contiguous() and t.numel() * t.element_size() == n:
        if out_of_pool:
            ctypes.memmove(t.data_ptr(), addr, n)
        else:
            ctypes.memmove(addr, t.data_ptr(), n)
        return
    flat = t.reshape(-1).view(torch.uint8) if t.numel() else t.new_empty(0, dtype=torch.uint8)
    if out_of_pool:
        t.copy_(pool_view.view(t.dtype).view(t.shape))
    else:
        pool_view.copy_(flat)
