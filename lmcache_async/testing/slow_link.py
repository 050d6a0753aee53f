"""A loopback TCP proxy that makes a fast server slow: a bandwidth cap and a delay per read.

``SlowProxy(target_port, bytes_per_s=8e6, delay_s=0.005).start()`` listens on a free loopback
port (:attr:`SlowProxy.url`, a ``redis://`` URL) and forwards every connection to the target.
Each request the client sends is held ``delay_s`` before it is forwarded (one delay per read),
and the bytes the server sends back are paced to ``bytes_per_s`` over all connections together
(a link, not a per-connection cap: parallel reads share it); what the client sends is paced to
``up_bytes_per_s`` the same way, or not at all when it is None (a slow tier for reads whose
write-through does not time out and open the tier's breaker). The proxy runs its own event loop on
a thread; :meth:`SlowProxy.stop` closes it. For tests and benchmarks of slow tiers.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time

__all__ = ["SLICE", "SlowProxy", "free_port"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


SLICE = 64 << 10


class SlowProxy:
    """See the module docstring; ``ValueError`` for a cap <= 0 or a negative delay."""

    def __init__(
        self,
        target_port: int,
        *,
        bytes_per_s: float = 8e6,
        delay_s: float = 0.005,
        up_bytes_per_s: float | None = None,
    ) -> None:
        if not bytes_per_s > 0 or delay_s < 0 or (up_bytes_per_s is not None and not up_bytes_per_s > 0):
            raise ValueError(
                f"bytes_per_s and up_bytes_per_s must be > 0 and delay_s >= 0, got {bytes_per_s!r}, "
                f"{up_bytes_per_s!r}, {delay_s!r}"
            )
        self.up_bytes_per_s = up_bytes_per_s
        self.target_port = target_port
        self.bytes_per_s = bytes_per_s
        self.delay_s = delay_s
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="slow-proxy", daemon=True)
        self._server: asyncio.AbstractServer | None = None
        self.bytes_down = 0
        self._free_at = {True: 0.0, False: 0.0}  # when each direction's link is free again
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> SlowProxy:
        self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(self._listen(), self.loop)
        self._server = fut.result(10)
        return self

    async def _listen(self) -> asyncio.AbstractServer:
        return await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    async def _pace(self, down: bool, n: int) -> None:
        """Hold ``n`` bytes until the shared link of that direction has carried them."""
        rate = self.bytes_per_s if down else self.up_bytes_per_s
        if rate is None:
            return
        now = time.monotonic()
        start = max(now, self._free_at[down])
        self._free_at[down] = start + n / rate
        delay = self._free_at[down] - now
        if delay > 0:
            await asyncio.sleep(delay)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, down: bool) -> None:
        try:
            while True:
                data = await src.read(SLICE)
                if not data:
                    break
                if not down:
                    await asyncio.sleep(self.delay_s)  # one delay per request read
                await self._pace(down, len(data))
                dst.write(data)
                await dst.drain()
                if down:
                    self.bytes_down += len(data)
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(Exception):
                dst.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        self._writers.update((writer, up_w))
        try:
            await asyncio.gather(self._pipe(reader, up_w, False), self._pipe(up_r, writer, True))
        finally:
            self._writers.difference_update((writer, up_w))

    def stop(self) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()
            for w in list(self._writers):  # the pipes end on their own once both ends are closed
                w.close()
            await asyncio.sleep(0.05)
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in rest:
                t.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(close(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self.loop.close()  # its self-pipe sockets with it
