"""Rate-limited warnings: one message per interval, the rest counted and summarised.

A tier that fails keeps failing for a while; logging every failure would flood the log (and
cost a formatted record per call on a hot path). :class:`RateLimitedLog` lets the first
message of a burst through, counts the ones that follow within ``interval_s``, and appends
that count to the next message it lets through::

    log = RateLimitedLog(logger, 5.0)
    log.warning("tier %s: put failed: %s", name, why)
    # ... later, after the interval:
    # "tier disk: put failed: ... (12 similar messages not logged)"
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable

__all__ = ["DEFAULT_INTERVAL_S", "RateLimitedLog"]

DEFAULT_INTERVAL_S = 5.0


class RateLimitedLog:
    """Logs at most one warning per ``interval_s`` (per ``key``), counting those it drops.

    The message that ends a quiet spell carries the suffix ``" (N similar messages not
    logged)"`` when N messages were dropped since the previous one. Messages are logged on
    ``logger`` as the caller wrote them (same level, same format arguments) with the record
    pointing at the caller of :meth:`warning`.

    ``key`` separates independent streams that share one instance (for example one per kind
    of failure): each key has its own interval and its own count. Thread-safe; the lock is
    held only for the bookkeeping, never while logging.
    """

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = DEFAULT_INTERVAL_S,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not interval_s >= 0:  # written so that NaN is refused too
            raise ValueError(f"interval_s must be >= 0, got {interval_s!r}")
        self.logger = logger
        self.interval_s = float(interval_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[Hashable, float] = {}
        self._suppressed: dict[Hashable, int] = {}

    def warning(self, msg: str, *args: object, key: Hashable = None) -> bool:
        """Log ``msg % args`` as a warning unless one with the same ``key`` was logged less
        than ``interval_s`` ago; True when it was logged, False when it was only counted."""
        now = self._clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.interval_s:
                self._suppressed[key] = self._suppressed.get(key, 0) + 1
                return False
            self._last[key] = now
            dropped = self._suppressed.pop(key, 0)
        if dropped:
            if args:
                msg += " (%d similar messages not logged)"
                args = (*args, dropped)
            else:  # no %-formatting happens without arguments: keep a literal '%' literal
                msg += f" ({dropped} similar messages not logged)"
        self.logger.warning(msg, *args, stacklevel=2)
        return True

    def suppressed(self, key: Hashable = None) -> int:
        """How many messages with ``key`` were dropped since the last one logged."""
        with self._lock:
            return self._suppressed.get(key, 0)
