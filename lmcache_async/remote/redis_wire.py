"""The Redis connector's wire layer: RESP framing and sending values without copying them.

A command's small arguments are framed into one ``bytes``; large buffers (pool blocks) pass
through as views and go to the socket with scatter-gather writes (see :func:`send`). Loop thread
only. Connection internals are reached through :mod:`.redis_internals` only.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Sequence

from .redis_internals import stream_transport, stream_writer

try:
    from redis.asyncio.connection import AbstractConnection
    from redis.exceptions import ConnectionError as RedisConnectionError
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(f"the Redis connector needs the 'redis' package ({exc})") from exc

__all__ = ["SEND_SLICE", "Arg", "pack", "send", "tune"]

_SMALL = 16 * 1024  # buffers up to this size are framed into the command bytes
SEND_SLICE = 64 * 1024  # largest piece handed to the transport at once (stays a small allocation)
_IOV_MAX = 512

Arg = bytes | memoryview | tuple[bytes | memoryview, ...]
"""A command argument: one buffer, or several buffers that form one value."""


def _blen(b: bytes | memoryview) -> int:
    return b.nbytes if isinstance(b, memoryview) else len(b)


def pack(cmds: Sequence[Sequence[Arg]]) -> list[bytes | memoryview]:
    """RESP framing of ``cmds``; large buffers are passed through uncopied."""
    out: list[bytes | memoryview] = []
    buf = bytearray()
    for cmd in cmds:
        buf += b"*%d\r\n" % len(cmd)
        for arg in cmd:
            pieces = arg if isinstance(arg, tuple) else (arg,)
            buf += b"$%d\r\n" % sum(_blen(p) for p in pieces)
            for p in pieces:
                if _blen(p) <= _SMALL:
                    buf += p
                else:
                    out.append(bytes(buf))
                    buf.clear()
                    out.append(p)
            buf += b"\r\n"
    if buf:
        out.append(bytes(buf))
    return out


def _plain_fd(transport: asyncio.BaseTransport) -> int | None:
    """The socket descriptor of an unencrypted stream transport (None for TLS or others)."""
    if transport.get_extra_info("sslcontext") is not None:
        return None
    sock = transport.get_extra_info("socket")
    if sock is None or sock.type != socket.SOCK_STREAM:
        return None
    try:
        return int(sock.fileno())
    except (OSError, ValueError):  # pragma: no cover - closed meanwhile
        return None


def _advance(views: list[memoryview], n: int) -> None:
    """Drop the first ``n`` bytes of ``views`` (in place)."""
    while n and views:
        first = views[0]
        if n >= first.nbytes:
            n -= first.nbytes
            views.pop(0)
        else:
            views[0] = first[n:]
            n = 0


def _writev(fd: int, views: list[memoryview]) -> None:
    """Write from ``views`` (consumed in place) until the socket buffer is full."""
    while views:
        batch = views[:_IOV_MAX]
        try:
            n = os.writev(fd, batch)
        except (BlockingIOError, InterruptedError):
            return
        full = n < sum(v.nbytes for v in batch)
        _advance(views, n)
        if full:
            return


async def send(conn: AbstractConnection, chunks: list[bytes | memoryview], limit_s: float) -> None:
    """Write ``chunks`` without copying them where the socket allows.

    On a plain socket whose transport has nothing buffered, the pieces go out with one
    scatter-gather ``writev`` (header and payload straight from the pool block, one system
    call); when the socket is full, one slice of at most :data:`SEND_SLICE` bytes goes to the
    transport, which sends it when the socket drains, and the rest follows once the transport
    is empty again. TLS goes through the transport in slices. (``writelines`` would join
    everything into one new ``bytes`` that the selector transport then trims from the front
    after every ``send``: quadratic for multi-MiB values.) Every reply is read before the
    caller returns, so nothing here outlives the block it points into.
    """
    writer = stream_writer(conn)
    if writer is None:
        raise RedisConnectionError("connection is closed")
    transport = writer.transport
    fd = _plain_fd(transport)
    views = [(c if isinstance(c, memoryview) else memoryview(c)).cast("B") for c in chunks]
    async with asyncio.timeout(limit_s):
        while views:
            if fd is not None and not transport.get_write_buffer_size():
                _writev(fd, views)
                if not views:
                    break
            piece: list[memoryview] = []
            size = 0
            while views and size < SEND_SLICE:
                v = views[0]
                take = min(v.nbytes, SEND_SLICE - size)
                piece.append(v[:take])
                size += take
                _advance(views, take)
            for p in piece:
                writer.write(p)
            # Plain sockets: with the limits set by _tune this returns once the transport's
            # buffer is empty. TLS: once it is below asyncio's low-water mark.
            await writer.drain()


def tune(conn: AbstractConnection) -> None:
    """Prepare a new connection for :func:`send`: on a plain socket the transport pauses its
    writer as soon as it buffers anything, so ``drain`` returns only once its buffer is empty
    and it never holds more than one slice of a payload. (TLS keeps asyncio's limits: its flow
    control does not promise to resume at exactly zero.)

    Reading keeps redis-py's and asyncio's defaults (64 KiB steps): larger steps save system
    calls but allocate multi-MiB temporaries per read, which measured faster on some runs and
    much slower on others (allocator page faults); the defaults were steady.
    """
    transport = stream_transport(conn)
    if transport is not None and _plain_fd(transport) is not None:
        transport.set_write_buffer_limits(high=0)
