"""Rate-limited warnings: one per interval per key, the dropped ones counted in the next.

Every test drives an injected clock; nothing sleeps.
"""

from __future__ import annotations

import logging
import threading

import pytest

from lmcache_async.ratelog import RateLimitedLog

LOGGER = "lmcache_async.tests.ratelog"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def log(clock: Clock) -> RateLimitedLog:
    return RateLimitedLog(logging.getLogger(LOGGER), 5.0, clock=clock)


def _messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_the_first_message_is_logged_as_written(log, caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert log.warning("tier %s: %s failed", "disk", "put") is True
    assert _messages(caplog) == ["tier disk: put failed"]
    assert caplog.records[0].levelno == logging.WARNING


def test_messages_within_the_interval_are_counted_not_logged(log, clock, caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        log.warning("failed: %s", "a")
        clock.now += 1.0
        assert log.warning("failed: %s", "b") is False
        assert log.warning("failed: %s", "c") is False
    assert _messages(caplog) == ["failed: a"]
    assert log.suppressed() == 2


def test_the_next_message_after_the_interval_carries_the_dropped_count(log, clock, caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        log.warning("failed: %s", "a")
        log.warning("failed: %s", "b")
        log.warning("failed: %s", "c")
        clock.now += 5.0
        log.warning("failed: %s", "d")
        clock.now += 5.0
        log.warning("failed: %s", "e")
    assert _messages(caplog) == ["failed: a", "failed: d (2 similar messages not logged)", "failed: e"]
    assert log.suppressed() == 0


def test_a_message_without_arguments_keeps_a_literal_percent_sign(log, clock, caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        log.warning("disk 100% full")
        log.warning("disk 100% full")
        clock.now += 5.0
        log.warning("disk 100% full")
    assert _messages(caplog) == ["disk 100% full", "disk 100% full (1 similar messages not logged)"]


def test_keys_have_their_own_interval_and_count(log, clock, caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        log.warning("read failed", key="read")
        log.warning("write failed", key="write")
        log.warning("read failed", key="read")
        clock.now += 5.0
        log.warning("write failed", key="write")
    assert _messages(caplog) == ["read failed", "write failed", "write failed"]
    assert log.suppressed("read") == 1 and log.suppressed("write") == 0


def test_the_record_points_at_the_caller(log, caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        log.warning("here")
    assert caplog.records[0].funcName == "test_the_record_points_at_the_caller"


def test_concurrent_callers_log_once_and_count_the_rest(log, caplog):
    start = threading.Barrier(8)

    def hammer() -> None:
        start.wait()
        for _ in range(1000):
            log.warning("failed")

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        threads = [threading.Thread(target=hammer) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(_messages(caplog)) == 1
    assert log.suppressed() == 8 * 1000 - 1


@pytest.mark.parametrize("interval", [-1.0, float("nan")])
def test_an_interval_that_is_not_a_duration_is_refused(interval):
    with pytest.raises(ValueError, match="interval_s"):
        RateLimitedLog(logging.getLogger(LOGGER), interval)
