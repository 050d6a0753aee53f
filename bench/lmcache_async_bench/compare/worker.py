"""``python -m lmcache_async_bench.compare.worker --system ours|lmcache|baseline ...``

Runs one workload (or serves requests, ``--serve``) on one system and prints one JSON line per
outcome. ``--system lmcache`` re-executes ``lmcache_side.py`` by path with the LMCache venv's
python (``--lmcache-python``, else ``$LMCACHE_PYTHON``, else ``<repo>/.venv-lmcache/bin/python``),
so ``lmcache_async`` is never imported there. Other arguments: see ``_harness.worker_main``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from . import _harness

__all__ = ["LMCACHE_SIDE", "default_lmcache_python", "main"]

LMCACHE_SIDE = str(Path(__file__).with_name("lmcache_side.py"))


def default_lmcache_python() -> str:
    """Where the LMCache interpreter is looked for when nothing names it."""
    env = os.environ.get("LMCACHE_PYTHON")
    if env:
        return env
    return str(Path(__file__).resolve().parents[3] / ".venv-lmcache" / "bin" / "python")  # the repository's


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--system", choices=("ours", "lmcache", "baseline"), required=True)
    p.add_argument("--lmcache-python", default=None)
    known, rest = p.parse_known_args(argv)
    if known.system == "lmcache":
        py = known.lmcache_python or default_lmcache_python()
        if not os.path.exists(py):
            print(f"LMCache python not found at {py}; run scripts/lmcache_env.sh", file=sys.stderr)
            return 3
        os.execv(py, [py, LMCACHE_SIDE, *rest])
    if known.system == "baseline":
        return _harness.worker_main(_harness.PhysicalAdapter, rest, system="baseline")
    from .ours_side import OursAdapter

    return _harness.worker_main(OursAdapter, rest, system="ours")


if __name__ == "__main__":
    sys.exit(main())
