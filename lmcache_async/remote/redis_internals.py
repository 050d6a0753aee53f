"""The one place that touches private internals of ``redis.asyncio`` connections.

The Redis connector sends values straight from pool blocks (scatter-gather writes on the
connection's socket) and must be able to drop a connection at once, unsent and unread bytes
included. redis-py has no public API for either, so this adapter reads three private members of
:class:`redis.asyncio.connection.AbstractConnection`:

* ``_writer`` — the connection's :class:`asyncio.StreamWriter` (None while not connected); its
  ``transport`` is the socket transport;
* ``_parser`` — the reply parser; ``on_disconnect()`` forgets a half-read reply;
* ``_close()`` — forgets the reader and writer without a network round trip (the connection
  reconnects on next use).

They are checked against redis-py from :data:`MIN_REDIS_PY` up to (not including)
:data:`MAX_REDIS_PY`, the bound the ``redis`` extra declares; ``tests/remote/
test_redis_internals.py`` fails when a release changes what this module relies on.
:func:`check_internals` says what is missing on a live connection. Loop thread only.
"""

from __future__ import annotations

import asyncio
from typing import Any

try:
    import redis
    from redis.asyncio.connection import AbstractConnection
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(f"the Redis connector needs the 'redis' package ({exc})") from exc

__all__ = [
    "MAX_REDIS_PY",
    "MIN_REDIS_PY",
    "check_internals",
    "drop_connection",
    "redis_py_version",
    "stream_transport",
    "stream_writer",
]

MIN_REDIS_PY = (5, 0)
"""Oldest redis-py release the adapter was checked with."""
MAX_REDIS_PY = (9, 0)
"""First redis-py release the adapter is not known to work with (the extra's upper bound)."""


def redis_py_version() -> tuple[int, ...]:
    """The installed redis-py version as integers (``(8, 1, 0)``); non-numeric parts end it."""
    out: list[int] = []
    for part in str(redis.__version__).split("."):
        if not part.isdigit():
            break
        out.append(int(part))
    return tuple(out)


def stream_writer(conn: AbstractConnection) -> asyncio.StreamWriter | None:
    """The connection's stream writer; None while it is not connected."""
    writer: asyncio.StreamWriter | None = getattr(conn, "_writer", None)
    return writer


def stream_transport(conn: AbstractConnection) -> asyncio.WriteTransport | None:
    """The transport under the connection's stream writer; None while it is not connected.

    Keep it aside before an exchange: redis-py forgets its writer when it closes a connection
    itself, and a closing transport would go on sending buffered slices of a caller's block.
    """
    writer = stream_writer(conn)
    return writer.transport if writer is not None else None


def drop_connection(conn: AbstractConnection) -> None:
    """Close ``conn`` at once, discarding unsent and unread bytes (it reconnects on next use).

    Never raises for a connection that is already closed.
    """
    transport = stream_transport(conn)
    if transport is not None:
        try:
            transport.abort()
        except Exception:  # pragma: no cover - already closed
            pass
    try:
        conn._parser.on_disconnect()  # type: ignore[no-untyped-call]
    except Exception:  # pragma: no cover
        pass
    conn._close()  # type: ignore[no-untyped-call]


def check_internals(conn: AbstractConnection) -> list[str]:
    """What this adapter relies on that ``conn`` (a connected connection) lacks: an empty list
    when every private member exists with the meaning used here."""
    problems: list[str] = []
    writer: Any = getattr(conn, "_writer", _MISSING)
    if writer is _MISSING:
        problems.append("no _writer attribute")
    elif not isinstance(writer, asyncio.StreamWriter):
        problems.append(f"_writer is {type(writer).__name__}, not an asyncio.StreamWriter")
    elif not isinstance(writer.transport, asyncio.WriteTransport):
        problems.append("_writer.transport is not an asyncio.WriteTransport")
    parser = getattr(conn, "_parser", _MISSING)
    if parser is _MISSING:
        problems.append("no _parser attribute")
    elif not callable(getattr(parser, "on_disconnect", None)):
        problems.append("_parser has no on_disconnect()")
    if not callable(getattr(conn, "_close", None)):
        problems.append("no _close() method")
    return problems


_MISSING = object()
