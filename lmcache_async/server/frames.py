"""Framing of one admitted connection of the node cache server: an ``asyncio.Protocol`` that
reads request frames and writes answers in order, handing each request to the server's dispatch.

Thread affinity: the server's event loop.
"""

from __future__ import annotations

import asyncio
import functools
from typing import TYPE_CHECKING, cast

from lmcache_async.server.namespace import ClientState, Namespace
from lmcache_async.server.protocol import ANSWERED, FRAME, MAX_BODY, Op, ProtocolError, Reader

if TYPE_CHECKING:
    from lmcache_async.server.server import CacheServer

__all__ = ["MAY_WAIT", "Conn", "FrameProtocol"]


class Conn:
    """One admitted connection."""

    def __init__(self, ident: int, ns: Namespace | None, state: ClientState | None, uid: int, pid: int) -> None:
        self.ident = ident
        self.ns = ns
        self.state = state
        self.uid = uid
        self.pid = pid


#: Ops whose handling awaits the lower tiers (when the server has any).
MAY_WAIT = frozenset({Op.CONTAINS, Op.GET, Op.READ, Op.COMMIT, Op.REMOVE, Op.HOLD})
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

    def eof_received(self) -> bool | None:
        self._finish(None)
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._finish(exc)

    def pause_writing(self) -> None:
        self._write_paused = True
        if self._transport is not None:
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._transport is not None and not self._busy and not self._transport.is_closing():
            self._transport.resume_reading()
            self._process()

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
                if server.needs_task(op_code):
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
            self._transport.resume_reading()
            self._process()
