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


def test_a_cause_that_comes_and_goes_is_held_to_the_same_pace(
    repeated: Repeated, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    fail(repeated)
    clock.now += 2.0
    repeated.succeeded()
    clock.now += 1.0
    fail(repeated)  # again, 3 s after the last line: counted, not a line
    clock.now += 1.0
    repeated.succeeded()  # nothing said of a run that had no line
    clock.now += 57.0
    fail(repeated)  # 61 s after the last line
    assert [r.getMessage() for r in caplog.records] == [
        "could not flush /x",
        "could not flush /x: works again after 1 failure in 2 s",
        "could not flush /x (1 more failures since the last report)",
    ]
