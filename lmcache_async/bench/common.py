"""Shared pieces of the benchmark suites: timing, baselines, results and their table.

Every figure is the median over ``reps`` (>= 5) repetitions after a warm-up, printed beside a
physical baseline measured in the same run, with the ratio. A suite is a module in
:mod:`lmcache_async.bench` exposing ``run(opts: BenchOptions) -> list[Result]``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

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


def format_table(results: list[Result]) -> str:
    """A fixed-width table: suite, figure, value, baseline, ratio, target, met."""
    rows = [("suite", "figure", "value", "baseline", "ratio", "target", "ok")]
    for r in results:
        val = f"{r.value:.4g} {r.unit}"
        base = f"{r.baseline_name}: {r.baseline:.4g} {r.unit}" if r.baseline is not None else "-"
        ratio = f"{r.ratio:.3f}" if r.ratio is not None else "-"
        tgt = (("<= " if r.target_kind == "max" else ">= ") + f"{r.target:g}") if r.target is not None else "-"
        ok = {True: "yes", False: "NO", None: ""}[r.met]
        rows.append((r.suite, r.name, val, base, ratio, tgt, ok))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
