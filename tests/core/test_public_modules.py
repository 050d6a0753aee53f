"""Every public module of the package says what it exports: it defines ``__all__``, and every
name in it exists (a lazily loaded name may need an optional engine, which is then skipped)."""

from __future__ import annotations

import importlib
import os
import warnings
from pathlib import Path
from types import ModuleType

import pytest

import lmcache_async

PACKAGE_DIR = Path(lmcache_async.__file__).parent
# The engines and wheels a module may import that the test environments do not all have.
OPTIONAL = ("vllm", "vllm_omni", "sglang", "nixl", "nixl_cu12", "mooncake")


def _public_modules() -> list[str]:
    names = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if path.name == "__main__.py" or any(part.startswith("_") for part in parts):
            continue
        names.append(".".join(parts))
    return names


def _missing_optional(exc: ImportError) -> str | None:
    root = (exc.name or "").partition(".")[0]
    return root if root in OPTIONAL else None


REQUIRED_BY = {
    "vllm": "LMCACHE_ASYNC_REQUIRE_VLLM",
    "vllm_omni": "LMCACHE_ASYNC_REQUIRE_OMNI",
    "sglang": "LMCACHE_ASYNC_REQUIRE_SGLANG",
    "nixl": "LMCACHE_ASYNC_REQUIRE_NIXL",
    "nixl_cu12": "LMCACHE_ASYNC_REQUIRE_NIXL",
    "mooncake": "LMCACHE_ASYNC_REQUIRE_MOONCAKE",
}
"""The variable that turns the skip for an absent engine into a failure (the engine's nox session
sets it and runs this file's cases for its modules)."""


def _import(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        missing = _missing_optional(exc)
        if missing is None or os.environ.get(REQUIRED_BY[missing]) == "1":
            raise
        pytest.skip(f"{name} imports {missing}, which is not installed")


def test_the_walk_finds_the_public_modules() -> None:
    modules = _public_modules()
    assert "lmcache_async" in modules and "lmcache_async.tiers.abc" in modules
    assert not [m for m in modules if "._" in m or m.endswith("__main__")]


@pytest.mark.parametrize("name", _public_modules())
def test_a_public_module_defines_all_and_every_name_in_it_exists(name: str) -> None:
    module = _import(name)
    exported = getattr(module, "__all__", None)
    assert isinstance(exported, (list, tuple)), f"{name} defines no __all__"
    assert all(isinstance(n, str) for n in exported), name
    assert len(set(exported)) == len(exported), f"{name}: a name twice in __all__"
    absent = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # a deprecated alias warns when reached
        for attr in exported:
            try:
                getattr(module, attr)
            except AttributeError:
                absent.append(attr)
            except ImportError as exc:  # a lazy name whose engine is absent
                if _missing_optional(exc) is None:
                    raise
    assert not absent, f"{name}.__all__ names what it does not define: {absent}"
