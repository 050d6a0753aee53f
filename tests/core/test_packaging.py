"""The built wheel and the editable install both ship the backends as lmcache_async.backends and
the benchmark suite beside the core as its own package, lmcache_async_bench, which the core never
imports (only the ``bench`` command does, when it runs)."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = "lmcache_async_bench"


@pytest.mark.slow  # a fresh interpreter per check
def test_editable_install_imports_backends_cpu():
    out = subprocess.run(
        [sys.executable, "-c", "import lmcache_async.backends.cpu as m; print(m.__name__)"],
        capture_output=True,
        text=True,
        check=True,
        cwd="/",
    )
    assert out.stdout.strip() == "lmcache_async.backends.cpu"


@pytest.mark.slow  # a fresh interpreter per check
def test_editable_install_imports_the_bench_suite_from_bench_dir():
    out = subprocess.run(
        [sys.executable, "-c", f"import {BENCH}.compare.driver as m; print(m.__file__)"],
        capture_output=True,
        text=True,
        check=True,
        cwd="/",
    )
    assert Path(out.stdout.strip()) == ROOT / "bench" / "compare" / "driver.py"


def _imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


@pytest.mark.slow  # a fresh interpreter per check
def test_the_core_does_not_import_the_bench_suite_outside_the_bench_command():
    assert not list((ROOT / "lmcache_async").glob("bench/**/*.py"))
    offenders = []
    for path in sorted([*(ROOT / "lmcache_async").rglob("*.py"), *(ROOT / "backends").rglob("*.py")]):
        if path == ROOT / "lmcache_async" / "cli_bench.py":
            continue
        if any(m.split(".")[0] == BENCH for m in _imported_modules(path)):
            offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []
    # cli_bench.py imports it only inside the bench command: loading the CLI and its parser leaves it out.
    code = f"import sys, lmcache_async.cli as c; c.build_parser(); assert {BENCH!r} not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, cwd="/")


def test_bench_command_says_how_to_get_a_missing_suite(monkeypatch, capsys):
    from lmcache_async import cli, cli_bench

    monkeypatch.setattr(cli_bench, "BENCH_PACKAGE", "lmcache_async_no_such_bench")
    assert cli.main(["bench", "--suite", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "lmcache_async_no_such_bench" in err and "not installed" in err and "pip install" in err


def _clean_source(tmp_path: Path) -> Path:
    """A copy of the source tree without build outputs: setuptools packs whatever a stale
    ``build/lib`` holds, so a wheel built in place could carry modules that moved away."""
    src = tmp_path / "src"
    shutil.copytree(
        ROOT,
        src,
        ignore=shutil.ignore_patterns(
            ".git", "build", "dist", "*.egg-info", ".nox", ".venv*", "__pycache__", "*.pyc",
            ".mypy_cache", ".ruff_cache", ".pytest_cache", ".hypothesis", "bench-results",
        ),  # fmt: skip
    )
    return src


@pytest.mark.slow
def test_built_wheel_contains_and_imports_backends(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(_clean_source(tmp_path)),
        ],
        check=True,
        capture_output=True,
    )
    wheel = next(tmp_path.glob("lmcache_async-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "lmcache_async/backends/cpu.py" in names
    assert "lmcache_async/py.typed" in names
    # The benchmark suite ships beside the core, not inside it.
    assert f"{BENCH}/common.py" in names and f"{BENCH}/compare/driver.py" in names
    assert not [n for n in names if n.startswith("lmcache_async/bench/")]
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
    )
    code = (
        f"import importlib.util, lmcache_async, lmcache_async.backends.cpu as m, {BENCH}.common as b;"
        f"assert lmcache_async.__file__.startswith({str(target)!r}), lmcache_async.__file__;"
        f"assert b.__file__.startswith({str(target)!r}), b.__file__;"
        "assert importlib.util.find_spec('lmcache_async.bench') is None;"
        "print(m.__name__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd="/",
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
    )
    assert out.stdout.strip() == "lmcache_async.backends.cpu"
    # Children we start (demo processes, benchmark workers) import the installed package even
    # when started from the source checkout, whose lmcache_async/ has no backends/ inside.
    child = (
        "import subprocess; from lmcache_async._subprocess import module_command as m;"
        "subprocess.run(m('lmcache_async.backends.cpu'), check=True);"
        "subprocess.run(m('lmcache_async._subprocess'), check=True)"
    )
    out = subprocess.run(
        [sys.executable, "-P", "-c", child],
        capture_output=True,
        text=True,
        check=True,
        cwd=str(ROOT),
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
    )
    assert out.stdout.strip() == str(target / "lmcache_async")
