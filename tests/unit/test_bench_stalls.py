"""The benches' loop watchdog names where a blocked event loop is stuck."""

from __future__ import annotations

import asyncio
import time

import pytest

from bench.stalls import watch


def _blocking_call_in_the_loop(seconds: float) -> None:
    time.sleep(seconds)  # a synchronous call on the loop's thread, as a GCS lookup


async def test_a_blocked_loop_is_printed_with_the_call_it_is_stuck_in(
    capsys: pytest.CaptureFixture[str],
) -> None:
    watch(asyncio.get_running_loop(), after_s=0.3, every_s=0.05)
    await asyncio.sleep(0.1)
    _blocking_call_in_the_loop(1.0)
    await asyncio.sleep(0.1)
    out = capsys.readouterr().out
    assert "event loop blocked" in out
    assert "_blocking_call_in_the_loop" in out


async def test_a_loop_that_answers_is_not_reported(capsys: pytest.CaptureFixture[str]) -> None:
    watch(asyncio.get_running_loop(), after_s=0.3, every_s=0.05)
    for _ in range(10):
        await asyncio.sleep(0.05)
    assert "event loop blocked" not in capsys.readouterr().out
