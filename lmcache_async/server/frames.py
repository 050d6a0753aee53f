"""Framing of one admitted connection of the node cache server: an ``asyncio.Protocol`` that
reads request frames and writes answers in order, handing each request to the server's dispatch.

Thread affinity: the server's event loop.

Bounds: the bytes of a partial frame held here count against the server's ``max_buffered``; a
connection that would go past it stops being read (the kernel's socket buffer holds the rest)
until other connections drain. The server's sweep asks :meth:`FrameProtocol.stalled` and closes
connections stalled inside a frame or idle past their timeouts.
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import TYPE_CHECKING, cast

from lmcache_async.server.namespace import ClientState, Namespace
from lmcache_async.server.protocol import ANSWERED, FRAME, MAX_BODY, Op, ProtocolError, Reader

if TYPE_CHECKING:
    from lmcache_async.server.server import CacheServer

__all__ = ["MAY_WAIT", "Conn", "FrameProtocol"]


class Conn:
    """One admitted connection."""

    def __init__(
        self,
        ident: int,
        ns: Namespace | None,
        state: ClientState | None,
        uid: int,
        pid: int,
        gid: int = -1,
        token: bytes = b"",
    ) -> None:
        self.ident = ident
        self.ns = ns
        self.state = state
        self.uid = uid
        self.pid = pid
        self.gid = gid
        #: The token the peer presented (what it may see is decided by it, its uid and gid).
        self.token = token


#: Ops whose handling awaits the lower tiers (when the server has any).
MAY_WAIT = frozenset({Op.CONTAINS, Op.GET, Op.READ, Op.COMMIT, Op.REMOVE, Op.HOLD, Op.CLEAR})
_OPS = {int(op): op for op in Op}
_HEAD = FRAME.size


class FrameProtocol(asyncio.Protocol):
    """Reads frames of one admitted connection and answers them in order.

    Thread affinity: the server's loop. A request that never waits (every request when the
    server has no lower tiers) is handled inside ``data_received`` and its answer written at
    once, with no task or stream in between. One that may wait (a lower-tier read or write)
    runs as a task with reading paused, so requests of one connection are still handled one
    at a time, in order. Reading also pauses while the transport's write buffer is over its
    high-water mark (a client that sends without reading its answers). A malformed frame, a
    failure or the peer going away resolves ``closed`` (with the error, if any); the server's
    connection handler then reclaims what the connection held.
    """

    def __init__(self, server: CacheServer, conn: Conn, closed: asyncio.Future[None]) -> None:
        self._server = server
        self._conn = conn
        self._closed = closed
        self._buf = bytearray()
        self._transport: asyncio.Transport | None = None
        self._busy = False  # a request runs as a task
        self._task: asyncio.Future[bytes | None] | None = None
        self._write_paused = False
        self._fast = server.fast_handlers() if conn.ns is not None and conn.state is not None else {}
        #: True when the peer closed its side (EOF or reset) before the server closed it.
        self.peer_closed = False
        self._activity = 0  # data_received calls; the sweep compares it between rounds
        self._seen = (0, time.monotonic())  # (activity, when it was last seen to change)
        self._partial_since: float | None = None
        self._counted = 0  # partial-frame bytes counted in the server's ``buffered``
        self._budget_paused = False

    def stalled(self, now: float, frame_timeout_s: float, idle_timeout_s: float) -> str | None:
        """Why the server should close this connection now (a partial frame older than
        ``frame_timeout_s``; no request for ``idle_timeout_s`` while it holds no grant or lease;
        0 turns a check off), or None."""
        if self._closed.done():
            return None
        if self._activity != self._seen[0]:
            self._seen = (self._activity, now)
        since = self._partial_since
        if frame_timeout_s > 0 and since is not None and now - since > frame_timeout_s:
            return f"stalled inside a frame for {now - since:.1f} s"
        if idle_timeout_s > 0 and not self._busy and now - self._seen[1] > idle_timeout_s:
            # A client holding grants or leases keeps its connection: closing it would only
            # move its grants to quarantine until its process exits (see namespace.py).
            st = self._conn.state
            if st is None or not (st.grants or st.leases):
                return f"idle for {now - self._seen[1]:.1f} s"
        return None

    def close_by_server(self) -> None:
        """End the connection from the server's side (a timeout): its holdings are reclaimed."""
        self._finish(TimeoutError("closed by the server"))

    def resume_budget(self) -> None:
        """The server-wide bound on partial-frame bytes allows reading again."""
        if self._budget_paused:
            self._budget_paused = False
            self._partial_since = time.monotonic() if self._buf else None
            t = self._transport
            if t is not None and not self._busy and not self._write_paused and not t.is_closing():
                t.resume_reading()

    def _account(self) -> None:
        """Count this connection's partial-frame bytes in the server's total; stop reading when
        the total passes the bound. A waiting connection's frame timer keeps running, so senders
        stalled inside their frames are closed and their bytes freed; one that was only waiting
        gets a fresh period once it reads again."""
        n = len(self._buf)
        server = self._server
        delta = n - self._counted
        self._counted = n
        server.buffered += delta
        if not n:
            self._partial_since = None
        elif self._partial_since is None:
            self._partial_since = time.monotonic()
        if n and not self._budget_paused and server.buffered > server.max_buffered:
            self._budget_paused = True  # its frame timer keeps running: stalled senders still go
            if self._transport is not None and not self._transport.is_closing():
                self._transport.pause_reading()
            server.buffer_wait(self)
        elif delta < 0:
            server.buffer_drained()

    def shut(self) -> None:
        """Cancel a request still running and close the transport (the server's handler calls
        this before it reclaims the connection's leases and grants)."""
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport of a Unix socket (uvloop's does not subclass asyncio.Transport).
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self._activity += 1
        if not self._buf and not self._busy and not self._write_paused and self._fast:
            # The usual case: exactly one hot request arrived and nothing is queued before it.
            # It is answered from ``data`` itself, with no buffering and no dispatch.
            n = len(data)
            if n >= _HEAD:
                body_len, op, seq = FRAME.unpack_from(data, 0)
                fast = self._fast.get(op)
                if fast is not None and n == _HEAD + body_len and not self._closed.done():
                    try:
                        answer = fast(self._conn, Reader(data, _HEAD))
                    except Exception as exc:
                        self._finish(exc)
                        return
                    self._conn.state.requests += 1  # type: ignore[union-attr]  # set with _fast
                    if answer is not None:
                        self._transport.write(FRAME.pack(len(answer), op, seq) + answer)  # type: ignore[union-attr]
                    return
        self._buf += data
        if not self._busy and not self._write_paused:
            self._process()
        self._account()

    def eof_received(self) -> bool | None:
        if not self._closed.done():
            self.peer_closed = True
        self._finish(None)
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._closed.done():
            self.peer_closed = True  # a reset, or the peer's close seen without an EOF first
        self._finish(exc)
        if self._counted:
            self._server.buffered -= self._counted
            self._counted = 0
        self._server.buffer_drained(self)

    def pause_writing(self) -> None:
        self._write_paused = True
        if self._transport is not None:
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._transport is not None and not self._busy and not self._transport.is_closing():
            if not self._budget_paused:
                self._transport.resume_reading()
            self._process()
            self._account()

    def _finish(self, exc: BaseException | None) -> None:
        if not self._closed.done():
            if exc is None:
                self._closed.set_result(None)
            else:
                self._closed.set_exception(exc)
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()

    def _process(self) -> None:
        """Handle every complete frame in the buffer (until one has to wait or writing pauses)."""
        buf = self._buf
        server, conn = self._server, self._conn
        transport = self._transport
        assert transport is not None
        try:
            while len(buf) >= _HEAD and not self._write_paused and not self._closed.done():
                body_len, op, seq = FRAME.unpack_from(buf, 0)
                if body_len > MAX_BODY:
                    raise ProtocolError(f"frame of {body_len} bytes exceeds {MAX_BODY}")
                end = _HEAD + body_len
                if len(buf) < end:
                    return
                body = bytes(buf[_HEAD:end])
                del buf[:end]
                op_code = _OPS.get(op)
                if op_code is None:
                    raise ProtocolError(f"unknown op {op}")
                if conn.ns is None and op_code not in (Op.STATS, Op.PING):
                    raise ProtocolError(f"op {op_code.name} on a status connection")
                if conn.state is not None:
                    conn.state.requests += 1
                if server.needs_task(op_code, conn):
                    self._busy = True
                    transport.pause_reading()
                    self._task = task = asyncio.ensure_future(server.dispatch(conn, op_code, Reader(body)))
                    task.add_done_callback(functools.partial(self._task_done, op=op_code, seq=seq))
                    return
                self._answer(op_code, seq, server.dispatch_now(conn, op_code, Reader(body)))
        except Exception as exc:
            self._finish(exc)

    def _answer(self, op: Op, seq: int, answer: bytes | None) -> None:
        if op in ANSWERED:
            assert answer is not None and self._transport is not None
            self._transport.write(FRAME.pack(len(answer), op, seq) + answer)

    def _task_done(self, task: asyncio.Future[bytes | None], *, op: Op, seq: int) -> None:
        self._busy = False
        if self._task is task:
            self._task = None
        if task.cancelled():
            self._finish(None)
            return
        exc = task.exception()
        if exc is not None:
            self._finish(exc)
            return
        if self._closed.done() or self._transport is None or self._transport.is_closing():
            return
        try:
            self._answer(op, seq, task.result())
        except Exception as err:
            self._finish(err)
            return
        if not self._write_paused:
            if not self._budget_paused:
                self._transport.resume_reading()
            self._process()
            self._account()
