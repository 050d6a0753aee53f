"""The size gate (``scripts/sizes.py``, run by ``nox -s checks``) finds what is over its limits."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def _sizes() -> ModuleType:
    spec = importlib.util.spec_from_file_location("sizes", ROOT / "scripts" / "sizes.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_gate_names_a_long_module_and_a_long_function(tmp_path: Path) -> None:
    sizes = _sizes()
    package = tmp_path / "lmcache_async"
    package.mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(80))
    (package / "long_function.py").write_text(f"def f():\n{body}\n\ndef g():\n    return 1\n")
    (package / "long_module.py").write_text("".join(f"X{i} = {i}\n" for i in range(601)))
    (package / "fine.py").write_text("def f():\n    return 1\n")
    found = sizes.offenders(tmp_path)
    assert found == [
        "lmcache_async/long_function.py:1 f: 81 lines (function limit 80)",
        "lmcache_async/long_module.py: 601 lines (module limit 600)",
    ]


def test_the_tree_is_within_the_limits() -> None:
    assert _sizes().offenders() == []
