"""A small circuit breaker for lower tiers: closed -> open (skip) -> half-open (one probe)."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

__all__ = ["CircuitBreaker"]


class CircuitBreaker:
    """Opens after ``threshold`` consecutive failures; retries after an exponential back-off.

    While open, :meth:`allow` answers False (callers skip the tier and count it). After the
    back-off one caller is let through as a probe; its success closes the circuit, its failure
    reopens it with a doubled back-off. Thread-safe.

    ``max_backoff_s`` bounds every wait, so a tier that comes back is probed again at most
    ``max_backoff_s`` after the last failed probe, however long it was down:

    * no back-off exceeds it (a ``base_backoff_s`` above it is lowered to it);
    * a half-open probe that never reports (neither :meth:`success`, :meth:`failure` nor
      :meth:`abandon`) gives its slot to another caller ``max_backoff_s`` after it started.
    """

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half-open"

    def __init__(
        self,
        threshold: int = 3,
        base_backoff_s: float = 0.5,
        max_backoff_s: float = 4.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if threshold < 1:
            raise ValueError(f"threshold must be >= 1, got {threshold}")
        for what, value in (("base_backoff_s", base_backoff_s), ("max_backoff_s", max_backoff_s)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{what} must be a finite number of seconds > 0, got {value!r}")
        self.threshold = threshold
        self.max_backoff_s = float(max_backoff_s)
        self.base_backoff_s = min(float(base_backoff_s), self.max_backoff_s)
        #: The time source (``time.monotonic`` by default); tests may replace it with a fake clock.
        self.clock = clock
        self._lock = threading.Lock()
        self.state = self.CLOSED
        self.failures = 0
        self.opened = 0
        self._backoff = self.base_backoff_s  # the wait after the next opening
        self._retry_at = 0.0
        self._probe_started = 0.0

    def allow(self) -> bool:
        """Whether a call may go to the tier now."""
        with self._lock:
            if self.state == self.CLOSED:
                return True
            now = self.clock()
            if self.state == self.OPEN:
                if now < self._retry_at:
                    return False
                self.state = self.HALF_OPEN
                self._probe_started = now
                return True
            # HALF_OPEN: one probe at a time; a probe that never reports is replaced.
            if now - self._probe_started >= self.max_backoff_s:
                self._probe_started = now
                return True
            return False

    def success(self) -> None:
        """Report a call that worked."""
        with self._lock:
            self.state = self.CLOSED
            self.failures = 0
            self._backoff = self.base_backoff_s

    def abandon(self) -> None:
        """Report a call that was cancelled before it gave a verdict: a half-open probe frees
        its slot at once (the next call probes again) instead of after ``max_backoff_s``."""
        with self._lock:
            if self.state == self.HALF_OPEN:
                self.state = self.OPEN
                self._retry_at = self.clock()

    def failure(self, *, open_now: bool = False) -> None:
        """Report a call that failed or timed out. ``open_now`` opens the circuit whatever the
        threshold (a timeout: each further call would cost the whole bound again)."""
        with self._lock:
            self.failures += 1
            if self.state == self.OPEN:
                # A call admitted before the circuit opened: its back-off already runs, and
                # doubling it once per call in flight would turn one outage into minutes.
                return
            if open_now or self.state == self.HALF_OPEN or self.failures >= self.threshold:
                self.opened += 1
                self.state = self.OPEN
                # Clamped here too: ``max_backoff_s`` may have been lowered since the doubling.
                backoff = min(self._backoff, self.max_backoff_s)
                self._retry_at = self.clock() + backoff
                self._backoff = min(backoff * 2, self.max_backoff_s)
