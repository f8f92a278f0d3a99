"""The benches' loop watchdog names where a blocked event loop is stuck."""

from __future__ import annotations

import asyncio
import threading

import pytest

from bench.stalls import watch


def _blocking_call_in_the_loop(until: threading.Event) -> None:
    # A synchronous call on the loop's thread, as a GCS lookup: blocked until the
    # watchdog has reported it (at most 10 s, should it never).
    until.wait(10)


async def test_a_blocked_loop_is_reported_with_the_call_it_is_stuck_in() -> None:
    reports: list[str] = []
    reported = threading.Event()

    def say(report: str) -> None:
        reports.append(report)
        reported.set()

    watch(asyncio.get_running_loop(), after_s=0.3, every_s=0.05, say=say)
    _blocking_call_in_the_loop(reported)
    assert reported.is_set(), "the watchdog said nothing of a loop blocked for 10 s"
    assert "event loop blocked" in reports[0]
    assert "_blocking_call_in_the_loop" in reports[0]


async def test_a_loop_that_answers_is_not_reported(capsys: pytest.CaptureFixture[str]) -> None:
    watch(asyncio.get_running_loop(), after_s=0.3, every_s=0.05)
    for _ in range(10):
        await asyncio.sleep(0.05)
    assert "event loop blocked" not in capsys.readouterr().out
