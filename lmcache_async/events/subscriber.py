"""A subscriber of KV event streams that recovers what it missed: replay, else a snapshot.

:class:`EventSubscriber` reads ``[topic, seq, payload]`` from a publisher's PUB socket and hands
out the batches in sequence order. A gap (a sequence number past the one expected) is filled from
the publisher's replay socket; when the replay cannot fill it (the buffer moved on, or the
publisher restarted: its numbers start higher), it asks for a snapshot, which begins with
``AllBlocksCleared``, so applying the batches it returns, in order, always leaves the reader's
view equal to the publisher's. Batches before the expected number (copies of what a replay or a
snapshot already delivered) are skipped.

What routers do with vLLM's streams; used here by the tests, the benchmark and tools. One thread.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import zmq

from lmcache_async.events.wire import END_SEQ, SNAPSHOT_REQUEST, KVEventBatch, decode_batch, seq_bytes

__all__ = ["EventSubscriber", "RecoveryFailed"]


class RecoveryFailed(ConnectionError):
    """The replay socket did not answer in time."""


class EventSubscriber:
    """See the module docstring. ``lose``: a test hook; a live message whose sequence number it
    returns True for is dropped as if the network lost it. ``keep_payloads``: keep the raw
    payload of every batch handed out, in order, in :attr:`payloads` (tests check them with
    other decoders)."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str,
        *,
        topic: str = "",
        timeout_s: float = 5.0,
        lose: Callable[[int], bool] | None = None,
        keep_payloads: bool = False,
    ) -> None:
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.RCVHWM, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.connect(endpoint)
        self._replay = self._ctx.socket(zmq.DEALER)
        self._replay.setsockopt(zmq.LINGER, 0)
        self._replay.connect(replay_endpoint)
        self.timeout_s = timeout_s
        self._lose = lose
        #: The sequence number expected next (None before the first batch).
        self.next_seq: int | None = None
        self.lost = 0
        self.payloads: list[bytes] | None = [] if keep_payloads else None
        self.replays = 0
        self.snapshots = 0

    def close(self) -> None:
        self._sub.close(linger=0)
        self._replay.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> EventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def snapshot(self) -> list[KVEventBatch]:
        """Ask for a snapshot; its batches (applied in order: the publisher's whole view)."""
        got = self._ask(SNAPSHOT_REQUEST)
        self.snapshots += 1
        if got:
            self.next_seq = got[-1][0] + 1
        return self._handed([(b, p) for _seq, b, p in got])

    def receive(self, wait_s: float = 0.0) -> list[KVEventBatch]:
        """Every batch available now (waiting up to ``wait_s`` for the first), gaps recovered."""
        out: list[KVEventBatch] = []
        deadline = time.monotonic() + wait_s
        while True:
            left = max(0.0, deadline - time.monotonic())
            if not self._sub.poll(int(left * 1000) if not out else 0):
                return out
            _topic, raw_seq, payload = self._sub.recv_multipart()
            seq = int.from_bytes(raw_seq, "big")
            if self._lose is not None and self._lose(seq):
                self.lost += 1
                continue
            self._take(seq, payload, out)

    def catch_up(self, seq: int) -> list[KVEventBatch]:
        """Every batch before sequence number ``seq`` not received yet (``seq``: the publisher's
        next number, e.g. from the server's status): what is available now, then a replay or a
        snapshot for what is still missing."""
        out = self.receive(0.0)
        if self.next_seq is None or self.next_seq < seq:
            if self.next_seq is None:
                out.extend(self.snapshot())
            else:
                self._recover(out)
        return out

    def _take(self, seq: int, payload: bytes, out: list[KVEventBatch]) -> None:
        if self.next_seq is not None and seq > self.next_seq:
            self._recover(out)
            if seq > (self.next_seq or 0):  # cannot happen with our publishers: resynchronise
                out.extend(self.snapshot())
        if self.next_seq is not None and seq < self.next_seq:
            return  # a copy of what a replay or snapshot delivered
        out.extend(self._handed([(decode_batch(payload), payload)]))
        self.next_seq = seq + 1

    def _handed(self, got: list[tuple[KVEventBatch, bytes]]) -> list[KVEventBatch]:
        if self.payloads is not None:
            self.payloads.extend(p for _b, p in got)
        return [b for b, _p in got]

    def _recover(self, out: list[KVEventBatch]) -> None:
        """Fill the gap from ``next_seq`` by replay; a snapshot when the replay does not start there."""
        assert self.next_seq is not None
        got = self._ask(seq_bytes(self.next_seq))
        self.replays += 1
        if got and got[0][0] == self.next_seq and all(b[0] == a[0] + 1 for a, b in itertools.pairwise(got)):
            out.extend(self._handed([(b, p) for _seq, b, p in got]))
            self.next_seq = got[-1][0] + 1
            return
        out.extend(self.snapshot())

    def _ask(self, request: bytes) -> list[tuple[int, KVEventBatch, bytes]]:
        """Send ``request`` to the replay socket; the batches answered before the end marker."""
        self._replay.send_multipart((b"", request))
        out: list[tuple[int, KVEventBatch, bytes]] = []
        deadline = time.monotonic() + self.timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._replay.poll(int(left * 1000)):
                raise RecoveryFailed("the KV event replay socket did not answer")
            frames = self._replay.recv_multipart()
            if len(frames) != 4:
                continue
            _empty, _topic, raw_seq, payload = frames
            if raw_seq == END_SEQ:
                return out
            out.append((int.from_bytes(raw_seq, "big"), decode_batch(payload), payload))
