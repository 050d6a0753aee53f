"""The ``lmcache-async`` command: ``demo``, ``config``, ``bench``, ``inspect``, ``keys``, ``serve``, ``status``.

Exit status: 0 success; 1 a check failed (the demo's, a configuration ``config`` finds wrong
or cannot load, corrupt entries found by ``inspect``, nothing measured by ``bench``) or an
unexpected error; 2 a usage error, or a configuration error of another command.
Errors are one line on stderr: a usage or configuration error says what to change; an
unexpected error names the file its traceback was written to (see :func:`error_log_dir`).
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
import tempfile
import time
import traceback
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from lmcache_async.cli.bench import BENCH_SUITES, OPT_IN_SUITES
from lmcache_async.cli.bench import cmd_bench as _cmd_bench

__all__ = [
    "BENCH_SUITES",
    "ERROR_LOGS_KEPT",
    "OPT_IN_SUITES",
    "PROG",
    "UsageError",
    "build_parser",
    "check_output_file",
    "check_work_dir",
    "config_key",
    "error_log_dir",
    "main",
    "one_line",
    "write_error_log",
]

PROG = "lmcache-async"
ERROR_LOGS_KEPT = 20
"""Traceback files kept in :func:`error_log_dir` (older ones are deleted when a new one is written)."""


class UsageError(Exception):
    """A command-line mistake the user can fix: reported as one line on stderr, exit status 2."""

    def __init__(self, message: str, prog: str | None = None) -> None:
        super().__init__(message)
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (raised as :class:`UsageError`)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see '{self.prog} --help')", prog=self.prog)


def one_line(text: object) -> str:
    """``text`` with every run of whitespace (newlines included) made one space."""
    return " ".join(str(text).split())


# ---- errors ------------------------------------------------------------------------------------
def error_log_dir() -> Path:
    """Where tracebacks of unexpected errors are written: ``$XDG_STATE_HOME/lmcache-async``
    (``~/.local/state/lmcache-async`` when the variable is unset); the temporary directory's
    ``lmcache-async`` folder when that cannot be written."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "lmcache-async"


def write_error_log(what: str, exc: BaseException) -> str | None:
    """Write ``exc``'s traceback to a new file (see :func:`error_log_dir`) and return its path;
    None when no file could be written. Keeps the newest :data:`ERROR_LOGS_KEPT` files."""
    from lmcache_async import __version__

    text = (
        f"{PROG} {__version__}, Python {sys.version.split()[0]}: {what}\n"
        f"command line: {' '.join(sys.argv)}\n"
        f"time: {time.strftime('%Y-%m-%d %H:%M:%S %z')}\n\n" + "".join(traceback.format_exception(exc))
    )
    for folder in (error_log_dir(), Path(tempfile.gettempdir()) / PROG):
        try:
            folder.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd, path = tempfile.mkstemp(prefix=time.strftime("error-%Y%m%d-%H%M%S-"), suffix=".log", dir=folder)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
        except OSError:
            continue
        _prune_error_logs(folder)
        return path
    return None


def _prune_error_logs(folder: Path) -> None:
    try:
        logs = sorted(folder.glob("error-*.log"), key=lambda p: p.stat().st_mtime)
        for old in logs[:-ERROR_LOGS_KEPT]:
            old.unlink()
    except OSError:  # another process pruning at the same time; the next run tries again
        pass


def _fail(prog: str, message: str, status: int) -> int:
    print(f"{prog}: {one_line(message)}", file=sys.stderr, flush=True)
    return status


# ---- checks made before long work starts -------------------------------------------------------
def check_output_file(path: str, flag: str) -> str:
    """The absolute path of output file ``path`` (given with ``flag``), after checking that it
    can be written: not a directory, its directory exists and is writable, and an existing file
    is writable. ``UsageError`` naming ``flag`` otherwise."""
    if not path.strip():
        raise UsageError(f"{flag} needs a file name")
    p = os.path.abspath(os.path.expanduser(path))
    parent = os.path.dirname(p)
    if os.path.isdir(p):
        raise UsageError(f"{flag} {path}: is a directory; give a file name")
    if not os.path.exists(parent):
        raise UsageError(f"{flag} {path}: directory {parent} does not exist")
    if not os.path.isdir(parent):
        raise UsageError(f"{flag} {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: directory {parent} is not writable")
    if os.path.exists(p) and not os.access(p, os.W_OK):
        raise UsageError(f"{flag} {path}: file is not writable")
    return p


def check_work_dir(path: str, flag: str) -> str:
    """The absolute path of work directory ``path`` (given with ``flag``): an existing writable
    directory, or one that can be created (its nearest existing parent is a writable
    directory). ``UsageError`` naming ``flag`` otherwise. Creates nothing."""
    if not path.strip():
        raise UsageError(f"{flag} needs a directory")
    p = os.path.abspath(os.path.expanduser(path))
    if os.path.exists(p):
        if not os.path.isdir(p):
            raise UsageError(f"{flag} {path}: exists and is not a directory")
        if not os.access(p, os.W_OK | os.X_OK):
            raise UsageError(f"{flag} {path}: directory is not writable")
        return p
    ancestor = os.path.dirname(p)
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise UsageError(f"{flag} {path}: {ancestor} is not a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: cannot be created ({ancestor} is not writable)")
    return p


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


# ---- config ------------------------------------------------------------------------------------
def _load_config(args: argparse.Namespace) -> Any:
    from lmcache_async.config import load_ec_engine_config, load_engine_config

    return load_ec_engine_config(None, args.file) if args.ec else load_engine_config(args.file)


def _cmd_config(args: argparse.Namespace) -> int:
    """``config``: 0 when the configuration loads and checks clean (warnings allowed), 1 when it
    does not load or a check finds an error (one line each on stderr), 2 for a usage mistake."""
    from lmcache_async.errors import ConfigError

    try:
        return _explain(args) if args.explain is not None else _show_config(args)
    except ConfigError as exc:  # the configuration is what this command checks: a failed check
        return _fail(f"{PROG} config", f"error: {exc}", 1)


def _show_config(args: argparse.Namespace) -> int:
    from lmcache_async.config.check import check_config, redacted

    config = _load_config(args)
    rows = [(k, redacted(k, v), s) for k, v, s in config.describe()]
    findings = check_config(config)
    if args.json:
        out = {k: {"value": v, "source": s} for k, v, s in rows}
        problems = [{"level": f.level, "key": f.key, "message": f.message} for f in findings]
        print(json.dumps({"keys": out, "problems": problems}, indent=2, default=str))
    else:
        width = max(len(k) for k, _, _ in rows)
        vwidth = min(max(len(repr(v)) for _, v, _ in rows), 48)
        print(f"{'key'.ljust(width)}  {'value'.ljust(vwidth)}  source")
        for k, v, s in rows:
            print(f"{k.ljust(width)}  {repr(v).ljust(vwidth)}  {s}")
        for f in findings:  # what the manager would refuse (error) or do differently (warning)
            print(f"{PROG} config: {f}", file=sys.stderr)
    return 1 if any(f.level == "error" for f in findings) else 0


def config_key(name: str) -> str:
    """The configuration key ``name`` stands for: the key itself, or its environment variable
    (``LMCACHE_CHUNK_SIZE``, ``LMCACHE_EC_CHUNK_SIZE``), its ``ec_`` overlay spelling or a
    dashed spelling. ``UsageError`` naming close matches when there is none."""
    from lmcache_async.config import EC_ENV_PREFIX, ENV_PREFIX, LMCacheEngineConfig

    fields = list(LMCacheEngineConfig.model_fields)
    k = name.strip()
    for prefix in (EC_ENV_PREFIX, ENV_PREFIX):
        if k.upper().startswith(prefix):
            k = k[len(prefix) :]
            break
    k = k.lower().replace("-", "_")
    if k not in fields and k.startswith("ec_") and k[3:] in fields:
        k = k[3:]
    if k in fields:
        return k
    close = difflib.get_close_matches(k, fields, n=3, cutoff=0.6)
    if len(k) >= 3:
        close += [f for f in fields if k in f and f not in close]
    hint = f"did you mean {', '.join(close[:5])}?" if close else f"'{PROG} config' lists every key"
    raise UsageError(f"unknown configuration key {name!r}; {hint}")


def _type_text(ann: Any) -> str:
    origin = typing.get_origin(ann)
    args = typing.get_args(ann)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_text(a) for a in args)
    if origin is typing.Literal:
        return "one of " + ", ".join(str(a) for a in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_text(a) for a in args)}]"
    if ann is type(None):
        return "None"
    return str(getattr(ann, "__name__", ann))


_BOUNDS = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))


def _bounds_text(metadata: list[Any]) -> str:
    parts = []
    for m in metadata:
        for attr, sign in _BOUNDS:
            v = getattr(m, attr, None)
            if v is not None:
                parts.append(f"{sign} {v}")
    return ", ".join(parts)


def _explain(args: argparse.Namespace) -> int:
    from lmcache_async.config import CONFIG_FILE_ENV, EC_ENV_PREFIX, ENV_PREFIX, LMCacheEngineConfig
    from lmcache_async.config.check import redacted
    from lmcache_async.errors import ConfigError

    key = config_key(args.explain)
    info = LMCacheEngineConfig.model_fields[key]
    kind = _type_text(info.annotation)
    bounds = _bounds_text(info.metadata)
    default = redacted(key, info.get_default(call_default_factory=True))
    set_with = [f"YAML key {key} (file: --file or ${CONFIG_FILE_ENV})", f"env {ENV_PREFIX}{key.upper()}"]
    if args.ec:
        set_with += [f"YAML key ec_{key} or ec: {{{key}: ...}}", f"env {EC_ENV_PREFIX}{key.upper()}"]
    problem: ConfigError | None = None
    try:
        cfg = _load_config(args)
        value: Any = redacted(key, getattr(cfg, key))  # masked as the table and --json mask it
        source: str | None = cfg.source_of(key)
    except ConfigError as exc:  # explain the key all the same, then report why nothing loads
        problem, value, source = exc, None, None
    if args.json:
        out = {
            "key": key,
            "description": info.description,
            "type": kind,
            "bounds": bounds or None,
            "default": default,
            "value": value,
            "source": source,
            "set_with": set_with,
        }
        print(json.dumps(out, indent=2, default=str))
    else:
        rows = [
            ("type", f"{kind} ({bounds})" if bounds else kind),
            ("default", repr(default)),
            ("value", repr(value) if problem is None else "- (the configuration does not load)"),
            ("source", source if problem is None else "-"),
            ("set with", "; ".join(set_with)),
        ]
        print(f"{key}: {info.description or '(no description)'}")
        for label, text in rows:
            print(f"  {label.ljust(8)}  {text}")
    if problem is not None:
        raise problem
    return 0


# ---- demo --------------------------------------------------------------------------------------
def _cmd_demo(args: argparse.Namespace) -> int:
    workdir = check_work_dir(args.workdir, "--workdir") if args.workdir else None
    from lmcache_async.cli.demo import run_demo

    return run_demo(workdir=workdir, keep=args.keep)


# ---- encryption key files ----------------------------------------------------------------------
def _cmd_keygen(args: argparse.Namespace) -> int:
    from lmcache_async.encryption import write_key_file

    try:
        key_id = write_key_file(args.file)
    except FileExistsError:
        raise UsageError(f"{args.file} exists; a key file is never overwritten", f"{PROG} keygen") from None
    except OSError as exc:
        raise UsageError(f"cannot write {args.file}: {exc.strerror}", f"{PROG} keygen") from None
    print(f"wrote a 256-bit key to {args.file} (mode 0600), key id {key_id.hex()}")
    return 0


# ---- the parser --------------------------------------------------------------------------------
def _add_inspect(sub: Any) -> None:
    """Add ``inspect`` (a disk-tier directory's entries, :mod:`lmcache_async.disk.tools`) to ``sub``."""
    try:
        from lmcache_async.disk.tools import add_inspect_parser
    except ImportError:  # pragma: no cover - disk tools always ship
        return
    add_inspect_parser(sub)


def _version() -> str:
    from lmcache_async import __version__

    return f"{PROG} {__version__} (Python {sys.version.split()[0]})"


def build_parser() -> argparse.ArgumentParser:
    """The ``lmcache-async`` argument parser (usage errors raise :class:`UsageError`): one
    sub-command per builder below, then ``inspect`` and ``keys`` from their own modules."""
    p = _Parser(
        prog=PROG,
        description="An asyncio-native tiered storage framework for LLM-inference caches: run the "
        "demo, show the configuration, benchmark the tiers, inspect a disk-tier directory.",
        epilog=f"Run '{PROG} COMMAND --help' for a command's options.",
    )
    p.add_argument("--version", action="version", version=_version())
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    from lmcache_async.cli.serve import add_serve_parser, add_status_parser

    for add in (_add_demo, _add_config, _add_bench, add_serve_parser, add_status_parser, _add_keygen, _add_inspect):
        add(sub)
    from lmcache_async.cli.keys import add_keys_parser

    add_keys_parser(sub)
    return p


def _add_demo(sub: Any) -> None:
    """Add ``demo`` to ``sub`` (the parser's sub-commands)."""
    d = sub.add_parser(
        "demo",
        help="store and restore a realistic set of tensors and print a table",
        description="Store a small model's KV chunks through a CPU tier smaller than them and a disk "
        "tier, restore them bit-exact, walk hidden states from thinker to talker, and share "
        "encoder outputs between two processes through one disk directory; prints a table per "
        "tier. Exit status 1 when a check fails.",
    )
    d.add_argument("--workdir", help="directory for the disk tiers (a temporary one by default; kept when given)")
    d.add_argument("--keep", action="store_true", help="keep the temporary directory (inspect it afterwards)")
    d.set_defaults(func=_cmd_demo)


def _add_config(sub: Any) -> None:
    """Add ``config`` (show the resolved configuration, ``--explain KEY``) to ``sub``."""
    c = sub.add_parser(
        "config",
        help="print the resolved configuration and where each value came from",
        description="Resolve the configuration (defaults < YAML file < LMCACHE_<KEY> environment "
        "variables) and print every key with its value and source; --explain KEY tells what one "
        "key means. An invalid value is one error line naming the key, the value and its source.",
        epilog=f"Example: LMCACHE_CHUNK_SIZE=512 {PROG} config --explain chunk_size",
    )
    c.add_argument("--file", help="YAML file (default: $LMCACHE_CONFIG_FILE)")
    c.add_argument("--ec", action="store_true", help="apply the encoder-cache overlay and defaults")
    c.add_argument("--json", action="store_true", help="print JSON")
    c.add_argument(
        "--explain",
        metavar="KEY",
        help="print KEY's meaning, type, default, current value and source (KEY or its LMCACHE_ variable)",
    )
    c.set_defaults(func=_cmd_config)


def _add_bench(sub: Any) -> None:
    """Add ``bench`` (run benchmark suites, :mod:`lmcache_async.cli.bench`) to ``sub``."""
    b = sub.add_parser(
        "bench",
        help="benchmarks with same-run physical baselines",
        description="Run benchmark suites; every figure is a median printed beside a physical "
        "baseline measured in the same run, with the ratio, the target and whether lower or "
        "higher is better. --json and --plot are checked before the run starts.",
    )
    b.add_argument(
        "--suite",
        action="append",
        metavar="NAME",
        help=f"suite to run (repeatable): {', '.join(BENCH_SUITES)}; only when named: {', '.join(OPT_IN_SUITES)}",
    )
    b.add_argument("--json", metavar="FILE", help="write results as JSON to this file")
    b.add_argument("--plot", metavar="FILE", help="write a plot to this file (.png, .svg, .pdf; needs matplotlib)")
    b.add_argument("--reps", type=_positive_int, default=5, help="repetitions per figure (median; default 5)")
    b.add_argument("--quick", action="store_true", help="smaller sizes for a smoke run")
    b.add_argument("--workdir", help="directory for disk/fs files (a temporary one by default)")
    b.add_argument("--redis-url", help="use this server instead of starting redis-server")
    b.add_argument("--no-progress", action="store_true", help="no progress bar (none is drawn off a terminal)")
    b.set_defaults(func=_cmd_bench)


def _add_keygen(sub: Any) -> None:
    """Add ``keygen`` (write a new encryption key file) to ``sub``."""
    kg = sub.add_parser(
        "keygen",
        help="write a new encryption key file (for encryption_key_file)",
        description="Write 32 random bytes as 64 hex digits to FILE, created with mode 0600 (an existing "
        "file is never overwritten), and print the key's id. Set encryption_key_file to FILE to seal "
        "every record written outside process memory with AES-256-GCM.",
    )
    kg.add_argument("file", metavar="FILE", help="the key file to create")
    kg.set_defaults(func=_cmd_keygen)


def _suite_hint(argv: Sequence[str], message: str) -> str | None:
    """``did you mean --suite NAME?`` when ``message`` (a usage error of command line ``argv``)
    rejects words after ``bench`` that name suites; None otherwise."""
    prefix = "unrecognized arguments: "
    if not argv or argv[0] != "bench" or not message.startswith(prefix):
        return None
    words = message[len(prefix) :].split(" (see ")[0].split()
    suites = [w for w in words if w in BENCH_SUITES or w in OPT_IN_SUITES]
    return f"did you mean {' '.join(f'--suite {w}' for w in suites)}?" if suites else None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``lmcache-async``; returns the exit status (see the module docstring)."""
    import logging

    from lmcache_async.errors import BackendUnavailableError, ConfigError

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    prog = PROG
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parser.parse_args(argv)
        prog = f"{PROG} {args.command}"
        rc: int = args.func(args)
        return rc
    except UsageError as exc:
        status = _fail(exc.prog or prog, f"error: {exc}", 2)
        hint = _suite_hint(argv, str(exc))
        if hint:
            print(f"{PROG} bench: {hint}", file=sys.stderr, flush=True)
        return status
    except (ConfigError, BackendUnavailableError) as exc:
        return _fail(prog, f"error: {exc}", 2)
    except KeyboardInterrupt:
        return _fail(prog, "interrupted", 130)
    except BrokenPipeError:  # the reader of stdout went away (| head): stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    except Exception as exc:
        log = write_error_log(prog, exc)
        where = f"traceback in {log}" if log else "no traceback file could be written"
        return _fail(prog, f"unexpected error: {type(exc).__name__}: {exc} ({where})", 1)
