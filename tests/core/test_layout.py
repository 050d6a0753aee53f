"""The core's import direction: nothing under ``lmcache_async/`` outside ``testing/``,
``integration/`` and ``cli.py`` imports a concrete backend module (it builds tiers by name
through the registry), checked over every import statement — lazy ones inside functions too."""

from __future__ import annotations

import ast
from pathlib import Path

import lmcache_async

PACKAGE = Path(lmcache_async.__file__).resolve().parent
ALLOWED = ("testing/", "integration/", "cli.py")
BACKENDS = "lmcache_async.backends"


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
        if rel.startswith(ALLOWED[:2]) or rel == ALLOWED[2]:
            continue
        out.append(path)
    return out


def test_core_never_imports_a_concrete_backend() -> None:
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports {mod}"
        for path in _core_modules()
        for line, mod in _imported(path)
        if mod == BACKENDS or mod.startswith(BACKENDS + ".")
    ]
    assert not offenders, "\n".join(offenders)


def test_the_walk_sees_the_core_and_finds_a_backend_import() -> None:
    """The check can fail: it walks the core's modules and flags a known backend import."""
    names = {p.relative_to(PACKAGE).as_posix() for p in _core_modules()}
    assert {"storage_manager.py", "backend.py", "engines/kv.py"} <= names
    assert "cli.py" not in names and not any(n.startswith("testing/") for n in names)
    cli = [mod for _, mod in _imported(PACKAGE / "cli.py")]
    assert any(m.startswith(BACKENDS + ".") for m in cli), "the walk resolves the CLI's lazy backend import"
