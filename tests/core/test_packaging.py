"""Source paths are import paths: the package is ``lmcache_async/`` with the built-in tiers inside it
(``cpu/``, ``disk/``, ``nixl/``, ``remote/``, ``server/tier.py``), and the benchmark suite is its own
distribution in ``bench/`` (``bench/lmcache_async_bench/``), which the core never imports (only the
``bench`` command does, when it runs). The editable install and the built wheels agree."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = "lmcache_async_bench"


def test_the_tree_is_the_import_tree():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "package-dir" not in config["tool"]["setuptools"]
    assert not (ROOT / "backends").exists()
    assert not (ROOT / "bench" / "__init__.py").exists()
    assert (ROOT / "bench" / "pyproject.toml").is_file() and (ROOT / "bench" / BENCH / "__init__.py").is_file()
    packages = ("cpu", "disk", "nixl", "remote", "_manager", "cli", "config", "memory", "records")
    for package in (*packages, "integration/vllm/ec", "integration/vllm/kv"):
        assert (ROOT / "lmcache_async" / package / "__init__.py").is_file(), package


def test_one_version_source():
    import lmcache_async

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in config["project"] and "version" in config["project"]["dynamic"]
    assert config["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "lmcache_async.__version__"}
    from importlib.metadata import version

    assert version("lmcache-async") == lmcache_async.__version__


@pytest.mark.slow  # a fresh interpreter per check
def test_editable_install_imports_from_the_source_paths():
    code = f"import lmcache_async.disk.tier as d, {BENCH}.compare.driver as b; print(d.__file__); print(b.__file__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    tier, bench = (Path(line) for line in out.stdout.split())
    assert tier == ROOT / "lmcache_async" / "disk" / "tier.py"
    assert bench == ROOT / "bench" / BENCH / "compare" / "driver.py"


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
    offenders = []
    for path in sorted((ROOT / "lmcache_async").rglob("*.py")):
        if path == ROOT / "lmcache_async" / "cli" / "bench.py":
            continue
        if any(m.split(".")[0] == BENCH for m in _imported_modules(path)):
            offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []
    # cli/bench.py imports it only inside the bench command: loading the CLI and its parser leaves it out.
    code = f"import sys, lmcache_async.cli as c; c.build_parser(); assert {BENCH!r} not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, cwd="/")


def test_bench_command_says_how_to_get_a_missing_suite(monkeypatch, capsys):
    from lmcache_async import cli
    from lmcache_async.cli import bench

    monkeypatch.setattr(bench, "BENCH_PACKAGE", "lmcache_async_no_such_bench")
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
            ".git",
            "build",
            "dist",
            "*.egg-info",
            ".nox",
            ".venv*",
            "__pycache__",
            "*.pyc",
            ".mypy_cache",
            ".ruff_cache",
            ".pytest_cache",
            ".hypothesis",
            "bench-results",
            "site",
        ),  # fmt: skip
    )
    return src


def _wheel(source: Path, out: Path) -> Path:
    before = set(out.glob("*.whl"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(source)],
        check=True,
        capture_output=True,
    )
    (wheel,) = set(out.glob("*.whl")) - before
    return wheel


@pytest.mark.slow
def test_built_wheels_ship_the_package_and_the_bench_suite_apart(tmp_path):
    src = _clean_source(tmp_path)
    core = _wheel(src, tmp_path)
    bench = _wheel(src / "bench", tmp_path)
    names = zipfile.ZipFile(core).namelist()
    assert "lmcache_async/disk/tier.py" in names and "lmcache_async/cpu/tier.py" in names
    assert "lmcache_async/py.typed" in names
    assert not [n for n in names if n.startswith((BENCH, "backends/", "bench/", "lmcache_async/backends/"))]
    bench_names = zipfile.ZipFile(bench).namelist()
    assert f"{BENCH}/common.py" in bench_names and f"{BENCH}/compare/driver.py" in bench_names
    assert not [n for n in bench_names if n.startswith("lmcache_async/")]
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(core), str(bench)],
        check=True,
        capture_output=True,
    )
    code = (
        f"import lmcache_async, lmcache_async.disk.tier as m, {BENCH}.common as b;"
        f"assert lmcache_async.__file__.startswith({str(target)!r}), lmcache_async.__file__;"
        f"assert b.__file__.startswith({str(target)!r}), b.__file__;"
        "print(m.__name__)"
    )
    env = {"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/", env=env)
    assert out.stdout.strip() == "lmcache_async.disk.tier"
    # Children we start (demo processes, benchmark workers) import the package their parent runs,
    # even when started from the source checkout.
    child = (
        "from lmcache_async._subprocess import module_command as m; import subprocess;"
        "subprocess.run(m('lmcache_async._subprocess'), check=True)"
    )
    out = subprocess.run(
        [sys.executable, "-P", "-c", child], capture_output=True, text=True, check=True, cwd=str(ROOT), env=env
    )
    assert out.stdout.strip() == str(target / "lmcache_async")
