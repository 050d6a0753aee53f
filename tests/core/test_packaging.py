"""The built wheel and the editable install both ship the backends as lmcache_async.backends."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_editable_install_imports_backends_cpu():
    out = subprocess.run(
        [sys.executable, "-c", "import lmcache_async.backends.cpu as m; print(m.__name__)"],
        capture_output=True,
        text=True,
        check=True,
        cwd="/",
    )
    assert out.stdout.strip() == "lmcache_async.backends.cpu"


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
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    wheel = next(tmp_path.glob("lmcache_async-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "lmcache_async/backends/cpu.py" in names
    assert "lmcache_async/py.typed" in names
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
    )
    code = (
        "import lmcache_async, lmcache_async.backends.cpu as m;"
        f"assert lmcache_async.__file__.startswith({str(target)!r}), lmcache_async.__file__;"
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
