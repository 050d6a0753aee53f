"""Every load path users have names a module that exists: the ``python -m lmcache_async_bench.*``
commands and the ``lmcache_async.integration.*`` paths the docs give (vLLM's connector module
path, SGLang's backend, vLLM-Omni's plugin), and the entry points the package declares (the CLI,
Omni's plugin, the pytest plugin). Found by ``importlib.util.find_spec``, so no engine is needed;
an attribute after the module (``...vllm.LMCacheKVConnector``) is checked where the module imports."""

from __future__ import annotations

import importlib
import importlib.util
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _mentions(pattern: str) -> set[str]:
    found: set[str] = set()
    for page in DOCS:
        found.update(m.rstrip(".") for m in re.findall(pattern, page.read_text(encoding="utf-8")))
    return found


def _module_of(dotted: str) -> tuple[str, list[str]]:
    """The longest importable module prefix of ``dotted`` and the attribute names after it."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        name = ".".join(parts[:n])
        try:
            if importlib.util.find_spec(name) is not None:
                return name, parts[n:]
        except ModuleNotFoundError:
            continue
    raise AssertionError(f"no module in {dotted!r}")


def test_the_bench_commands_in_the_docs_run_modules_that_exist() -> None:
    commands = _mentions(r"python -m (lmcache_async_bench(?:\.[a-z_]+)+)")
    assert {"lmcache_async_bench.compare", "lmcache_async_bench.vllm_kv", "lmcache_async_bench.server"} <= commands
    for module in sorted(commands):
        spec = importlib.util.find_spec(module)
        assert spec is not None and spec.origin, module
        source = Path(spec.origin)
        runnable = (source.parent / "__main__.py").is_file() if source.name == "__init__.py" else True
        assert runnable and ('__name__ == "__main__"' in source.read_text() or source.name == "__init__.py"), module


def test_the_integration_paths_in_the_docs_exist() -> None:
    paths = _mentions(r"(lmcache_async\.integration(?:\.[A-Za-z_]+)+)")
    assert {"lmcache_async.integration.vllm.LMCacheKVConnector", "lmcache_async.integration.sglang"} <= paths
    for dotted in sorted(paths):
        module, attrs = _module_of(dotted)
        assert module.count(".") >= 2, dotted  # at least lmcache_async.integration.<engine>
        try:
            obj = importlib.import_module(module)
            for attr in attrs:  # a lazy attribute may import the engine too
                obj = getattr(obj, attr)
        except ImportError as exc:  # the engine itself is absent here: the module path is enough
            assert exc.name and exc.name.split(".")[0] in {"vllm", "sglang", "vllm_omni"}, exc


@pytest.mark.parametrize("group", ["scripts", "entry-points"])
def test_the_declared_entry_points_name_modules_that_exist(group: str) -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    tables = [project["scripts"]] if group == "scripts" else list(project["entry-points"].values())
    targets = [value for table in tables for value in table.values()]
    assert targets
    for target in targets:
        module = target.partition(":")[0]
        assert importlib.util.find_spec(module) is not None, target
