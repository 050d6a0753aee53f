"""Closing what is still open at interpreter exit, while the executors still run.

``concurrent.futures`` stops its pools from a ``threading`` exit hook, which runs before
``atexit`` handlers; a flush from ``atexit`` would then find no executor and drop queued writes.
Hooks registered later run first, so ours (registered on first use, after the executor module
was imported) closes what is open while the executors still run.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from collections.abc import Callable
from typing import Protocol

__all__ = ["Closable", "call_at_exit", "close_at_exit", "forget"]

#: The flush bound each object gets at exit.
EXIT_FLUSH_S = 2.0


class Closable(Protocol):
    """What :func:`close_at_exit` tracks: an object with a bounded, idempotent ``close_sync``."""

    def close_sync(self, flush_timeout: float = ...) -> None: ...


_live: weakref.WeakSet[Closable] = weakref.WeakSet()
_hook_lock = threading.Lock()
_hook_registered = False


def _close_all() -> None:  # pragma: no cover - exercised at interpreter exit
    for obj in list(_live):
        try:
            obj.close_sync(flush_timeout=EXIT_FLUSH_S)
        except Exception:
            pass


def call_at_exit(fn: Callable[[], object]) -> None:
    """Call ``fn`` at interpreter exit, before non-daemon threads are joined and while the
    executors still run (``threading``'s exit hooks; ``atexit`` where those are missing or
    already run). Hooks registered later run first."""
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        try:
            register(fn)
            return
        except RuntimeError:  # already shutting down
            pass
    atexit.register(fn)


def _ensure_hook() -> None:
    global _hook_registered
    with _hook_lock:
        if _hook_registered:
            return
        _hook_registered = True
    call_at_exit(_close_all)


def close_at_exit(obj: Closable) -> None:
    """Close ``obj`` at interpreter exit unless it is closed (or collected) before. Tracked
    weakly: tracking keeps nothing alive. Any thread."""
    _live.add(obj)
    _ensure_hook()


def forget(obj: Closable) -> None:
    """Stop tracking ``obj`` (it is closing by itself). Any thread; idempotent."""
    _live.discard(obj)
