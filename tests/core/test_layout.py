"""The core's import direction: nothing under ``lmcache_async/`` outside ``testing/``,
``integration/``, ``cli/`` and the built-in tiers' own packages imports a built-in tier (the core
builds tiers by name through the registry), checked over every import statement — lazy ones
inside functions too."""

from __future__ import annotations

import ast
from pathlib import Path

import lmcache_async

PACKAGE = Path(lmcache_async.__file__).resolve().parent
ALLOWED = ("testing/", "integration/", "cli/", "cpu/", "disk/", "nixl/", "remote/", "server/")
TIERS = tuple(f"lmcache_async.{t}" for t in ("cpu", "disk", "nixl", "remote", "server.tier", "server.leases"))


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imported(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``path``, relative ones resolved."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join([*base, node.module] if node.module else base)
            else:
                mod = node.module or ""
            found.append((node.lineno, mod))
            found.extend((node.lineno, f"{mod}.{alias.name}") for alias in node.names)
    return found


def _core_modules() -> list[Path]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith(ALLOWED):
            continue
        out.append(path)
    return out


def _is_tier(mod: str) -> bool:
    return any(mod == t or mod.startswith(t + ".") for t in TIERS)


def test_core_never_imports_a_concrete_backend() -> None:
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports {mod}"
        for path in _core_modules()
        for line, mod in _imported(path)
        if _is_tier(mod)
    ]
    assert not offenders, "\n".join(offenders)


def test_the_walk_sees_the_core_and_finds_a_backend_import() -> None:
    """The check can fail: it walks the core's modules and flags a known backend import."""
    names = {p.relative_to(PACKAGE).as_posix() for p in _core_modules()}
    assert {"storage_manager.py", "_manager/front.py", "engines/kv.py"} <= names
    assert not any(n.startswith(("testing/", "cli/", "disk/")) for n in names)
    cli = [mod for path in (PACKAGE / "cli").glob("*.py") for _, mod in _imported(path)]
    assert any(_is_tier(m) for m in cli), "the walk resolves the CLI's lazy tier imports"
