"""The size limits CI holds: no module over 600 lines, no function over 80 (docstring included),
in the package, the benchmark suite and the tests. Prints each offender and exits 1 when there is one.

Run: ``python scripts/sizes.py`` (the ``checks`` nox session runs it).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREES = ("lmcache_async", "bench/lmcache_async_bench", "tests")
MAX_MODULE = 600
MAX_FUNCTION = 80


def offenders(root: Path = ROOT) -> list[str]:
    """One line per module or function over its limit, under :data:`TREES` of ``root``."""
    out: list[str] = []
    for tree in TREES:
        for path in sorted((root / tree).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            rel = path.relative_to(root).as_posix()
            lines = text.count("\n") + (not text.endswith("\n") and bool(text))
            if lines > MAX_MODULE:
                out.append(f"{rel}: {lines} lines (module limit {MAX_MODULE})")
            for node in ast.walk(ast.parse(text, filename=rel)):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    n = (node.end_lineno or node.lineno) - node.lineno + 1
                    if n > MAX_FUNCTION:
                        out.append(f"{rel}:{node.lineno} {node.name}: {n} lines (function limit {MAX_FUNCTION})")
    return out


def main() -> int:
    found = offenders()
    for line in found:
        print(line)
    print(f"sizes: {len(found)} over the limits" if found else "sizes: every module and function within the limits")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
