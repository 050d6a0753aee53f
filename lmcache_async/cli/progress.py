"""Progress bars of the ``lmcache-async`` command, drawn on a terminal only.

A bar is drawn (with tqdm, part of the ``cli`` extra) only when the stream it is drawn on is a
terminal, ``TERM`` is not ``dumb``, the caller did not turn it off (``--no-progress``) and tqdm
is installed. Otherwise nothing is drawn and :meth:`Progress.write` is a plain
``print``, so CI logs and redirected output hold lines only, never carriage returns.
"""

from __future__ import annotations

import os
import sys
from types import TracebackType
from typing import Any, TextIO

__all__ = ["Progress", "bars_wanted"]


def bars_wanted(stream: TextIO, enabled: bool = True) -> bool:
    """True when a progress bar may be drawn on ``stream``: ``enabled``, a terminal, ``TERM`` not
    ``dumb``."""
    if not enabled or os.environ.get("TERM") == "dumb":
        return False
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def _tqdm() -> Any:
    try:
        from tqdm import tqdm
    except ImportError:  # the cli extra is not installed: run without bars
        return None
    return tqdm


class Progress:
    """A bar over ``total`` steps on ``stream`` when :func:`bars_wanted` says so, else nothing.

    ``write`` prints a line (to ``stream`` or another file) without breaking the bar; use it for
    every line printed while the bar is open. ``delay`` seconds pass before a bar appears, so a
    short job draws none. Usable as a context manager; :meth:`close` removes the bar.
    """

    def __init__(
        self,
        total: int,
        desc: str,
        unit: str,
        *,
        stream: TextIO | None = None,
        enabled: bool = True,
        delay: float = 0.0,
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self._bar: Any = None
        tqdm = _tqdm() if bars_wanted(self.stream, enabled) else None
        if tqdm is not None:
            self._bar = tqdm(
                total=total, desc=desc, unit=unit, file=self.stream, dynamic_ncols=True, leave=False, delay=delay
            )

    @property
    def drawn(self) -> bool:
        """True when a bar is being drawn."""
        return self._bar is not None

    def update_to(self, done: int, total: int | None = None) -> None:
        """Show ``done`` steps (of ``total``, when it changed)."""
        if self._bar is None:
            return
        if total is not None and total != self._bar.total:
            self._bar.total = total
        self._bar.update(done - self._bar.n)

    def advance(self, steps: int = 1) -> None:
        """Add ``steps`` done steps."""
        if self._bar is not None:
            self._bar.update(steps)

    def status(self, text: str) -> None:
        """Show ``text`` after the bar (what is running now)."""
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=True)

    def write(self, line: str, file: TextIO | None = None) -> None:
        """Print ``line`` to ``file`` (default: the bar's stream) without breaking the bar."""
        out = file if file is not None else self.stream
        if self._bar is None:
            print(line, file=out, flush=True)
        else:
            self._bar.write(line, file=out)
            out.flush()

    def close(self) -> None:
        """Remove the bar (idempotent)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
