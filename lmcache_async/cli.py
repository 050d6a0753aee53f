"""The ``lmcache-async`` command: ``demo``, ``config``, ``bench``, ``inspect``."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

BENCH_SUITES: dict[str, str] = {
    "cpu": "lmcache_async.bench.cpu",
    "ec": "lmcache_async.bench.ec",
    "kv_hs": "lmcache_async.bench.kv_hs",
    "disk": "lmcache_async.bench.disk",
    "remote": "lmcache_async.bench.remote",
    "nixl": "lmcache_async.bench.nixl",
    "scaling": "lmcache_async.bench.scaling",
    "sweep": "lmcache_async.bench.sweep",
}


# ---- config ------------------------------------------------------------------------------------
def _cmd_config(args: argparse.Namespace) -> int:
    from lmcache_async.config import load_ec_engine_config, load_engine_config

    cfg = load_ec_engine_config(None, args.file) if args.ec else load_engine_config(args.file)
    rows = cfg.describe()
    if args.json:
        print(json.dumps({k: {"value": v, "source": s} for k, v, s in rows}, indent=2, default=str))
        return 0
    width = max(len(k) for k, _, _ in rows)
    vwidth = min(max(len(repr(v)) for _, v, _ in rows), 48)
    print(f"{'key'.ljust(width)}  {'value'.ljust(vwidth)}  source")
    for k, v, s in rows:
        print(f"{k.ljust(width)}  {repr(v).ljust(vwidth)}  {s}")
    return 0


# ---- bench -------------------------------------------------------------------------------------
def _cmd_bench(args: argparse.Namespace) -> int:
    from lmcache_async.bench.common import BenchOptions, Result, format_table

    names = args.suite or list(BENCH_SUITES)
    unknown = [n for n in names if n not in BENCH_SUITES]
    if unknown:
        print(f"unknown suite(s): {', '.join(unknown)}; known: {', '.join(BENCH_SUITES)}", file=sys.stderr)
        return 2
    start = time.monotonic()

    def progress(msg: str) -> None:
        print(f"[{time.monotonic() - start:7.1f}s] {msg}", file=sys.stderr, flush=True)

    opts = BenchOptions(
        reps=args.reps, quick=args.quick, workdir=args.workdir, redis_url=args.redis_url, progress=progress
    )
    results: list[Result] = []
    skipped: list[str] = []
    for name in names:
        try:
            module = importlib.import_module(BENCH_SUITES[name])
        except ImportError as exc:
            skipped.append(f"{name}: {exc}")
            progress(f"suite {name} skipped: {exc}")
            continue
        progress(f"suite {name}: start")
        try:
            got = module.run(opts)
        except Exception as exc:  # a suite that cannot run here is reported, not fatal
            skipped.append(f"{name}: {type(exc).__name__}: {exc}")
            progress(f"suite {name} failed: {type(exc).__name__}: {exc}")
            continue
        results.extend(got)
        print(format_table(got), flush=True)
        print(flush=True)
    if len(names) > 1 and results:
        print("== all suites ==")
        print(format_table(results))
    for s in skipped:
        print(f"skipped: {s}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"results": [r.to_dict() for r in results], "skipped": skipped}, f, indent=2)
    if args.plot:
        from lmcache_async.bench.plot import plot_results

        plot_results(results, args.plot)
        progress(f"plot written to {args.plot}")
    return 0


# ---- demo --------------------------------------------------------------------------------------
def _cmd_demo(args: argparse.Namespace) -> int:
    from lmcache_async.demo import run_demo

    return run_demo(workdir=args.workdir, keep=args.keep)


# ---- inspect -----------------------------------------------------------------------------------
def _add_inspect(sub: Any) -> None:
    try:
        from lmcache_async.disk_tools import add_inspect_parser
    except ImportError:  # pragma: no cover - disk tools always ship
        return
    add_inspect_parser(sub)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lmcache-async", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="store and restore a realistic set of tensors and print a table")
    d.add_argument("--workdir", help="directory for the disk tier (a temporary one by default)")
    d.add_argument("--keep", action="store_true", help="keep the temporary directory")
    d.set_defaults(func=_cmd_demo)

    c = sub.add_parser("config", help="print the resolved configuration and where each value came from")
    c.add_argument("--file", help="YAML file (default: $LMCACHE_CONFIG_FILE)")
    c.add_argument("--ec", action="store_true", help="apply the encoder-cache overlay and defaults")
    c.add_argument("--json", action="store_true", help="print JSON")
    c.set_defaults(func=_cmd_config)

    b = sub.add_parser("bench", help="benchmarks with same-run physical baselines")
    b.add_argument("--suite", action="append", help=f"suite to run (repeatable): {', '.join(BENCH_SUITES)}")
    b.add_argument("--json", help="write results as JSON to this file")
    b.add_argument("--plot", help="write a PNG plot to this file (needs matplotlib)")
    b.add_argument("--reps", type=int, default=5, help="repetitions per figure (median; default 5)")
    b.add_argument("--quick", action="store_true", help="smaller sizes for a smoke run")
    b.add_argument("--workdir", help="directory for disk/fs files (a temporary one by default)")
    b.add_argument("--redis-url", help="use this server instead of starting redis-server")
    b.set_defaults(func=_cmd_bench)

    _add_inspect(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``lmcache-async``; returns the exit status."""
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    if getattr(args, "reps", 5) < 1:
        print("--reps must be >= 1", file=sys.stderr)
        return 2
    rc: int = args.func(args)
    return rc


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
