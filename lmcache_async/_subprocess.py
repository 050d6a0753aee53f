"""Starting our own modules in child processes."""

from __future__ import annotations

import sys


def module_command(module: str, *args: str) -> list[str]:
    """The argv that runs ``python -m module args...`` with this interpreter.

    ``-P`` keeps the current directory off the child's ``sys.path``: started from a source
    checkout, a child imports the package its parent runs (an installed wheel, say), never the
    checkout's ``lmcache_async/`` by accident of its working directory.
    """
    return [sys.executable, "-P", "-m", module, *args]


if __name__ == "__main__":  # where a child started this way finds the package
    import os

    print(os.path.dirname(os.path.abspath(__file__)))
