"""The A/B driver: every workload on ours, LMCache and the physical baseline, alternating.

Three long-lived worker processes (``worker.py --serve``; LMCache's runs in its own venv) answer
one request at a time, so only one system runs at any moment. For each workload and size the
driver runs ``rounds`` rounds; each round asks every system for ``reps`` timed repetitions
(after its own warm-up) and the order flips every round (ours, LMCache, baseline, then
baseline, LMCache, ours, ...) so drift and background load hit all three alike. A figure is the
median over all the repetitions a system produced. The ratio is LMCache's median over ours (for
times per operation: > 1 means ours is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

from lmcache_async._subprocess import module_command

from . import _harness
from .worker import LMCACHE_SIDE, default_lmcache_python

SYSTEMS = ("ours", "lmcache", "baseline")

# Acceptance targets on the ratio LMCache/ours (per op time), from the issue; None: report only.
TARGETS: dict[tuple[str, int | None], float] = {
    ("ec_put", 256 << 10): 2.0,
    ("ec_put", 4 << 20): 1.5,
    ("ec_get", 256 << 10): 3.0,
    ("ec_get", 1 << 20): 3.0,
    ("ec_get", 4 << 20): 0.95,
    ("ec_contains", None): 1.5,
    ("hs_store", None): 0.95,
    ("hs_retrieve", None): 0.95,
    ("hs_retrieve_out", None): 4.0,
    ("disk_write_through", None): 1.5,
}

DEFAULT_ORDER = (
    "ec_put",
    "ec_get",
    "ec_contains",
    "ec_contains_miss",
    "hs_store",
    "hs_retrieve",
    "hs_retrieve_out",
    "cpu_batched_put",
    "cpu_batched_get",
    "disk_write_through",
    "disk_cold_read",
    "ec_get_after_eviction",
)


_SIZED = {"ec_put", "ec_get", "cpu_batched_put", "disk_write_through", "disk_cold_read"}  # copies: GB/s means something


def target_for(workload: str, size: int) -> float | None:
    """The minimum LMCache/ours ratio the issue asks for, or None."""
    t = TARGETS.get((workload, size))
    return t if t is not None else TARGETS.get((workload, None))


def human_size(n: int) -> str:
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


class Worker:
    """One system's long-lived worker process (JSON lines over pipes)."""

    def __init__(self, system: str, cmd: list[str], log: IO[str], env: dict[str, str] | None = None) -> None:
        self.system = system
        self.cmd = cmd
        self.log = log
        self.env = env
        self.proc: subprocess.Popen[str] | None = None

    def _start(self) -> subprocess.Popen[str]:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen(
                self.cmd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self.log,
                text=True,
                bufsize=1,
                env=self.env,
            )
        return self.proc

    def ask(self, req: dict[str, Any]) -> dict[str, Any]:
        """Send one request; the outcome dict (an error outcome when the worker died)."""
        proc = self._start()
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(json.dumps(req) + "\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
        except (BrokenPipeError, OSError) as exc:
            line = ""
            err = f"worker pipe: {exc}"
        else:
            err = "worker exited (see the worker log)"
        if not line:
            rc = proc.poll()
            self.proc = None
            return {
                "system": self.system,
                "workload": req.get("workload"),
                "size": req.get("size"),
                "ok": False,
                "error": f"{err}; rc={rc}",
                "samples": [],
            }
        out: dict[str, Any] = json.loads(line)
        return out

    def close(self) -> None:
        proc = self.proc
        if proc is None:
            return
        try:
            if proc.poll() is None and proc.stdin is not None:
                proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                proc.stdin.close()
            proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
        self.proc = None


@dataclass
class Row:
    """Both systems' figures for one workload and size."""

    workload: str
    size: int
    samples: dict[str, list[float]] = field(default_factory=dict)
    hits: dict[str, int] = field(default_factory=dict)
    misses: dict[str, int] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    faults: dict[str, int] = field(default_factory=dict)
    bytes_per_op: int = 0

    def median(self, system: str) -> float | None:
        s = self.samples.get(system)
        return statistics.median(s) if s else None

    @property
    def ratio(self) -> float | None:
        """LMCache's median time per operation over ours (> 1: ours is faster); None for the
        hit/miss figures (a miss is not a speed)."""
        if self.workload in _harness.NO_BASELINE:
            return None
        ours, lmc = self.median("ours"), self.median("lmcache")
        if ours is None or lmc is None or ours <= 0:
            return None
        return lmc / ours

    @property
    def target(self) -> float | None:
        return target_for(self.workload, self.size)

    def faults_per_op(self, system: str) -> float | None:
        """Minor page faults per timed operation (only the workloads that keep their results
        count them): fresh result memory costs a fault per 4 KiB page."""
        f, n = self.faults.get(system), self.hits.get(system, 0) + self.misses.get(system, 0)
        return None if not f or n == 0 else f / n

    def hit_rate(self, system: str) -> float | None:
        h, m = self.hits.get(system, 0), self.misses.get(system, 0)
        return None if h + m == 0 else h / (h + m)

    @property
    def met(self) -> bool | None:
        if self.workload == "ec_get_after_eviction":
            rate = self.hit_rate("ours")
            return None if rate is None else rate == 1.0
        r, t = self.ratio, self.target
        return None if r is None or t is None else r >= t

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "workload": self.workload,
            "size": self.size,
            "bytes_per_op": self.bytes_per_op,
            "ratio": self.ratio,
            "target": self.target,
            "met": self.met,
        }
        for s in SYSTEMS:
            d[s] = {
                "median_s": self.median(s),
                "samples": self.samples.get(s, []),
                "hits": self.hits.get(s, 0),
                "misses": self.misses.get(s, 0),
                "error": self.errors.get(s, ""),
                "note": self.notes.get(s, ""),
                "faults_per_op": self.faults_per_op(s),
            }
        return d


def _fmt_t(x: float | None) -> str:
    if x is None:
        return "n/a"
    if x >= 1e-3:
        return f"{x * 1e3:.3g} ms"
    return f"{x * 1e6:.3g} µs"


def format_rows(rows: list[Row]) -> str:
    """The comparison table: both medians, our ratio, the target and the same-run baseline."""
    head = (
        "workload",
        "size",
        "ours",
        "LMCache 0.5.6",
        "ratio",
        "target",
        "ok",
        "baseline",
        "ours/base",
        "LMC/base",
        "ours GB/s",
        "note",
    )
    table: list[tuple[str, ...]] = [head]
    for r in rows:
        o, lmc, b = r.median("ours"), r.median("lmcache"), r.median("baseline")
        note = ""
        if r.workload == "ec_get_after_eviction":
            parts = []
            for s, label in (("ours", "ours"), ("lmcache", "LMCache")):
                rate = r.hit_rate(s)
                if rate is not None:
                    n = r.hits.get(s, 0) + r.misses.get(s, 0)
                    parts.append(f"{label} {r.hits.get(s, 0)}/{n} hit" + (" (miss)" if rate == 0 else ""))
            note = ", ".join(parts)
        errs = [f"{s}: {e}" for s, e in r.errors.items() if e]
        if errs:
            note = (note + "; " if note else "") + "; ".join(e[:90] for e in errs)
        elif r.notes.get("lmcache") and r.workload == "hs_retrieve_out":
            note = "LMCache has no out=: its plain retrieve"
        faults = [(s, r.faults_per_op(s)) for s in SYSTEMS]
        if any(f is not None for _, f in faults):
            note = (
                (note + "; " if note else "")
                + "faults/op "
                + ", ".join(f"{s} {f or 0:.3g}" for s, f in faults if s in r.samples)
            )
        gbs = f"{r.bytes_per_op / o / 1e9:.2f}" if o and r.bytes_per_op else "-"
        ratio = f"{r.ratio:.2f}x" if r.ratio is not None else "n/a"
        tgt = f">= {r.target:g}x" if r.target is not None else "-"
        if r.workload == "ec_get_after_eviction":
            tgt = "ours hits"
        ok = {True: "yes", False: "NO", None: ""}[r.met]
        ob = f"{o / b:.2f}" if o and b else "-"
        lb = f"{lmc / b:.2f}" if lmc and b else "-"
        table.append(
            (r.workload, human_size(r.size), _fmt_t(o), _fmt_t(lmc), ratio, tgt, ok, _fmt_t(b), ob, lb, gbs, note)
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_markdown(rows: list[Row]) -> str:
    """The comparison as a Markdown table (for ``docs/benchmarks.md``)."""
    lines = [
        "| workload | size | ours | LMCache 0.5.6 | ratio | target | ok | baseline | ours/base | LMC/base |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        o, lmc, b = r.median("ours"), r.median("lmcache"), r.median("baseline")
        if r.workload in _harness.NO_BASELINE:
            parts = []
            for s, label in (("ours", "ours"), ("lmcache", "LMCache")):
                n = r.hits.get(s, 0) + r.misses.get(s, 0)
                if n:
                    parts.append(f"{label} {r.hits.get(s, 0)}/{n} hits")
            ratio, tgt = "; ".join(parts) or "n/a", "ours hits, LMCache misses"
        else:
            ratio = f"{r.ratio:.2f} x" if r.ratio is not None else "n/a"
            tgt = f"≥ {r.target:g} x" if r.target is not None else "—"
        ok = {True: "yes", False: "**no**", None: ""}[r.met]
        ob = f"{o / b:.2f}" if o and b else "—"
        lb = f"{lmc / b:.2f}" if lmc and b else "—"
        lines.append(
            f"| `{r.workload}` | {human_size(r.size)} | {_fmt_t(o)} | {_fmt_t(lmc)} | {ratio} | {tgt} | {ok} "
            f"| {_fmt_t(b) if b else '—'} | {ob} | {lb} |"
        )
    return "\n".join(lines)


def rows_to_results(rows: list[Row]) -> list[Any]:
    """The rows as :class:`~lmcache_async_bench.common.Result` objects (one per system and
    size, with the baseline and ``params`` for :func:`~lmcache_async_bench.plot.plot_results`)."""
    from ..common import Result

    labels = {"ours": "lmcache_async", "lmcache": "LMCache 0.5.6"}
    out = []
    for r in rows:
        base = r.median("baseline")
        entries = max(1, r.bytes_per_op // r.size) if r.bytes_per_op and r.size else 1
        for system, label in labels.items():
            med = r.median(system)
            if med is None:
                continue
            # The baseline is the same for both systems: it rides on ours only (drawn once).
            b = base if system == "ours" else None
            out.append(
                Result(
                    "compare",
                    f"{r.workload} {human_size(r.size)} ({label})",
                    med * 1e6,
                    "µs",
                    "physical baseline" if b is not None else None,
                    b * 1e6 if b is not None else None,
                    params={
                        "size": r.size,
                        "entries": entries,
                        "series": label,
                        "panel": f"compare: {r.workload}",
                        "workload": r.workload,
                        "system": system,
                    },
                )
            )
    return out


def machine_info() -> dict[str, Any]:
    """What the figures were measured on."""
    info: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
    }
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo", encoding="utf-8") as f:
            info["mem_gib"] = round(int(f.readline().split()[1]) / (1 << 20), 1)
        info["loadavg"] = os.getloadavg()
    except OSError:
        pass
    try:
        import torch

        info["torch"] = torch.__version__
    except ImportError:  # pragma: no cover
        pass
    return info


def _measure_row(
    args: argparse.Namespace,
    name: str,
    size: int,
    systems: list[str],
    workers: dict[str, Worker],
    workdir: str,
    lmc_py: str,
    say: Callable[[str], None],
) -> Row:
    """One table row: ``args.rounds`` A/B rounds of workload ``name`` at entry ``size`` on every
    system in ``systems`` (the order flips each round), samples and counters pooled."""
    row = Row(name, size)
    for rnd in range(args.rounds):
        order = systems if rnd % 2 == 0 else list(reversed(systems))
        got = []
        for system in order:
            if system == "baseline" and name in _harness.NO_BASELINE:
                continue
            if system == "lmcache" and not os.path.exists(lmc_py):
                row.errors[system] = "not available (no LMCache venv)"
                continue
            req = {
                "workload": name,
                "size": size,
                "reps": args.reps,
                "warmup": args.warmup,
                "workdir": workdir,
                "quick": args.quick,
            }
            out = workers[system].ask(req)
            row.bytes_per_op = row.bytes_per_op or int(out.get("bytes_per_op") or 0)
            if out.get("ok"):
                row.samples.setdefault(system, []).extend(out.get("samples", []))
                row.hits[system] = row.hits.get(system, 0) + int(out.get("hits", 0))
                row.misses[system] = row.misses.get(system, 0) + int(out.get("misses", 0))
                row.faults[system] = row.faults.get(system, 0) + int(out.get("faults", 0))
                if out.get("note"):
                    row.notes[system] = str(out["note"])
                got.append(f"{system} {_fmt_t(out.get('median'))}")
            else:
                row.errors[system] = str(out.get("error", "failed"))
                got.append(f"{system} failed")
        say(f"{name} {human_size(size)} round {rnd + 1}/{args.rounds}: " + ", ".join(got))
    return row


def _report(args: argparse.Namespace, rows: list[Row], log_path: str, say: Callable[[str], None]) -> None:
    """Print the table and the machine, then write the JSON, Markdown and plot files asked for."""
    print()
    print("LMCache 0.5.6 vs lmcache_async — median time per operation; ratio = LMCache / ours (> 1: ours faster)")
    print(format_rows(rows))
    print(f"\nmachine: {json.dumps(machine_info())}")
    print(f"worker log: {log_path}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "machine": machine_info(),
                    "rounds": args.rounds,
                    "reps": args.reps,
                    "rows": [r.to_dict() for r in rows],
                },
                f,
                indent=2,
            )
        say(f"JSON written to {args.json}")
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as f:
            f.write(format_markdown(rows) + "\n")
        say(f"Markdown table written to {args.markdown}")
    if args.plot:
        from ..plot import plot_results

        plottable = [x for x in rows_to_results(rows) if x.params["workload"] in _SIZED]
        if plottable:
            plot_results(plottable, args.plot)
            say(f"plot written to {args.plot}")


def run(args: argparse.Namespace) -> int:
    """Measure every workload and size asked for on every system, in worker processes
    (:func:`_measure_row`), then report (:func:`_report`)."""
    start = time.monotonic()

    def say(msg: str) -> None:
        print(f"[{time.monotonic() - start:7.1f}s] {msg}", file=sys.stderr, flush=True)

    names = [w.strip() for w in (args.workloads or ",".join(DEFAULT_ORDER)).split(",") if w.strip()]
    unknown = [n for n in names if n not in _harness.WORKLOADS]
    if unknown:
        print(f"unknown workload(s): {', '.join(unknown)}; known: {', '.join(_harness.WORKLOADS)}", file=sys.stderr)
        return 2
    systems = [s for s in SYSTEMS if s not in (args.skip or [])]
    workdir = args.workdir or tempfile.mkdtemp(prefix="lmcache-compare-")
    own_workdir = args.workdir is None
    os.makedirs(workdir, exist_ok=True)
    log_dir = tempfile.gettempdir() if own_workdir else workdir
    log_path = os.path.join(log_dir, "lmcache-compare-workers.log")
    lmc_py = args.lmcache_python or default_lmcache_python()
    if "lmcache" in systems and not os.path.exists(lmc_py):
        say(f"LMCache python not found at {lmc_py} (run scripts/lmcache_env.sh): LMCache is reported as not available")
    env = dict(os.environ)
    env.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    rows: list[Row] = []
    with open(log_path, "w", encoding="utf-8") as log:
        ours_cmd = module_command("lmcache_async_bench.compare.worker", "--serve", "--system")
        workers = {
            "ours": Worker("ours", [*ours_cmd, "ours"], log),
            "baseline": Worker("baseline", [*ours_cmd, "baseline"], log),
            "lmcache": Worker("lmcache", [lmc_py, LMCACHE_SIDE, "--serve"], log, env=env),
        }
        try:
            for name in names:
                sizes = args.sizes or list(_harness.WORKLOADS[name][1])
                if args.quick:
                    sizes = sizes[:1]
                for size in sizes:
                    rows.append(_measure_row(args, name, size, systems, workers, workdir, lmc_py, say))
        finally:
            for w in workers.values():
                w.close()
    _report(args, rows, log_path, say)
    if own_workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m lmcache_async_bench.compare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--workloads", help=f"comma-separated subset of: {', '.join(DEFAULT_ORDER)}")
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], help="entry sizes in bytes (override)")
    p.add_argument("--rounds", type=int, default=2, help="A/B rounds per figure (order flips each round)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per round and system")
    p.add_argument("--warmup", type=int, default=1, help="warm-up repetitions per round and system")
    p.add_argument("--quick", action="store_true", help="one size, fewer entries (smoke run)")
    p.add_argument("--lmcache-python", help="python of the LMCache venv (default: $LMCACHE_PYTHON or .venv-lmcache)")
    p.add_argument("--workdir", help="directory for disk tiers and the worker log (a temporary one by default)")
    p.add_argument("--skip", action="append", choices=SYSTEMS, help="leave a system out (repeatable)")
    p.add_argument("--json", help="write every sample and figure as JSON to this file")
    p.add_argument("--markdown", help="write the table as Markdown to this file (for docs/benchmarks.md)")
    p.add_argument("--plot", help="write a PNG (throughput vs entry size, both systems, baseline dashed)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.rounds < 1 or args.reps < 1:
        print("--rounds and --reps must be >= 1", file=sys.stderr)
        return 2
    return run(args)


__all__ = ["DEFAULT_ORDER", "TARGETS", "Row", "Worker", "format_markdown", "format_rows", "main", "target_for"]

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
