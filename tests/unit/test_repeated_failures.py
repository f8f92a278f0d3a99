"""A failure a loop meets at every turn is logged once, then once a minute with a count,
and once more when it stops (``torpor.logs.Repeated``)."""

from __future__ import annotations

import logging

import pytest

from torpor.logs import Repeated


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def repeated(clock: Clock, caplog: pytest.LogCaptureFixture) -> Repeated:
    caplog.set_level(logging.WARNING, logger="storage.test")
    return Repeated(logging.getLogger("storage.test"), "could not flush /x", clock=clock)


def fail(repeated: Repeated) -> None:
    try:
        raise OSError(5, "Input/output error")
    except OSError:
        repeated.failed()


def test_a_failure_every_second_for_two_minutes_is_three_lines_and_one_when_it_stops(
    repeated: Repeated, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    for _ in range(121):  # at 0, 1, ..., 120 s
        fail(repeated)
        clock.now += 1.0
    repeated.succeeded()
    repeated.succeeded()  # working on: nothing more to say
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "could not flush /x",
        "could not flush /x (59 more failures since the last report)",
        "could not flush /x (59 more failures since the last report)",
        "could not flush /x: works again after 121 failures in 121 s",
    ]
    # Each report of the failure carries its traceback: the cause, not only the count.
    assert all(r.exc_info is not None for r in caplog.records[:3])
    assert caplog.records[3].exc_info is None


def test_after_it_worked_again_the_next_failure_is_reported_at_once(
    repeated: Repeated, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    fail(repeated)
    clock.now += 2.0
    repeated.succeeded()
    clock.now += 1.0
    fail(repeated)  # a new run of failures, 3 s after the last line
    assert [r.getMessage() for r in caplog.records] == [
        "could not flush /x",
        "could not flush /x: works again after 1 failure in 2 s",
        "could not flush /x",
    ]
