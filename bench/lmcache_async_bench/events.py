"""KV events: what publishing costs on the save path, and how fast the server publishes.

* **save path (µs per chunk)**: the node server's work for one chunk stored — grant, commit and
  the ``DESCRIBE`` that names its vLLM blocks — in a :class:`~lmcache_async.server.namespace.Namespace`
  with the server's event source attached (advertiser, ``BlockStored`` built, one batch per
  request of 16 chunks queued for the publisher's thread, which encodes and sends it beside the
  loop) vs the same with no events, alternated in the same run; then the chunks' removal
  (``BlockRemoved``). The difference is the cost per event on the server's loop.
* **publish rate (events/s)**: ``BlockStored`` events through :class:`ZmqEventPublisher` (one
  batch per chunk, as the server publishes them; and batches of 64) until a subscriber on
  loopback received the last one, beside the physical baseline: pyzmq sending the same encoded
  payloads from one thread to the same kind of subscriber.

Informational (no targets). Needs pyzmq and msgspec (the ``events`` extra); without them the suite
reports nothing and says why. Run ``python -m lmcache_async_bench.events`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from .common import BenchOptions, Result, alternate

__all__ = ["SUITE", "run"]

SUITE = "events"
_BLOCKS = 16  # vLLM blocks per chunk (256 tokens of 16-token blocks)
_BLOCK_SIZE = 16
_PER_REQUEST = 16  # chunks one client request stores (a 4,096-token prompt)


def _chunks(n: int, salt: int) -> list[Any]:
    from lmcache_async.events.chunks import Chunk

    out = []
    for i in range(n):
        base = (salt << 40) + i * _BLOCKS
        hashes = tuple((base + b).to_bytes(32, "big") for b in range(_BLOCKS))
        out.append(Chunk(hashes, None, tuple(range(_BLOCKS * _BLOCK_SIZE)), _BLOCK_SIZE))
    return out


def _keys(n: int, salt: int) -> list[bytes]:
    import torch

    from lmcache_async.keys import CacheEngineKey

    return [CacheEngineKey("bench/model", 1, 0, (salt << 32) + i + 1, torch.bfloat16).to_string().encode()
            for i in range(n)]  # fmt: skip


def _save_path(opts: BenchOptions, n: int, reps: int) -> list[Result]:
    import torch

    from lmcache_async.memory import MemoryFormat
    from lmcache_async.server.events import ServerEvents
    from lmcache_async.server.namespace import Namespace
    from lmcache_async.server.protocol import EntryMeta

    meta = EntryMeta.of((64,), torch.float32, MemoryFormat.KV_2LTD)
    events = ServerEvents("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", max_queue=1_000_000)
    spaces = {on: Namespace(f"bench-{on}", 64 << 20, lease_ttl_s=30, max_leases=64, max_grants=1 << 20,
                            listener=events if on else None) for on in (True, False)}  # fmt: skip
    rnd = [0]
    loop = asyncio.new_event_loop()
    events.start(loop)  # one batch per request, as in the server

    async def requests(ns: Any, st: Any, keys: list[bytes], chunks: list[Any], on: bool) -> tuple[float, float]:
        t0 = time.perf_counter()
        for i in range(0, n, _PER_REQUEST):  # one COMMIT, then one DESCRIBE, per request
            for key in keys[i : i + _PER_REQUEST]:
                got = ns.grant(st, meta.nbytes)
                assert got is not None
                ns.commit(st, got[0], key, meta)
            if on:
                for key, chunk in zip(keys[i : i + _PER_REQUEST], chunks[i : i + _PER_REQUEST], strict=True):
                    ns.describe(key, chunk)
            await asyncio.sleep(0)
        t_store = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in range(0, n, _PER_REQUEST):
            for key in keys[i : i + _PER_REQUEST]:
                ns.remove(key)
            await asyncio.sleep(0)
        return t_store, time.perf_counter() - t0

    def store(on: bool, what: str) -> float:
        ns = spaces[on]
        st = ns.add_client(1)
        rnd[0] += 1
        t_store, t_remove = loop.run_until_complete(requests(ns, st, _keys(n, rnd[0]), _chunks(n, rnd[0]), on))
        ns.drop_client(st)
        return (t_store if what == "store" else t_remove) / n

    try:
        out = []
        for what, label in (("store", "BlockStored"), ("remove", "BlockRemoved")):
            fns: list[Callable[[], float]] = [partial(store, True, what), partial(store, False, what)]
            on, off = alternate(fns, reps=reps)
            out.append(Result(SUITE, f"server {what} per chunk, events on ({label}, {_BLOCKS} blocks)", on * 1e6,
                              "us", baseline_name="events off", baseline=off * 1e6,
                              note=f"+{(on - off) * 1e6:.2f} us per chunk", params={"chunks": n}))  # fmt: skip
        events.publisher.flush(30)
        return out
    finally:
        for ns in spaces.values():
            ns.close()
        events.close()
        loop.close()


def _publish_rate(opts: BenchOptions, n: int, per_batch: int) -> Result:
    import zmq

    from lmcache_async.events.publisher import ZmqEventPublisher
    from lmcache_async.events.wire import Event, KVEventBatch, encode_batch
    from lmcache_async.server.events import stored_event

    events: list[Event] = [stored_event(c, "server") for c in _chunks(n, 99)]
    pub = ZmqEventPublisher("tcp://127.0.0.1:0", max_queue=1_000_000, hwm=0)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub.endpoint)
    raw = ctx.socket(zmq.PUB)
    raw.setsockopt(zmq.SNDHWM, 0)
    port = raw.bind_to_random_port("tcp://127.0.0.1")
    rsub = ctx.socket(zmq.SUB)
    rsub.setsockopt(zmq.RCVHWM, 0)
    rsub.setsockopt(zmq.SUBSCRIBE, b"")
    rsub.connect(f"tcp://127.0.0.1:{port}")
    time.sleep(0.3)  # subscriptions reach the publishers
    batches = [events[i : i + per_batch] for i in range(0, n, per_batch)]
    payloads = [encode_batch(KVEventBatch(ts=0.0, events=b)) for b in batches]

    def ours() -> float:
        t0 = time.perf_counter()
        for b in batches:
            pub.publish(b)
        for _ in batches:
            sub.recv_multipart()
        return (time.perf_counter() - t0) / n

    def bare() -> float:
        t0 = time.perf_counter()
        for i, p in enumerate(payloads):
            raw.send_multipart((b"", i.to_bytes(8, "big"), p))
        for _ in payloads:
            rsub.recv_multipart()
        return (time.perf_counter() - t0) / n

    try:
        a, b = alternate([ours, bare], reps=max(opts.reps, 3))
        return Result(SUITE, f"server publish rate, {per_batch} event(s) per batch", 1 / a, "events/s",
                      baseline_name="pyzmq send of the same encoded payloads", baseline=1 / b, higher_is_better=True,
                      note="our encode, queue, thread and buffer beside a bare send", params={"events": n})  # fmt: skip
    finally:
        pub.close()
        for s in (sub, raw, rsub):
            s.close(linger=0)
        ctx.term()


def run(opts: BenchOptions) -> list[Result]:
    """Every figure of the suite (see the module docstring); none, with a line saying why,
    without pyzmq and msgspec."""
    try:
        import msgspec  # noqa: F401
        import zmq  # noqa: F401
    except ImportError as exc:
        opts.say(f"events skipped: {exc} (pip install lmcache-async[events])")
        return []
    n = 500 if opts.quick else 5000
    reps = max(opts.reps, 3) if opts.quick else 2 * max(opts.reps, 5) + 1
    out = _save_path(opts, n, reps)
    opts.say("events: save path measured")
    out += [_publish_rate(opts, n, 1), _publish_rate(opts, n, 64)]
    return out


if __name__ == "__main__":
    import sys

    from .common import format_table

    quick = "--quick" in sys.argv
    print(format_table(run(BenchOptions(progress=print, quick=quick))))
