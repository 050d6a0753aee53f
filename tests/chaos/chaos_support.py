"""Support code of the chaos suite: deterministic payloads, a fault-injecting TCP proxy, a
fault-injecting backend wrapper, latency figures and record damage.

Nothing here stands in for a storage component: the proxy sits between a real client and a
real ``redis-server``; the faulty backend wraps a real tier (``fs://`` records on real files)
and only adds the faults (exceptions, hangs, dying tasks) a test asks for.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import random
import socket
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import xxhash

from lmcache_async.keys import CacheEngineKey
from lmcache_async.memory import MemoryObj, tensor_byte_view
from lmcache_async.testing.faults import FaultyTier
from lmcache_async.tiers import UNKNOWN, BackendContext, CannotTell, register_backend

SCALE_ENV = "LMCACHE_ASYNC_CHAOS_SCALE"


def scale() -> float:
    """The trial-count multiplier (``LMCACHE_ASYNC_CHAOS_SCALE``, default 1)."""
    try:
        value = float(os.environ.get(SCALE_ENV, "1") or "1")
    except ValueError:
        return 1.0
    return value if math.isfinite(value) and value > 0 else 1.0


def scaled(n: int, minimum: int = 1) -> int:
    """``n`` times the scale, at least ``minimum``."""
    return max(minimum, round(n * scale()))


# ---- figures of the run ----------------------------------------------------------------------------
_figures: dict[str, dict[str, Any]] = {}
_figures_lock = threading.Lock()


def record_figures(section: str, **figures: Any) -> None:
    """Add figures to the run's report, merged by section: counts add up, ``max*``/``p99*``
    figures keep the largest value, anything else keeps the last one."""
    with _figures_lock:
        cur = _figures.setdefault(section, {})
        for k, v in figures.items():
            old = cur.get(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and isinstance(old, (int, float)):
                cur[k] = max(old, v) if k.startswith(("max", "p99", "worst")) else old + v
            else:
                cur[k] = v


def figures_snapshot() -> dict[str, dict[str, Any]]:
    """A copy of the figures recorded so far."""
    with _figures_lock:
        return {k: dict(v) for k, v in _figures.items()}


# ---- keys and payloads -------------------------------------------------------------------------
def chaos_key(i: int, model: str = "chaos/model", dtype: torch.dtype = torch.bfloat16) -> CacheEngineKey:
    """A distinct key per ``i`` (the chunk hash spreads the ids over 64 bits)."""
    return CacheEngineKey(model, 1, 0, (i * 0x9E3779B97F4A7C15 + 0x1234) & ((1 << 64) - 1), dtype)


def entry_size(i: int, lo: int = 256, hi: int = 64 << 10) -> int:
    """Deterministic payload size of entry ``i`` in ``[lo, hi)``, a multiple of 8."""
    span = max(hi - lo, 8)
    return (lo + (i * 7919 + (i >> 3) * 104729) % span) // 8 * 8 or 8


def payload(i: int, nbytes: int, version: int = 0) -> torch.Tensor:
    """Deterministic bytes of entry ``i`` (``version`` gives a key a new value after a remove).

    The first 16 bytes carry ``i`` and ``version``, so a crossed reply shows whose bytes came
    back; the rest is pseudo-random.
    """
    if nbytes < 16:
        raise ValueError("payloads are at least 16 bytes")
    g = torch.Generator().manual_seed((i * 1_000_003 + version) & ((1 << 62) - 1))
    out = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    out[:16] = torch.frombuffer(bytearray(i.to_bytes(8, "little") + version.to_bytes(8, "little")), dtype=torch.uint8)
    return out


def digest_of(t: torch.Tensor) -> int:
    """xxh3-64 of a contiguous CPU tensor's bytes."""
    c = t.contiguous()
    return xxhash.xxh3_64_intdigest(tensor_byte_view(c))


def identity(obj: MemoryObj) -> tuple[int, int]:
    """``(i, version)`` stamped in the first 16 bytes of an entry made by :func:`payload`."""
    head = bytes(obj.byte_view()[:16])
    return int.from_bytes(head[:8], "little"), int.from_bytes(head[8:], "little")


def same_payload(obj: MemoryObj, i: int, nbytes: int, version: int = 0) -> bool:
    """True when ``obj`` holds exactly :func:`payload` ``(i, nbytes, version)``."""
    if obj.nbytes != nbytes or obj.dtype != torch.uint8:
        return False
    want = payload(i, nbytes, version)  # kept alive while its bytes are viewed
    return bytes(obj.byte_view()) == bytes(tensor_byte_view(want))


# ---- latency figures ---------------------------------------------------------------------------
@dataclass
class Latencies:
    """Thread-safe latency samples per operation name (seconds)."""

    samples: dict[str, list[float]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, op: str, seconds: float) -> None:
        with self._lock:
            self.samples.setdefault(op, []).append(seconds)

    def merged(self) -> list[float]:
        with self._lock:
            return [s for v in self.samples.values() for s in v]

    def count(self) -> int:
        with self._lock:
            return sum(len(v) for v in self.samples.values())

    def maximum(self) -> float:
        m = self.merged()
        return max(m) if m else 0.0

    def summary(self) -> dict[str, dict[str, float]]:
        """``{op: {n, p50_ms, p99_ms, max_ms}}`` plus ``all``."""
        with self._lock:
            groups = {k: sorted(v) for k, v in self.samples.items()}
        groups["all"] = sorted(s for v in groups.values() for s in v)
        return {k: _pcts(v) for k, v in groups.items() if v}


def _pcts(v: list[float]) -> dict[str, float]:
    def pct(p: float) -> float:
        return v[min(len(v) - 1, int(p * len(v)))] * 1e3

    return {"n": len(v), "p50_ms": round(pct(0.5), 3), "p99_ms": round(pct(0.99), 3), "max_ms": round(v[-1] * 1e3, 3)}


# ---- record damage -------------------------------------------------------------------------------
def damage_bytes(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    """A damaged copy of ``data``: a flipped bit (header or payload), a truncation, or garbage
    appended. Returns the new bytes and what was done."""
    kind = rng.choice(("flip-header", "flip-payload", "flip-any", "truncate", "append", "zero-page"))
    b = bytearray(data)
    if kind == "flip-header":
        pos = rng.randrange(min(len(b), 64))
        b[pos] ^= 1 << rng.randrange(8)
    elif kind in ("flip-payload", "flip-any"):
        lo = 64 if kind == "flip-payload" and len(b) > 64 else 0
        pos = rng.randrange(lo, len(b))
        b[pos] ^= 1 << rng.randrange(8)
    elif kind == "truncate":
        del b[rng.randrange(len(b)) :]
    elif kind == "append":
        b += bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
    else:  # a zeroed 4 KiB page, as a torn write leaves it
        start = rng.randrange(0, max(1, len(b) // 4096)) * 4096
        end = min(len(b), start + 4096)
        if b[start:end].count(0) == end - start:  # already zero: flip instead
            b[start] ^= 0xFF
        else:
            b[start:end] = bytes(end - start)
    return bytes(b), kind


def damage_file(path: str | os.PathLike[str], rng: random.Random) -> str:
    """Damage the file at ``path`` in place (see :func:`damage_bytes`)."""
    p = Path(path)
    new, kind = damage_bytes(p.read_bytes(), rng)
    p.write_bytes(new)
    return kind


# ---- a fault-injecting TCP proxy -------------------------------------------------------------------
class FaultProxy:
    """A TCP proxy on ``127.0.0.1`` in front of ``(host, port)``, run on its own thread.

    Requests always pass. Replies (server to client) follow :attr:`mode`:

    * ``"pass"`` — forwarded at once;
    * ``"delay"`` — each piece is held ``delay_s`` (optionally jittered by ``jitter_s``)
      before it is forwarded, in order;
    * ``"drop"`` — discarded (the connection stays open: the client waits for its timeout).

    :meth:`reset_all` aborts every open connection (both sides), as a failing middlebox does.
    """

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.mode = "pass"
        self.delay_s = 0.0
        self.jitter_s = 0.0
        self.port = 0
        self.connections = 0
        self.replies_dropped = 0
        self.replies_delayed = 0
        self._rng = random.Random(7)
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-proxy", daemon=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> FaultProxy:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("proxy did not start")
        return self

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def boot() -> None:
            self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
            self.port = self._server.sockets[0].getsockname()[1]
            self._ready.set()

        self._loop.run_until_complete(boot())
        self._loop.run_forever()
        self._loop.run_until_complete(self._loop.shutdown_asyncgens())
        self._loop.close()

    def set(self, mode: str, delay_s: float = 0.0, jitter_s: float = 0.0) -> None:
        if mode not in ("pass", "delay", "drop"):
            raise ValueError(f"unknown proxy mode {mode!r}")
        self.delay_s, self.jitter_s, self.mode = delay_s, jitter_s, mode

    async def _serve(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(cwriter)
        swriter: asyncio.StreamWriter | None = None
        try:
            sreader, swriter = await asyncio.open_connection(*self.target)
        except OSError:
            _abort(cwriter)
            self._writers.discard(cwriter)
            return
        self._writers.add(swriter)
        up = asyncio.ensure_future(self._pump(creader, swriter, False))
        down = asyncio.ensure_future(self._pump(sreader, cwriter, True))
        self._tasks |= {up, down}
        try:
            await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (up, down):
                t.cancel()
            await asyncio.gather(up, down, return_exceptions=True)
            self._tasks -= {up, down}
            for w in (cwriter, swriter):
                _abort(w)
                self._writers.discard(w)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, replies: bool) -> None:
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()
        sender = asyncio.ensure_future(self._sender(queue, writer)) if replies else None
        try:
            while True:
                data = await reader.read(1 << 16)
                if not data:
                    return
                if not replies:
                    writer.write(data)
                    await writer.drain()
                    continue
                mode = self.mode
                if mode == "drop":
                    self.replies_dropped += 1
                    continue
                due = time.monotonic()
                if mode == "delay":
                    self.replies_delayed += 1
                    due += max(0.0, self.delay_s + self._rng.uniform(-self.jitter_s, self.jitter_s))
                queue.put_nowait((due, data))
        except (ConnectionError, OSError):
            return
        finally:
            if sender is not None:
                sender.cancel()
                await asyncio.gather(sender, return_exceptions=True)

    @staticmethod
    async def _sender(queue: asyncio.Queue[tuple[float, bytes] | None], writer: asyncio.StreamWriter) -> None:
        last = 0.0
        while True:
            item = await queue.get()
            if item is None:
                return
            due, data = item
            due = max(due, last)  # keep the order of the stream
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            last = due
            writer.write(data)
            await writer.drain()

    def reset_all(self) -> None:
        """Abort every open connection now."""

        def run() -> None:
            for w in list(self._writers):
                _abort(w)

        self._call(run)

    def _call(self, fn: Any) -> None:
        done = threading.Event()

        def wrapped() -> None:
            try:
                fn()
            finally:
                done.set()

        self._loop.call_soon_threadsafe(wrapped)
        done.wait(10)

    def stop(self) -> None:
        if not self._thread.is_alive():
            return

        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            for w in list(self._writers):
                _abort(w)
            for t in list(self._tasks):
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            if self._server is not None:
                await self._server.wait_closed()
            await asyncio.sleep(0)
            self._loop.stop()

        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(shutdown()))
        self._thread.join(10)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _abort(writer: asyncio.StreamWriter | None) -> None:
    if writer is None:
        return
    with contextlib.suppress(Exception):
        writer.transport.abort()


def wait_port_closed(port: int, timeout: float = 5.0) -> None:
    """Wait until nothing accepts on ``127.0.0.1:port``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            s.settimeout(0.2)
            if s.connect_ex(("127.0.0.1", port)) != 0:
                return
        time.sleep(0.05)


# ---- a fault-injecting backend around a real tier ----------------------------------------------------
class FaultyBackend(FaultyTier):
    """A real tier (``fs://`` records below ``extra_config['chaos_root']``) with injectable faults.

    ``fault`` is one of ``None`` (pass through), ``"raise"`` (every call raises),
    ``"hang"`` (every call waits forever), ``"task-dies"`` (every call also starts a background
    task that raises, and then passes through). ``extra_config['chaos_remote']`` makes it a
    remote tier (``remote_timeout_s``); otherwise the manager gives it half of
    ``blocking_timeout_secs``. The operations are the kit's :class:`FaultyTier`'s; only the
    gate (which faults, and what it counts) differs.
    """

    name = "chaos-faulty"
    instances: list[FaultyBackend] = []

    def __init__(self, ctx: BackendContext) -> None:
        from lmcache_async.remote import RemoteBackend

        extra = ctx.config.extra_config or {}
        super().__init__(RemoteBackend(ctx, f"fs://{extra['chaos_root']}", prefix="chaos"), FaultyBackend.name)
        self._remote = bool(extra.get("chaos_remote", True))
        self.fault: str | None = None
        self.calls = 0
        self.hung = 0
        self.tasks_died = 0
        self._bg: set[asyncio.Task[None]] = set()
        self._never = asyncio.Event()
        FaultyBackend.instances.append(self)

    @property
    def is_remote(self) -> bool:
        return self._remote

    @property
    def persistent(self) -> bool:
        return True

    async def start(self) -> None:
        await self.inner.start()  # never faulted: the tests switch faults on after the start

    async def flush(self) -> None:
        await self.inner.flush()

    async def _gate(self) -> None:
        self.calls += 1
        fault = self.fault
        if fault == "raise":
            raise ConnectionError("injected backend failure")
        if fault == "hang":
            self.hung += 1
            await self._never.wait()
        if fault == "task-dies":

            async def die() -> None:
                self.tasks_died += 1
                raise RuntimeError("injected failure in a backend task")

            t = asyncio.get_running_loop().create_task(die())
            self._bg.add(t)
            t.add_done_callback(self._bg.discard)

    def contains_nowait(self, key: CacheEngineKey) -> bool | CannotTell:
        return UNKNOWN  # always through the loop, where the faults are

    def stats(self) -> dict[str, Any]:
        out = dict(self.inner.stats())
        out.update(calls=self.calls, hung=self.hung, tasks_died=self.tasks_died)
        return out


def register_faulty() -> None:
    """Make ``chaos-faulty`` usable in ``tier_order``."""
    register_backend(FaultyBackend.name, FaultyBackend, replace=True)


# ---- misc ------------------------------------------------------------------------------------------
def files_below(root: str | os.PathLike[str]) -> list[Path]:
    """Every regular file below ``root``."""
    out: list[Path] = []
    for dirpath, _dirs, files in os.walk(root):
        out.extend(Path(dirpath) / f for f in files)
    return out


def tree_snapshot(root: str | os.PathLike[str]) -> set[str]:
    """Relative paths of everything below ``root`` (files, dirs, links)."""
    out: set[str] = set()
    for dirpath, dirs, files in os.walk(root):
        for n in list(dirs) + list(files):
            out.add(os.path.relpath(os.path.join(dirpath, n), root))
    return out


def chunks(seq: Sequence[Any], n: int) -> Iterable[Sequence[Any]]:
    for i in range(0, len(seq), n):
        yield seq[i : i + n]
