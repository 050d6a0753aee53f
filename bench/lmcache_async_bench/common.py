"""Shared pieces of the benchmark suites: timing, baselines, results and their table.

Every figure is the median over ``reps`` (>= 5) repetitions after a warm-up, printed beside a
physical baseline measured in the same run, with the ratio. A suite is a module in
:mod:`lmcache_async_bench` exposing ``run(opts: BenchOptions) -> list[Result]``.

Baselines (SPEC §6), all measured in the same process and run as the figure they sit beside:

* :class:`CopyBaseline` — ``copy_`` from rotating sources into pre-touched destinations rotating
  over >= 128 MiB (DRAM-bound, like a pool);
* :class:`CloneBaseline` — ``clone()`` whose results are kept, as many as the measured call keeps;
* :class:`FileBaseline` — plain Python, one executor job per whole file, temp name + rename, same
  fsync policy; reads with ``readinto`` into pre-touched buffers;
* :class:`HopBaseline` — a bare ``run_coroutine_threadsafe(...).result()`` round trip;
* the redis baseline (raw ``redis.asyncio`` SET/GET) lives with the remote suite.

``Result.params`` convention (read by :mod:`lmcache_async_bench.plot` and by JSON consumers):

* ``"size"``: entry size in bytes. A Result carrying it is a point of a throughput-vs-entry-size
  curve; the plot converts a time per operation to GB/s with ``size`` (times ``"entries"``
  when one operation moves several entries) and draws the baseline as a dashed line.
* ``"series"``: the curve's label (default: the figure name); results of one series share it.
* ``"panel"``: the plot panel (default: the suite name), e.g. ``"cpu tier"``, ``"disk tier"``.
* ``"entries"``: entries moved by one timed operation (default 1).
* ``"concurrency"``: number of concurrent tasks/threads; a Result carrying it (and no ``"size"``)
  is a point of a throughput-vs-concurrency curve (its value must be a throughput).
Other keys are free-form and land in the JSON output unchanged.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

__all__ = [
    "BenchOptions",
    "CloneBaseline",
    "CopyBaseline",
    "FileBaseline",
    "HopBaseline",
    "MiB",
    "Result",
    "alternate",
    "better",
    "evict_from_page_cache",
    "format_markdown",
    "format_series_summary",
    "format_table",
    "median_of",
    "median_time",
    "throughput_gbs",
    "with_redis",
]

MiB = 1 << 20


@dataclass
class BenchOptions:
    """Knobs every suite honours. ``quick`` shrinks sizes/counts for smoke runs."""

    reps: int = 5
    warmup: int = 1
    quick: bool = False
    workdir: str | None = None  # where disk/fs suites put files (a temp dir when None)
    redis_url: str | None = None  # a running server; suites start their own when None
    progress: Callable[[str], None] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def say(self, msg: str) -> None:
        if self.progress is not None:
            self.progress(msg)


@dataclass
class Result:
    """One measured figure beside its baseline.

    ``higher_is_better`` tells how to read ``ratio`` (value/baseline): for times (lower is
    better) a ratio of 1.1 means 10 % slower than the baseline; for throughputs it means faster.
    ``target`` is the acceptance bound on ``ratio`` (or on ``value`` when ``baseline`` is None),
    with ``target_kind`` ``"max"`` or ``"min"``.
    """

    suite: str
    name: str
    value: float
    unit: str
    baseline_name: str | None = None
    baseline: float | None = None
    higher_is_better: bool = False
    target: float | None = None
    target_kind: str = "max"
    note: str = ""
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        if self.baseline is None or self.baseline == 0:
            return None
        return self.value / self.baseline

    @property
    def met(self) -> bool | None:
        if self.target is None:
            return None
        x = self.ratio if self.baseline is not None else self.value
        if x is None:
            return None
        return x <= self.target if self.target_kind == "max" else x >= self.target

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ratio"] = self.ratio
        d["met"] = self.met
        return d


def median_time(fn: Callable[[], Any], reps: int = 5, warmup: int = 1, inner: int = 1) -> float:
    """Median seconds per call of ``fn`` (each repetition runs it ``inner`` times)."""
    for _ in range(warmup):
        for _ in range(inner):
            fn()
    samples = []
    for _ in range(max(reps, 1)):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - t0) / inner)
    return statistics.median(samples)


def median_of(samples: Iterable[float]) -> float:
    return statistics.median(list(samples))


class CopyBaseline:
    """SPEC §6 copy baseline: ``copy_`` from rotating sources into pre-touched destinations
    rotating over >= 128 MiB (DRAM-bound, like a pool), not into one cache-hot buffer."""

    def __init__(self, nbytes: int, span: int = 256 * MiB, dtype: torch.dtype = torch.float32) -> None:
        self.nbytes = nbytes
        n = max(span // max(nbytes, 1), 4)
        numel = nbytes // dtype.itemsize
        self.dst = [torch.empty(numel, dtype=dtype) for _ in range(n)]
        for d in self.dst:
            d.fill_(0)
        self.src = [torch.randn(numel).to(dtype) for _ in range(max(4, min(n, (128 * MiB) // max(nbytes, 1))))]
        self._i = 0

    def step(self) -> None:
        i = self._i
        self._i = i + 1
        self.dst[i % len(self.dst)].copy_(self.src[i % len(self.src)])

    def measure(self, reps: int = 5, inner: int | None = None) -> float:
        """Median seconds per copy."""
        inner = inner or max(len(self.dst), 16)
        return median_time(self.step, reps=reps, warmup=1, inner=inner)


def alternate(fns: Sequence[Callable[[], float]], reps: int = 5, warmup: int = 1) -> list[float]:
    """Run each of ``fns`` (each returns seconds per operation for one repetition) ``reps``
    times, interleaved A, B, ..., B, A, ... so drift and background noise hit all of them;
    returns the median of each. ``warmup`` unrecorded rounds come first."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    samples: list[list[float]] = [[] for _ in fns]
    order = list(range(len(fns)))
    for r in range(max(reps, 1)):
        for i in order if r % 2 == 0 else reversed(order):
            samples[i].append(fns[i]())
    return [statistics.median(s) for s in samples]


class CloneBaseline:
    """SPEC §6 clone baseline: ``clone()`` whose results are kept, as many as the measured call
    keeps (``keep`` per repetition), from sources rotating over >= 64 MiB.

    This is what a call that returns a fresh tensor the caller holds on to costs at least: the
    allocation and first touch of new memory plus one copy.
    """

    def __init__(self, nbytes: int, keep: int, dtype: torch.dtype = torch.float32) -> None:
        self.nbytes = nbytes
        self.keep = max(int(keep), 1)
        numel = max(nbytes // dtype.itemsize, 1)
        nsrc = max(4, min(self.keep, (64 * MiB) // max(nbytes, 1)))
        self.src = [torch.randn(numel).to(dtype) for _ in range(nsrc)]

    def run_once(self) -> float:
        """Seconds per clone for one repetition of ``keep`` kept clones (dropped afterwards)."""
        kept: list[torch.Tensor] = []
        src = self.src
        n = len(src)
        t0 = time.perf_counter()
        for i in range(self.keep):
            kept.append(src[i % n].clone())
        dt = time.perf_counter() - t0
        del kept
        return dt / self.keep

    def measure(self, reps: int = 5) -> float:
        """Median seconds per kept clone."""
        self.run_once()
        return statistics.median(self.run_once() for _ in range(max(reps, 1)))


class HopBaseline:
    """SPEC §6 hop baseline: a bare ``asyncio.run_coroutine_threadsafe(...).result()`` round
    trip to a loop running on its own thread (nothing else on it)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="bench-hop", daemon=True)
        self._thread.start()

    @staticmethod
    async def _noop() -> None:
        return None

    def step(self) -> None:
        asyncio.run_coroutine_threadsafe(self._noop(), self.loop).result()

    def measure(self, reps: int = 5, inner: int = 1000) -> float:
        """Median seconds per round trip."""
        return median_time(self.step, reps=reps, warmup=1, inner=inner)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU uint8 tensor (zero copy)."""
    return t.numpy().data


def evict_from_page_cache(paths: Iterable[str]) -> int:
    """Write back and drop the page-cache pages of ``paths`` (``fdatasync`` +
    ``POSIX_FADV_DONTNEED``), so the next read of them is a cold read from the device.

    Per file, needs no privileges and leaves other processes' cached pages alone. Returns how
    many files were dropped (missing files are skipped).
    """
    n = 0
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            n += 1
        finally:
            os.close(fd)
    return n


class FileBaseline:
    """SPEC §6 file baseline: plain Python file I/O of ``count`` payloads of ``nbytes``.

    Writes: one executor job per whole file (open a temp name, write the bytes from a
    memoryview, fsync per ``fsync`` — ``"none"``, ``"data"`` (fdatasync) or ``"full"`` (fsync +
    directory fsync) — then ``os.replace`` to the final name). Reads: one executor job per whole
    file, ``readinto`` a pre-touched buffer. ``workers`` threads run the jobs (as many as the
    measured tier's executor). Files live under ``directory`` (created), removed by :meth:`close`.
    """

    def __init__(
        self,
        directory: str,
        nbytes: int,
        count: int,
        *,
        fsync: str = "none",
        workers: int = 4,
    ) -> None:
        if fsync not in ("none", "data", "full"):
            raise ValueError(f"fsync must be 'none', 'data' or 'full', got {fsync!r}")
        self.dir = os.path.join(directory, f"file-baseline-{uuid.uuid4().hex[:8]}")
        os.makedirs(self.dir, exist_ok=True)
        self.nbytes = nbytes
        self.count = max(int(count), 1)
        self.fsync = fsync
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="bench-file")
        nsrc = max(1, min(self.count, (64 * MiB) // max(nbytes, 1)))
        self._src = [_bytes_of(torch.randint(0, 255, (nbytes,), dtype=torch.uint8)) for _ in range(nsrc)]
        ndst = min(self.count, max(4, (128 * MiB) // max(nbytes, 1)))
        self._dst = [_bytes_of(torch.empty(nbytes, dtype=torch.uint8).fill_(1)) for _ in range(ndst)]
        self.paths = [os.path.join(self.dir, f"{i:06d}.bin") for i in range(self.count)]

    def _write_one(self, i: int) -> None:
        final = self.paths[i]
        tmp = f"{final}.{os.getpid()}.{uuid.uuid4().hex[:6]}.tmp"
        with open(tmp, "wb", buffering=0) as f:
            f.write(self._src[i % len(self._src)])
            if self.fsync != "none":
                os.fdatasync(f.fileno()) if self.fsync == "data" else os.fsync(f.fileno())
        os.replace(tmp, final)
        if self.fsync == "full":
            dfd = os.open(self.dir, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    def _read_one(self, i: int) -> int:
        buf = self._dst[i % len(self._dst)]
        with open(self.paths[i], "rb", buffering=0) as f:
            return f.readinto(buf)

    def write_all(self) -> float:
        """Seconds per file to write all ``count`` files (jobs submitted at once, all awaited)."""
        t0 = time.perf_counter()
        list(self._pool.map(self._write_one, range(self.count)))
        return (time.perf_counter() - t0) / self.count

    def read_all(self, cold: bool = False) -> float:
        """Seconds per file to read all files back; ``cold`` drops them from the page cache first
        (outside the timing)."""
        if cold:
            evict_from_page_cache(self.paths)
        t0 = time.perf_counter()
        got = list(self._pool.map(self._read_one, range(self.count)))
        dt = time.perf_counter() - t0
        if any(g != self.nbytes for g in got):
            raise RuntimeError("file baseline: short read")
        return dt / self.count

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for p in os.listdir(self.dir):
            try:
                os.unlink(os.path.join(self.dir, p))
            except OSError:
                pass
        try:
            os.rmdir(self.dir)
        except OSError:
            pass


def with_redis(opts: BenchOptions, label: str, fn: Callable[[str], list[Result]]) -> list[Result]:
    """``fn(url)`` against ``opts.redis_url``, else against a ``redis-server``/``valkey-server``
    started on a loopback port for the call; no results (and a progress line naming ``label``)
    when there is neither."""
    if opts.redis_url is not None:
        return fn(opts.redis_url)
    from lmcache_async.testing.servers import RedisServer, find_server_binary

    binary = find_server_binary()
    if binary is None:
        opts.say(f"{label} skipped: no redis-server/valkey-server binary")
        return []
    with RedisServer(binary) as srv:
        opts.say(f"{label}: started {srv!r}")
        return fn(srv.url)


def throughput_gbs(r: Result) -> tuple[float | None, float | None]:
    """``(value, baseline)`` of ``r`` as GB/s (10^9 bytes/s), using ``params["size"]`` (times
    ``params["entries"]``) to convert a time per operation; ``(None, None)`` when ``r`` has no
    size or an unknown unit."""
    size = r.params.get("size")
    if size is None:
        return None, None
    nbytes = float(size) * float(r.params.get("entries", 1))
    scale = _TIME_UNITS.get(r.unit)

    def conv(x: float | None) -> float | None:
        if x is None:
            return None
        if r.unit == "GB/s":
            return x
        if r.unit == "MB/s":
            return x / 1e3
        if scale is None or x <= 0:
            return None
        return nbytes / (x * scale) / 1e9

    return conv(r.value), conv(r.baseline)


_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "µs": 1e-6, "us": 1e-6, "ns": 1e-9}


def better(r: Result) -> str:
    """``"higher"`` or ``"lower"``: which way ``r``'s value (and its ratio) is better."""
    return "higher" if r.higher_is_better else "lower"


def format_table(results: list[Result], *, smoke: bool = False) -> str:
    """A fixed-width table: suite, figure, value, which way is better, baseline, ratio, target,
    met. Values carry their units; the target applies to the ratio, or to the value when there
    is no baseline (then it carries the unit). ``smoke``: a ``--quick`` run, whose shrunk sizes
    make targets meaningless: the last column says ``smoke`` instead of judging."""
    rows = [("suite", "figure", "value", "better", "baseline", "ratio", "target", "ok")]
    for r in results:
        val = f"{r.value:.4g} {r.unit}"
        base = f"{r.baseline_name}: {r.baseline:.4g} {r.unit}" if r.baseline is not None else "-"
        ratio = f"{r.ratio:.3f}" if r.ratio is not None else "-"
        tgt = "-"
        if r.target is not None:
            tgt = ("<= " if r.target_kind == "max" else ">= ") + f"{r.target:g}"
            if r.baseline is None:
                tgt += f" {r.unit}"
        ok = "smoke" if smoke and r.met is not None else {True: "yes", False: "NO", None: ""}[r.met]
        rows.append((r.suite, r.name, val, better(r), base, ratio, tgt, ok))
    return _fixed_width(rows)


def _fixed_width(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


_DASH = "\u2013"  # an en dash between the ends of a range


def _span(values: list[float], unit: str = "", fmt: str = ".4g") -> str:
    lo, hi = min(values), max(values)
    a, b = format(lo, fmt), format(hi, fmt)
    text = a if a == b else f"{a}{_DASH}{b}"
    return f"{text} {unit}".rstrip()


def format_series_summary(results: list[Result]) -> str:
    """Minimum and maximum of every curve of ``results`` (the points sharing ``params["panel"]`` and
    ``params["series"]`` across sizes or concurrency levels): values and baselines with units,
    ratios, and which way is better. ``""`` when no curve has two points or more."""
    groups: dict[tuple[str, str], list[Result]] = {}
    for r in results:
        p = r.params or {}
        if "size" not in p and "concurrency" not in p:
            continue
        groups.setdefault((str(p.get("panel", r.suite)), str(p.get("series", r.name))), []).append(r)
    span = f"min{_DASH}max"
    rows = [("curve", "points", f"value {span}", f"baseline {span}", f"ratio {span}", "better")]
    for (panel, series), rs in groups.items():
        if len(rs) < 2 or len({r.unit for r in rs}) != 1:
            continue
        bases = [r.baseline for r in rs if r.baseline is not None]
        ratios = [x for x in (r.ratio for r in rs) if x is not None]
        rows.append(
            (
                f"{panel} / {series}",
                str(len(rs)),
                _span([r.value for r in rs], rs[0].unit),
                _span(bases, rs[0].unit) if bases else "-",
                _span(ratios, fmt=".3f") if ratios else "-",
                better(rs[0]),
            )
        )
    return _fixed_width(rows) if len(rows) > 1 else ""


def format_markdown(results: list[Result]) -> str:
    """The same table as :func:`format_table`, as Markdown (for ``docs/benchmarks.md``)."""
    lines = ["| suite | figure | value | baseline | ratio | target | ok |", "|---|---|---|---|---|---|---|"]
    for r in results:
        base = f"{r.baseline_name}: {r.baseline:.4g} {r.unit}" if r.baseline is not None else "—"
        ratio = f"{r.ratio:.3f}" if r.ratio is not None else "—"
        tgt = (("≤ " if r.target_kind == "max" else "≥ ") + f"{r.target:g}") if r.target is not None else "—"
        ok = {True: "yes", False: "**no**", None: ""}[r.met]
        lines.append(f"| {r.suite} | {r.name} | {r.value:.4g} {r.unit} | {base} | {ratio} | {tgt} | {ok} |")
    return "\n".join(lines)
