"""The manager's boundary around one lower tier: timeout, circuit breaker, counters.

Every call the :class:`~lmcache_async.storage_manager.StorageManager` makes to a lower tier
(disk, remote, NIXL, third-party backends) goes through :meth:`TierGuard.call`. A backend that
raises, hangs or is skipped by its open circuit never raises into the manager: the call answers
:data:`NO_ANSWER` instead, the failure is counted in :meth:`TierGuard.stats` and logged at most
once per burst, and it feeds the tier's :class:`~lmcache_async.circuit.CircuitBreaker`.

:data:`NO_ANSWER` means *unknown*, never *absent*: the tier may or may not hold the entry, so a
caller treats it as a miss for reads and must not delete or overwrite anything on its account.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Final, TypeVar, TypeVarTuple

from lmcache_async.circuit import CircuitBreaker
from lmcache_async.ratelog import RateLimitedLog
from lmcache_async.tiers import UNKNOWN, CannotTell, DirectReader, LocalTier, StorageBackend

if TYPE_CHECKING:
    from lmcache_async.keys import CacheEngineKey
    from lmcache_async.read_sinks import ReadSink

__all__ = ["ENTRIES_PER_TIMEOUT", "LOG_BURST_S", "NO_ANSWER", "WRITE_CONCURRENCY", "NoAnswer", "TierGuard"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
Ts = TypeVarTuple("Ts")

#: A batch of ``n`` entries gets one timeout per this many entries.
ENTRIES_PER_TIMEOUT: Final = 8
#: Concurrent write-through batches per tier.
WRITE_CONCURRENCY: Final = 4
#: At most one failure warning per tier in this many seconds.
LOG_BURST_S: Final = 5.0


NoAnswer = CannotTell
NO_ANSWER: Final = UNKNOWN
"""A tier call that failed, timed out or was skipped (open circuit): the answer is unknown."""


class TierGuard:
    """One lower tier as the manager sees it: its backend plus timeout, breaker and counters.

    Threads: :meth:`call` is a coroutine of the manager's loop thread, like the backend's own
    coroutines; the counters are written there only (by :meth:`call` and by the manager, which
    adds ``hits``/``misses``/``writes``/``write_failures``). :meth:`stats` may be read from any
    thread; its figures can trail the loop by a few calls. The breaker is thread-safe.

    ``timeout`` is the bound on one call (per :data:`ENTRIES_PER_TIMEOUT` entries of a batch);
    ``max_backoff_s`` caps the breaker's back-off. Failure warnings go to ``log`` (by default
    this module's logger), at most one per :data:`LOG_BURST_S` seconds.
    """

    def __init__(
        self,
        backend: StorageBackend,
        timeout: float,
        max_backoff_s: float,
        *,
        log: logging.Logger = logger,
    ) -> None:
        self.backend = backend
        self.name = backend.name
        self.timeout = timeout
        self.breaker = CircuitBreaker(max_backoff_s=max_backoff_s)
        #: Bounds the write-through batches in flight to this tier.
        self.write_slots = asyncio.Semaphore(WRITE_CONCURRENCY)
        self.hits = 0
        self.misses = 0
        self.errors = 0
        self.timeouts = 0
        self.skipped = 0
        self.writes = 0
        self.write_failures = 0
        #: The backend as a :class:`~lmcache_async.tiers.LocalTier` when it is one (the
        #: manager asks it for reads on the caller's thread; the loop-path read searches skip it).
        self.local: LocalTier | None = backend.as_local()
        #: The backend as a :class:`~lmcache_async.tiers.DirectReader` when it is one (the
        #: manager's ``read_into_sync`` reads it on the caller's thread, :meth:`read_into_here`).
        self.direct: DirectReader | None = backend.as_direct_reader()
        self.direct_counts: dict[str, int] = dict.fromkeys(("hits", "misses", "errors", "skipped"), 0)
        self._direct_lock = threading.Lock()
        self._log = RateLimitedLog(log, LOG_BURST_S)

    async def call(self, op: str, fn: Callable[[*Ts], Awaitable[T]], *args: *Ts, n: int = 1) -> T | CannotTell:
        """``await fn(*args)`` under the tier's timeout and breaker; :data:`NO_ANSWER` when the
        breaker skips the tier, the call times out or it raises (``op`` names it in the log).

        A batch of ``n`` entries gets one timeout per :data:`ENTRIES_PER_TIMEOUT` entries, so a
        long batch on a slow device is not cut off (and its writes dropped) for its length.
        Cancellation propagates; a cancelled half-open probe frees the breaker's probe slot."""
        if not self.breaker.allow():
            self.skipped += 1
            return NO_ANSWER
        timeout = self.timeout * max(1, -(-n // ENTRIES_PER_TIMEOUT))
        try:
            async with asyncio.timeout(timeout):
                result = await fn(*args)
        except TimeoutError:
            self.timeouts += 1
            # The first timeout opens the circuit: a hung tier would cost every later call
            # (a write-through batch after another, each read) the whole bound again.
            self._failed(op, f"timed out after {timeout}s", open_now=True)
            return NO_ANSWER
        except asyncio.CancelledError:
            self.breaker.abandon()  # a cancelled probe must not keep the circuit half-open
            raise
        except Exception as exc:
            self._failed(op, f"{type(exc).__name__}: {exc}")
            return NO_ANSWER
        self.breaker.success()
        return result

    def read_into_here(self, keys: Sequence[CacheEngineKey], sinks: Sequence[ReadSink], prefix: bool) -> list[bool]:
        """The tier's :meth:`~lmcache_async.tiers.DirectReader.read_into_many` on the calling
        thread (a caller thread, never the loop), under the breaker; one flag per key, all False
        (misses) when the backend is no :class:`~lmcache_async.tiers.DirectReader`, the
        breaker skips it or it raises (counted, logged). The ``direct_*`` counters are written
        here, under their own lock (with ``prefix``, the keys after the first one not filled
        were not asked and are not counted)."""
        reader = self.direct
        n = len(keys)
        if reader is None or not n:
            return [False] * n
        if not self.breaker.allow():
            with self._direct_lock:
                self.direct_counts["skipped"] += n
            return [False] * n
        try:
            flags = [bool(f) for f in reader.read_into_many(keys, sinks, prefix)]
            if len(flags) != n:
                raise ValueError(f"read_into_many answered {len(flags)} flags for {n} keys")
        except Exception as exc:
            self.breaker.failure()
            with self._direct_lock:
                self.direct_counts["errors"] += 1
            self._log.warning("tier %s: read_into failed: %s: %s", self.name, type(exc).__name__, exc)
            return [False] * n
        self.breaker.success()
        hits = sum(flags)
        with self._direct_lock:
            self.direct_counts["hits"] += hits
            self.direct_counts["misses"] += (1 if hits < n else 0) if prefix else n - hits
        return flags

    def contains_nowait(self, key: CacheEngineKey) -> bool | CannotTell:
        """The backend's :meth:`~lmcache_async.tiers.StorageBackend.contains_nowait` on the
        caller's thread, with None (a tier of the contract's first release) read as
        :data:`UNKNOWN`."""
        r = self.backend.contains_nowait(key)
        return UNKNOWN if r is None else r

    @property
    def answers_locally(self) -> bool:
        """True when the tier answers reads on the caller's thread (:attr:`local` is set)."""
        return self.local is not None

    def _failed(self, op: str, why: str, open_now: bool = False) -> None:
        self.errors += 1
        self.breaker.failure(open_now=open_now)
        self._log.warning("tier %s: %s failed: %s", self.name, op, why)

    def stats(self) -> dict[str, Any]:
        """The backend's own figures (``entries``/``bytes``/``evictions`` default to 0) plus
        this guard's counters and the circuit state. A backend whose ``stats()`` raises still
        gets the guard's figures."""
        out: dict[str, Any] = {"entries": 0, "bytes": 0, "evictions": 0}
        try:
            out.update(self.backend.stats())
        except Exception:  # pragma: no cover - a broken backend must not break stats()
            self._log.logger.debug("stats of %s failed", self.name, exc_info=True)
        out.update(
            hits=self.hits,
            misses=self.misses,
            errors=self.errors,
            timeouts=self.timeouts,
            skipped=self.skipped,
            writes=self.writes,
            write_failures=self.write_failures,
            circuit=self.breaker.state,
        )
        if self.direct is not None:
            with self._direct_lock:
                out.update({f"direct_{k}": v for k, v in self.direct_counts.items()})
        return out
