"""The encoder-cache connector's counters, error accounting and rate-limited warnings.

:class:`ECCounters` is the base of both connector halves (:mod:`.ec_scheduler`,
:mod:`.ec_worker`): every counter lives in one lock-guarded dict, safe to read from any thread.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from lmcache_async.ratelog import RateLimitedLog

__all__ = ["COUNTERS", "LOG_EVERY_S", "ECCounters", "describe_error"]

LOG_EVERY_S = 5.0
"""Seconds between two warnings of one category (see :meth:`ECCounters._log`)."""

COUNTERS = (
    "lookups",
    "hits",
    "misses",
    "promised",
    "deferred",
    "prefetches",
    "prefetch_hits",
    "prefetch_timeouts",
    "faults",
    "loaded",
    "loaded_bytes",
    "loaded_from_hold",
    "loaded_from_lease",
    "load_failures",
    "load_skipped_present",
    "leases",
    "lease_failures",
    "unavailable_requests",
    "saved",
    "saved_bytes",
    "save_rejected",
    "save_skipped",
    "errors",
)
"""Every counter the connector keeps (``stats()`` and vLLM's EC connector stats use these names).

``hits``/``misses``: ``has_cache_item`` answers. ``faults``: an entry a tier claimed but could
not deliver intact (damaged, vanished, tier down) seen before a promise; the item was reported
not cached and vLLM encoded it. ``load_failures``: a promised item the worker could not load
(its request is failed through ``take_unavailable_requests``)."""


def describe_error(exc: BaseException | str) -> str:
    """``exc`` as one log-friendly string (a string is returned as it is)."""
    return exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"


class ECCounters:
    """Counters of one connector: its own, what it already reported, what its workers reported.

    :meth:`_init_counters` must run first (the connector's constructor calls it). Every method
    takes ``_lock`` for the counters; none does I/O.
    """

    _lock: threading.Lock
    _counters: dict[str, int]
    _reported: dict[str, int]
    _worker_reported: dict[str, int]
    _errors_by_op: dict[str, int]
    _rate_log: RateLimitedLog

    def _init_counters(self, log: logging.Logger) -> None:
        """Zero every counter; warnings go to ``log`` (at most one per ``LOG_EVERY_S`` per category)."""
        self._lock = threading.Lock()
        self._counters = dict.fromkeys(COUNTERS, 0)
        self._reported = dict.fromkeys(COUNTERS, 0)
        self._worker_reported = dict.fromkeys(COUNTERS, 0)
        self._errors_by_op = {}
        self._rate_log = RateLimitedLog(log, LOG_EVERY_S)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n

    def _failed(self, op: str, exc: BaseException | str) -> None:
        with self._lock:
            self._counters["errors"] += 1
            self._errors_by_op[op] = self._errors_by_op.get(op, 0) + 1
            total = self._errors_by_op[op]
        self._log(op, "encoder-cache connector: %s failed (%d so far): %s", op, total, describe_error(exc))

    def _log(self, category: str, msg: str, *args: Any) -> None:
        """A warning, at most once per few seconds per category."""
        self._rate_log.warning(msg, *args, key=category)

    def take_stats_delta(self) -> dict[str, int]:
        """Scheduler side: counter increments since the last call, this connector's own plus
        what the workers reported (vLLM's EC connector stats are built from it)."""
        with self._lock:
            out = {k: v - self._reported[k] for k, v in self._counters.items() if v != self._reported[k]}
            self._reported = dict(self._counters)
            for k, v in self._worker_reported.items():
                if v:
                    out[k] = out.get(k, 0) + v
            self._worker_reported = dict.fromkeys(COUNTERS, 0)
        return out
