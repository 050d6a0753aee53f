"""``lmcache-async bench``: the benchmark suites by name and the command that runs them.

The suites live in the ``lmcache_async_bench`` package (its own distribution, ``bench/`` in the repository), imported
only when a suite runs. The command's helpers for errors and paths are :mod:`lmcache_async.cli`'s
(imported when the command runs, so the parser can import this module).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from lmcache_async.lazy_registry import LazyRegistry

if TYPE_CHECKING:
    from lmcache_async_bench.common import Result

__all__ = ["BENCH_PACKAGE", "BENCH_SUITES", "OPT_IN_SUITES", "SMOKE_BANNER", "cmd_bench"]

BENCH_PACKAGE = "lmcache_async_bench"
"""The benchmark suite: a package installed beside the core (from ``bench/``), imported only by ``bench``."""

BENCH_SUITES: dict[str, str] = {
    "cpu": f"{BENCH_PACKAGE}.cpu",
    "ec": f"{BENCH_PACKAGE}.ec",
    "kv_hs": f"{BENCH_PACKAGE}.kv_hs",
    "kv_keys": f"{BENCH_PACKAGE}.kv_keys",
    "disk": f"{BENCH_PACKAGE}.disk",
    "remote": f"{BENCH_PACKAGE}.remote",
    "s3": f"{BENCH_PACKAGE}.s3",
    "sealed": f"{BENCH_PACKAGE}.sealed",
    "nixl": f"{BENCH_PACKAGE}.nixl",
    "scaling": f"{BENCH_PACKAGE}.scaling",
    "sweep": f"{BENCH_PACKAGE}.sweep",
    "server": f"{BENCH_PACKAGE}.server",
    "io_style": f"{BENCH_PACKAGE}.io_style",
    "events": f"{BENCH_PACKAGE}.events",
}
#: Suites run only when named with ``--suite`` (they need another environment or take minutes):
#: ``vllm_kv`` and ``vllm_kv_slow`` (load or recompute over a slow tier) start real vLLM engines
#: with the interpreter in ``$LMCACHE_VLLM_PYTHON``;
#: ``sglang`` needs SGLang: run it with the python printed by ``scripts/sglang_env.sh``;
#: ``omni`` starts processes and measures for minutes (``scripts/omni_env.sh`` for the connector).
OPT_IN_SUITES: dict[str, str] = {
    "vllm_kv": f"{BENCH_PACKAGE}.vllm_kv",
    "vllm_kv_slow": f"{BENCH_PACKAGE}.vllm_kv_slow",
    "sglang": f"{BENCH_PACKAGE}.sglang",
    "omni": f"{BENCH_PACKAGE}.omni",
}
SMOKE_BANNER = (
    "smoke run (--quick): sizes and counts are shrunk; the numbers are not meaningful and targets are not judged"
)
_SUITES: LazyRegistry[ModuleType] = LazyRegistry("suite", {**BENCH_SUITES, **OPT_IN_SUITES})
"""Every suite by name: its module, imported when the suite runs."""


# ---- the command -------------------------------------------------------------------------------------
def _require_bench() -> None:
    """Raise :class:`UsageError` saying how to get the benchmark suite when it is not installed."""
    import importlib.util

    from lmcache_async.cli import UsageError

    if importlib.util.find_spec(BENCH_PACKAGE) is None:
        raise UsageError(
            f"the benchmark suite ({BENCH_PACKAGE}) is not installed: it is its own distribution in "
            "the repository's bench/ directory; from a source checkout: pip install '.[cli]' ./bench"
        )


def cmd_bench(args: argparse.Namespace) -> int:
    """``lmcache-async bench``: run the named suites (all default ones without ``--suite``) and print
    each figure beside its baseline; 1 when nothing was measured."""
    from lmcache_async.cli import PROG, UsageError

    known = {**BENCH_SUITES, **OPT_IN_SUITES}
    names = args.suite or list(BENCH_SUITES)
    unknown = [n for n in names if n not in _SUITES]
    if unknown:
        raise UsageError(f"unknown suite(s): {', '.join(unknown)}; known: {', '.join(known)}")
    _require_bench()
    json_path, plot_path, workdir = _checked_outputs(args)
    start = time.monotonic()

    def progress(msg: str) -> None:  # (the bar is gone by the time this prints)
        print(f"[{time.monotonic() - start:7.1f}s] {msg}", file=sys.stderr, flush=True)

    if args.quick:
        print(SMOKE_BANNER)
    results, skipped = _run_suites(names, args, workdir, start)
    _print_summary(results, skipped, several=len(names) > 1, quick=args.quick)
    if json_path is not None:
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump({"results": [r.to_dict() for r in results], "skipped": skipped}, f, indent=2)
        progress(f"results written to {json_path}")
    if plot_path is not None:
        if results:
            from lmcache_async_bench.plot import plot_results

            plot_results(results, plot_path)
            progress(f"plot written to {plot_path}")
        else:
            progress("no results: no plot written")
    if not results:
        print(f"{PROG} bench: nothing was measured", file=sys.stderr)
        return 1
    return 0


def _checked_outputs(args: argparse.Namespace) -> tuple[str | None, str | None, str | None]:
    """``--json``, ``--plot`` and ``--workdir`` checked before anything runs (the work directory
    created): their paths, None for each not given. :class:`UsageError` for a bad one."""
    from lmcache_async.cli import check_output_file, check_work_dir

    json_path = check_output_file(args.json, "--json") if args.json else None
    plot_path = None
    if args.plot:
        plot_path = check_output_file(args.plot, "--plot")
        _check_plot_format(args.plot, plot_path)
    workdir = check_work_dir(args.workdir, "--workdir") if args.workdir else None
    if workdir is not None:
        os.makedirs(workdir, exist_ok=True)
    return json_path, plot_path, workdir


def _run_suites(
    names: list[str], args: argparse.Namespace, workdir: str | None, start: float
) -> tuple[list[Result], list[str]]:
    """Run each suite of ``names`` in order under one progress bar, printing each one's table as
    it ends: every result, and one ``"name: why"`` line per suite that could not be imported or
    raised (its traceback written to an error log; the other suites still run)."""
    from lmcache_async.cli import one_line, write_error_log
    from lmcache_async.cli.progress import Progress
    from lmcache_async_bench.common import BenchOptions, format_table

    results: list[Result] = []
    skipped: list[str] = []
    with Progress(len(names), "bench", "suite", enabled=not args.no_progress) as bar:

        def progress(msg: str) -> None:
            bar.write(f"[{time.monotonic() - start:7.1f}s] {msg}")

        def out(text: str = "") -> None:
            bar.write(text, file=sys.stdout)

        opts = BenchOptions(
            reps=args.reps, quick=args.quick, workdir=workdir, redis_url=args.redis_url, progress=progress
        )
        for name in names:
            bar.status(name)
            try:
                module = _SUITES.get(name)
            except ImportError as exc:
                skipped.append(f"{name}: {one_line(exc)}")
                progress(f"suite {name} skipped: {one_line(exc)}")
                bar.advance()
                continue
            progress(f"suite {name}: start")
            try:
                got = module.run(opts)
            except Exception as exc:  # a suite that cannot run here is reported, not fatal
                log = write_error_log(f"bench suite {name}", exc)
                why = f"{type(exc).__name__}: {one_line(exc)}"
                skipped.append(f"{name}: {why}")
                progress(f"suite {name} failed: {why}" + (f" (traceback in {log})" if log else ""))
                bar.advance()
                continue
            results.extend(got)
            out(format_table(got, smoke=args.quick))
            out()
            bar.advance()
    return results, skipped


def _print_summary(results: list[Result], skipped: list[str], *, several: bool, quick: bool) -> None:
    """After every suite ran: the targets not met (when ``several`` suites ran, and not in a
    ``quick`` smoke run: each table was printed once already), the curves, the skipped suites,
    and the smoke banner again."""
    from lmcache_async_bench.common import format_series_summary, format_table

    missed = [r for r in results if r.met is False]
    if several and missed and not quick:
        print("== targets not met ==")
        print(format_table(missed))
    summary = format_series_summary(results)
    if summary:
        print("== curves (min-max over sizes / concurrency) ==")
        print(summary)
    for s in skipped:
        print(f"skipped: {s}")
    if quick:
        print(SMOKE_BANNER)


def _check_plot_format(given: str, path: str) -> None:
    from lmcache_async.cli import UsageError
    from lmcache_async_bench.plot import plot_formats

    try:
        formats = plot_formats()
    except RuntimeError as exc:  # matplotlib missing: say so now, not after the run
        raise UsageError(str(exc)) from None
    ext = Path(path).suffix.lstrip(".").lower()
    if ext and ext not in formats:
        raise UsageError(f"--plot {given}: unknown image format .{ext}; use one of {', '.join(sorted(formats))}")
