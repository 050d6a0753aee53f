"""Zero-copy reads from the node cache server: a window onto one entry, backed by a lease.

An :class:`EntryView` is handed out by :meth:`ServerClient.get_view
<lmcache_async.server.client.ServerClient.get_view>` inside a ``with`` block. While the block
runs, the server holds a lease on the entry's pool block, so the block is neither evicted nor
reused, even if the key is removed or replaced meanwhile; on exit the lease ends.

A lease can still be lost behind the reader's back: the connection that took it closes (a
server stop or restart, a timeout on another call of the same client) or the lease's TTL
passes. :meth:`EntryView.valid` tells whether it still holds. A reader that must be sure it read
this entry's bytes checks ``valid()`` *after* reading: the server frees a block only after the
lease ended, and every way a lease ends makes ``valid()`` False from then on, so a read
followed by True was a read of this entry. Once ``valid()`` is False, ``tensor`` and ``buffer``
answer None (the view is refused).
"""

from __future__ import annotations

import select
import time

import torch

from lmcache_async.server.connection import Connection
from lmcache_async.server.protocol import EntryMeta

__all__ = ["EntryView"]

_GONE = select.POLLHUP | select.POLLERR | select.POLLNVAL | getattr(select, "POLLRDHUP", 0)


class EntryView:
    """A read-only window onto one committed entry in the mapped pool; see the module docstring.

    ``meta`` gives the entry's shape, dtype, format and size. The pool memory belongs to the
    server: the caller owns nothing here, must not write through :attr:`tensor` (the memory is
    shared with every client of the namespace) and must not use anything obtained from the
    view after the ``with`` block ends (:attr:`buffer` is released then; a tensor cannot be).
    Thread affinity: none; ``valid()`` costs one ``poll`` with a zero timeout, no round trip.
    """

    __slots__ = ("_buffer", "_closed", "_conn", "_poll", "_tensor", "_until", "lease_id", "meta", "offset")

    def __init__(self, conn: Connection, lease_id: int, offset: int, meta: EntryMeta, until: float) -> None:
        mapping = conn.mapping
        if mapping is None:
            raise ValueError("a view needs a connection with a mapped pool")
        self._conn = conn
        self.lease_id = lease_id
        self.offset = offset
        self.meta = meta
        self._until = until
        self._closed = False
        self._poll = select.poll()
        self._poll.register(conn.sock.fileno(), select.POLLIN | getattr(select, "POLLRDHUP", 0))
        self._tensor: torch.Tensor | None = None  # made on first use (readers of ``buffer`` need none)
        self._buffer: memoryview | None = mapping.readonly(offset, meta.nbytes)

    @property
    def connection(self) -> Connection:
        """The connection the lease belongs to."""
        return self._conn

    def valid(self) -> bool:
        """True while the lease is known to hold: inside the ``with`` block, on a connection
        still open (and not closed by the server), before the lease's TTL."""
        if self._closed or not self._conn.open or time.monotonic() >= self._until:
            return False
        # The server closing the connection (a stop, a restart, a kill) shows as a hang-up; data
        # waiting to be read (another call's answer) does not.
        return all(not mask & _GONE for _fd, mask in self._poll.poll(0))

    @property
    def tensor(self) -> torch.Tensor | None:
        """The entry as a tensor over the shared pool (zero copy; do not write), or None when
        the lease is lost (:meth:`valid` is False)."""
        if not self.valid():
            return None
        t = self._tensor
        if t is None:
            meta = self.meta
            mapping = self._conn.mapping
            assert mapping is not None
            if meta.nbytes:
                t = mapping.data[self.offset : self.offset + meta.nbytes].view(meta.dtype).view(meta.shape)
            else:
                t = torch.empty(meta.shape, dtype=meta.dtype)
            self._tensor = t
        return t

    @property
    def buffer(self) -> memoryview | None:
        """The entry's bytes as a read-only memoryview over the shared pool, or None when the
        lease is lost. Released (unusable) once the ``with`` block ends."""
        return self._buffer if self.valid() else None

    def copy(self) -> torch.Tensor | None:
        """A private copy of the entry (the caller owns it), or None when the lease was lost
        before the copy finished."""
        t = self.tensor
        if t is None:
            return None
        out = t.clone()
        return out if self.valid() else None

    def close(self) -> None:
        """End the view's local life (the client sends the release). Idempotent."""
        self._closed = True
        buf, self._buffer = self._buffer, None
        if buf is not None:
            buf.release()
