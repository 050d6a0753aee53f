"""A ZMQ publisher of KV event batches in vLLM's wire format, with replay and snapshots.

:class:`ZmqEventPublisher` owns a PUB socket (``[topic, seq, payload]``), an optional ROUTER
socket for replay, and one thread that encodes, sends and answers replay requests. Its owner
(any thread) calls :meth:`publish`, which **never blocks**: batches go into a bounded queue; a
batch that finds it full is dropped and counted (``dropped_batches``/``dropped_events``) and
``resync_needed`` is set, so the owner publishes a snapshot once the queue has room again
(:meth:`publish_snapshot`). Sent batches stay in a bounded replay buffer (``buffer_steps``).

Sequence numbers start at the microseconds since the epoch when the publisher started (not at 0
as vLLM's do), so a restarted publisher's numbers continue upwards: a subscriber sees a gap,
asks for a replay its new buffer cannot serve, and recovers through a snapshot.

Replay (vLLM's protocol, :mod:`lmcache_async.events.wire`): the first wanted sequence number as 8
bytes big-endian → every buffered batch from there, then the end marker. Snapshot: the request
:data:`~lmcache_async.events.wire.SNAPSHOT_REQUEST` → the publisher calls ``on_snapshot_request``
(from its thread; the owner answers by calling :meth:`publish_snapshot` from its own thread), the
snapshot's batches are published on the live stream (every subscriber sees them in sequence), and
the requester receives them through the replay socket, then the end marker.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import zmq

from lmcache_async.events.wire import END_SEQ, SNAPSHOT_REQUEST, Event, KVEventBatch, encode_batch, seq_bytes

__all__ = ["ZmqEventPublisher", "replay_endpoint_for"]

logger = logging.getLogger(__name__)

#: Most events in one published batch (a snapshot of many chunks is cut into batches).
MAX_BATCH_EVENTS = 1024


def replay_endpoint_for(endpoint: str) -> str:
    """The replay endpoint beside a ``tcp://host:port`` publish endpoint (the next port)."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit() or not endpoint.startswith("tcp://"):
        raise ValueError(f"give a tcp://HOST:PORT endpoint, got {endpoint!r}")
    return f"{host}:{int(port) + 1}"


@dataclass(slots=True)
class _Snapshot:
    batches: list[KVEventBatch]
    requesters: list[bytes] = field(default_factory=list)


class ZmqEventPublisher:
    """See the module docstring. ``endpoint``/``replay_endpoint`` are bound (``tcp://127.0.0.1:PORT``;
    port 0 picks a free one, see :attr:`endpoint`). ``publish`` and ``publish_snapshot`` may be called
    from any one owner thread; ``close`` once."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        buffer_steps: int = 10_000,
        max_queue: int = 10_000,
        hwm: int = 100_000,
        data_parallel_rank: int | None = None,
        on_snapshot_request: Callable[[], None] | None = None,
        first_seq: int | None = None,
    ) -> None:
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self.endpoint = self._bind(self._pub, endpoint)
            self.replay_endpoint: str | None = None
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self.replay_endpoint = self._bind(self._replay, replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ValueError(f"cannot bind the KV event endpoint: {exc}") from None
        self.topic = topic.encode()
        self.data_parallel_rank = data_parallel_rank
        self.max_queue = max_queue
        self._queue: queue.Queue[KVEventBatch | _Snapshot | None] = queue.Queue(max_queue)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._next_seq = time.time_ns() // 1000 if first_seq is None else first_seq
        self._on_snapshot_request = on_snapshot_request
        self._requesters: list[bytes] = []
        self._req_lock = threading.Lock()
        self.sent_batches = 0
        self.sent_events = 0
        self.dropped_batches = 0
        self.dropped_events = 0
        self.replays = 0
        self.snapshots = 0
        #: Set when a batch was dropped; the owner publishes a snapshot and clears it.
        self.resync_needed = False
        #: When a batch was last queued (monotonic).
        self.last_queued = time.monotonic()
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()

    @staticmethod
    def _bind(sock: zmq.Socket[bytes], endpoint: str) -> str:
        sock.bind(endpoint)
        return str(sock.getsockopt_string(zmq.LAST_ENDPOINT))

    # ---- the owner's side ------------------------------------------------------------------------
    def publish(self, events: Sequence[Event]) -> bool:
        """Queue one batch of ``events`` (never blocks). False when the queue was full: the batch
        is dropped, counted, and ``resync_needed`` is set."""
        if not events:
            return True
        batch = KVEventBatch(ts=time.time(), events=list(events), data_parallel_rank=self.data_parallel_rank)
        try:
            self._queue.put_nowait(batch)
            self.last_queued = time.monotonic()
            return True
        except queue.Full:
            self.dropped_batches += 1
            self.dropped_events += len(events)
            self.resync_needed = True
            return False

    def heartbeat(self, idle_s: float) -> None:
        """Publish an empty batch when nothing was queued for ``idle_s`` seconds, so a subscriber
        that missed the last batches (or a restart's first) sees a later number and recovers."""
        if time.monotonic() - self.last_queued >= idle_s:
            with contextlib.suppress(queue.Full):
                self._queue.put_nowait(
                    KVEventBatch(ts=time.time(), events=[], data_parallel_rank=self.data_parallel_rank)
                )
                self.last_queued = time.monotonic()

    def room(self) -> int:
        """Batches the queue can take now."""
        return self.max_queue - self._queue.qsize()

    def publish_snapshot(self, events: Sequence[Event]) -> bool:
        """Publish a snapshot (``events``: AllBlocksCleared, then a store of everything held) on the
        live stream and answer every pending snapshot request with it. Never blocks: False (and
        ``resync_needed`` stays or becomes set) when the queue cannot take it whole."""
        with self._req_lock:
            requesters, self._requesters = self._requesters, []
        batches = [
            KVEventBatch(ts=time.time(), events=list(events[i : i + MAX_BATCH_EVENTS]),
                         data_parallel_rank=self.data_parallel_rank)
            for i in range(0, max(len(events), 1), MAX_BATCH_EVENTS)
        ]  # fmt: skip
        if self.room() < 1:
            self.resync_needed = True
            with self._req_lock:
                self._requesters[:0] = requesters
            return False
        try:
            self._queue.put_nowait(_Snapshot(batches, requesters))
        except queue.Full:
            self.resync_needed = True
            with self._req_lock:
                self._requesters[:0] = requesters
            return False
        self.resync_needed = False
        self.last_queued = time.monotonic()
        self.snapshots += 1
        return True

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every queued batch was sent (tests and benchmarks); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    def stats(self) -> dict[str, int | str | None]:
        return {
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "sent_batches": self.sent_batches,
            "sent_events": self.sent_events,
            "dropped_batches": self.dropped_batches,
            "dropped_events": self.dropped_events,
            "queued": self._queue.qsize(),
            "replays": self.replays,
            "snapshots": self.snapshots,
            "next_seq": self._next_seq,
        }

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued (bounded by ``timeout_s``), stop the thread, close the sockets."""
        if not self._running:
            return
        self._running = False
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=timeout_s)
        self._thread.join(timeout_s)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()

    # ---- the publisher thread ------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            if self._replay is not None:
                try:
                    while self._replay.poll(0):
                        self._serve_replay()
                except Exception as exc:  # a bad request never stops the stream
                    logger.warning("KV events: replay request failed: %s: %s", type(exc).__name__, exc)
            try:
                item = self._queue.get(timeout=0.02)
            except queue.Empty:
                if not self._running:
                    return
                continue
            try:
                if item is None:
                    return
                if isinstance(item, _Snapshot):
                    self._send_snapshot(item)
                else:
                    self._send(item)
            except Exception as exc:
                logger.warning("KV events: publishing failed: %s: %s", type(exc).__name__, exc)
            finally:
                self._queue.task_done()

    def _send(self, batch: KVEventBatch) -> tuple[int, bytes]:
        seq = self._next_seq
        self._next_seq += 1
        payload = encode_batch(batch)
        self._pub.send_multipart((self.topic, seq_bytes(seq), payload), copy=False)
        self._buffer.append((seq, payload))
        self.sent_batches += 1
        self.sent_events += len(batch.events)
        return seq, payload

    def _send_snapshot(self, snap: _Snapshot) -> None:
        sent = [self._send(b) for b in snap.batches]
        if self._replay is None:
            return
        for ident in snap.requesters:
            for seq, payload in sent:
                self._replay.send_multipart((ident, b"", self.topic, seq_bytes(seq), payload))
            self._replay.send_multipart((ident, b"", b"", END_SEQ, b""))

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            return
        ident, _empty, request = frames
        if request == SNAPSHOT_REQUEST and self._on_snapshot_request is not None:
            with self._req_lock:
                self._requesters.append(ident)
            self._on_snapshot_request()
            return
        start = int.from_bytes(request, "big")
        self.replays += 1
        for seq, payload in self._buffer:
            if seq >= start:
                self._replay.send_multipart((ident, b"", self.topic, seq_bytes(seq), payload))
        self._replay.send_multipart((ident, b"", b"", END_SEQ, b""))
