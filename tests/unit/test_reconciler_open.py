"""The reconciler opens its services off its event loop, with a deadline (no Ray
started: its actor's class runs in this process, and ``open_services`` is replaced, at
the module boundary, by one that blocks its thread as opening a store and an index
would).

Each incarnation opens them once, in ``_ensure``, which both the sweep loop and the
deadline loop call: opened on the loop, a slow open held both loops, and ``status``,
for as long as it took.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from actors import reconciler
from tests.unit.test_delivery_node_count import CLUSTER_STORAGE
from tests.unit.test_named_lookups import SLOW_S, longest_stall
from tests.unit.test_reconciler_node_count import a_reconciler, ensured
from torpor.errors import CallTimedOut
from torpor.settings import Settings


class SlowOpen:
    """``open_services``: blocks its thread until ``until`` returns, then opens."""

    def __init__(self, until: Callable[[], object] = lambda: time.sleep(SLOW_S)) -> None:
        self.until = until
        self.calls = 0

    def __call__(self, settings: Settings, **_: Any) -> Any:
        self.calls += 1
        self.until()
        return SimpleNamespace(settings=settings)


def unopened(monkeypatch: pytest.MonkeyPatch, open_services: SlowOpen) -> Any:
    """A reconciler whose services are not open yet (a new incarnation's)."""
    monkeypatch.setattr(reconciler, "open_services", open_services)
    made = a_reconciler(monkeypatch, Settings(storage=CLUSTER_STORAGE))  # no node count
    made._services = None
    return made


async def test_a_slow_open_of_the_services_does_not_hold_the_reconcilers_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    opened = SlowOpen()
    made = unopened(monkeypatch, opened)
    stall = await longest_stall(lambda: ensured(made))
    assert opened.calls == 1, "the services were not opened: this measured nothing"
    assert stall < SLOW_S / 2, f"the loop was held {stall:.2f} s by a {SLOW_S} s open"
    assert made._sweeper is not None and made._services is not None


async def test_the_sweep_and_deadline_loops_asking_at_once_open_the_services_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The open leaves the loop free, so the other loop's ``_ensure`` comes in during it:
    it waits for the first (``_ensuring``) and opens nothing of its own."""
    opened = SlowOpen()
    made = unopened(monkeypatch, opened)
    first, second = await asyncio.gather(ensured(made), ensured(made))
    assert first is second
    assert opened.calls == 1


async def test_an_open_past_its_deadline_fails_the_sweep_and_the_next_waits_for_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A thread cannot be stopped: the next sweep waits for the same open (not a second
    one beside it) and keeps what it opened."""
    answer = threading.Event()
    opened = SlowOpen(until=lambda: answer.wait(10))
    # Not ``raising``: without a deadline the test fails on the open held, not here.
    monkeypatch.setattr(reconciler, "OPEN_TIMEOUT_S", 0.2, raising=False)
    made = unopened(monkeypatch, opened)
    try:
        for _ in range(2):
            started = time.monotonic()
            with pytest.raises(CallTimedOut) as raised:
                await made._ensure()
            assert time.monotonic() - started < 5
            assert raised.value.retryable
            assert made._sweeper is None
    finally:
        answer.set()
    async with asyncio.timeout(5):
        await ensured(made)
    assert opened.calls == 1
    assert made._services.settings is made._settings


async def test_an_open_that_failed_is_tried_afresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """A secret not yet in the node's environment, a store not reachable yet: the next
    sweep opens again rather than raise the first failure for ever."""
    failures = [OSError("connection refused")]

    def fails_once() -> None:
        if failures:
            raise failures.pop()

    opened = SlowOpen(until=fails_once)
    made = unopened(monkeypatch, opened)
    with pytest.raises(OSError, match="connection refused"):
        await made._ensure()
    await ensured(made)
    assert opened.calls == 2
    assert made._sweeper is not None
