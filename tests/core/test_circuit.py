"""Circuit breaker of the lower tiers: opening, back-off, half-open probes, the back-off cap.

Every test drives an injected clock; nothing sleeps.
"""

from __future__ import annotations

import math

import pytest

from lmcache_async.circuit import CircuitBreaker
from lmcache_async.config import LMCacheEngineConfig
from lmcache_async.errors import ConfigError


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def breaker(clock: Clock, **kw: float) -> CircuitBreaker:
    return CircuitBreaker(clock=clock, **kw)  # type: ignore[arg-type]


def open_it(b: CircuitBreaker) -> None:
    while b.state != CircuitBreaker.OPEN:
        assert b.allow()
        b.failure()


def first_allowed_after(b: CircuitBreaker, clock: Clock, step: float = 1 / 128, limit: float = 120.0) -> float:
    """Seconds of clock time until ``allow()`` lets a call through (in exact binary steps)."""
    waited = 0.0
    while not b.allow():
        clock.advance(step)
        waited += step
        assert waited < limit, f"no call let through within {limit}s"
    return waited


def fail_probes(b: CircuitBreaker, clock: Clock, n: int) -> list[float]:
    """Let ``n`` probes through, each failing; the waits before each."""
    waits = []
    for _ in range(n):
        waits.append(first_allowed_after(b, clock))
        assert b.state == CircuitBreaker.HALF_OPEN
        b.failure()
        assert b.state == CircuitBreaker.OPEN
    return waits


def test_opens_after_threshold_consecutive_failures_and_skips_calls():
    clock = Clock()
    b = breaker(clock, threshold=3)
    for _ in range(2):
        assert b.allow()
        b.failure()
    assert b.state == CircuitBreaker.CLOSED and b.allow()
    b.failure()
    assert b.state == CircuitBreaker.OPEN and not b.allow()


def test_back_off_doubles_from_base_up_to_the_cap():
    clock = Clock()
    b = breaker(clock, base_backoff_s=0.5, max_backoff_s=4.0)
    open_it(b)
    waits = fail_probes(b, clock, 7)
    assert [round(w, 2) for w in waits] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0, 4.0]


def test_the_default_cap_is_the_configured_default():
    default = LMCacheEngineConfig.model_fields["remote_breaker_max_backoff_s"].default
    assert CircuitBreaker().max_backoff_s == default


def test_recovery_after_a_long_outage_waits_at_most_the_default_cap():
    clock = Clock()
    b = breaker(clock)
    open_it(b)
    fail_probes(b, clock, 40)  # minutes of outage, a probe failing at every retry
    assert first_allowed_after(b, clock) <= 4.0 + 1e-6
    b.success()
    assert b.state == CircuitBreaker.CLOSED and b.allow()


def test_no_back_off_exceeds_a_cap_below_the_base_back_off():
    clock = Clock()
    b = breaker(clock, base_backoff_s=2.0, max_backoff_s=0.25)
    open_it(b)
    assert first_allowed_after(b, clock) <= 0.25 + 1e-6
    assert max(fail_probes(b, clock, 5)) <= 0.25 + 1e-6


def test_a_lowered_cap_bounds_the_next_back_off():
    clock = Clock()
    b = breaker(clock, base_backoff_s=0.5, max_backoff_s=30.0)
    open_it(b)
    fail_probes(b, clock, 6)  # the back-off has grown to 16 s, then 30 s
    b.max_backoff_s = 2.0
    waits = fail_probes(b, clock, 3)  # the first is the wait already scheduled
    assert max(waits[1:]) <= 2.0 + 1e-6


def test_a_half_open_probe_that_never_reports_is_replaced_after_the_cap():
    clock = Clock()
    b = breaker(clock, base_backoff_s=0.5, max_backoff_s=3.0)
    open_it(b)
    clock.advance(0.5)
    assert b.allow()  # the probe, which never reports
    assert b.state == CircuitBreaker.HALF_OPEN
    assert not b.allow()  # one probe at a time
    waited = first_allowed_after(b, clock)
    assert 3.0 - 0.02 <= waited <= 3.0 + 1e-6
    assert not b.allow()  # the replacement holds the slot in turn
    b.success()
    assert b.state == CircuitBreaker.CLOSED


def test_a_stuck_probe_under_the_default_cap_is_replaced_within_it():
    clock = Clock()
    b = breaker(clock)
    open_it(b)
    fail_probes(b, clock, 10)
    assert first_allowed_after(b, clock) <= 4.0 + 1e-6  # the probe that hangs
    assert first_allowed_after(b, clock) <= 4.0 + 1e-6  # replaced


def test_an_abandoned_probe_frees_its_slot_at_once():
    clock = Clock()
    b = breaker(clock)
    open_it(b)
    fail_probes(b, clock, 3)
    assert first_allowed_after(b, clock) > 0
    b.abandon()
    assert b.state == CircuitBreaker.OPEN and b.allow()


def test_failures_of_calls_in_flight_while_open_do_not_grow_the_back_off():
    clock = Clock()
    b = breaker(clock, base_backoff_s=0.5, max_backoff_s=4.0)
    open_it(b)
    for _ in range(10):  # calls admitted before the circuit opened, failing late
        b.failure()
    assert round(first_allowed_after(b, clock), 2) == 0.5


def test_success_closes_and_resets_the_back_off():
    clock = Clock()
    b = breaker(clock, base_backoff_s=0.5, max_backoff_s=4.0)
    open_it(b)
    fail_probes(b, clock, 4)
    assert first_allowed_after(b, clock) >= 0
    b.success()
    assert b.state == CircuitBreaker.CLOSED and b.failures == 0
    open_it(b)
    assert round(first_allowed_after(b, clock), 2) == 0.5


@pytest.mark.parametrize("value", [0, -1.0, math.inf, math.nan])
def test_back_offs_that_are_not_a_positive_finite_time_are_refused(value):
    with pytest.raises(ValueError, match="max_backoff_s"):
        CircuitBreaker(max_backoff_s=value)
    with pytest.raises(ValueError, match="base_backoff_s"):
        CircuitBreaker(base_backoff_s=value)


def test_threshold_below_one_is_refused():
    with pytest.raises(ValueError, match="threshold"):
        CircuitBreaker(threshold=0)


@pytest.mark.parametrize("value", ["inf", 0, -2])
def test_the_configuration_refuses_a_cap_the_breaker_cannot_honour(value):
    with pytest.raises(ConfigError, match="remote_breaker_max_backoff_s"):
        LMCacheEngineConfig.from_defaults(remote_breaker_max_backoff_s=value)


def test_failure_with_open_now_opens_below_the_threshold() -> None:
    from lmcache_async.circuit import CircuitBreaker

    now = [0.0]
    b = CircuitBreaker(threshold=3, base_backoff_s=0.5, clock=lambda: now[0])
    b.failure(open_now=True)
    assert b.state == CircuitBreaker.OPEN and not b.allow()
    now[0] += 0.5
    assert b.allow() and b.state == CircuitBreaker.HALF_OPEN
    b.success()
    assert b.state == CircuitBreaker.CLOSED
