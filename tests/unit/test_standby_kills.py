"""A standby that does not answer (its start, a keeping round, its retire) is killed off
the event loop, with a deadline: ``ray.kill`` waits in its thread for the GCS, and on
the loop a slow one held every other coroutine of the holder's process (a Serve
replica's webhooks). No Ray is started: the standbys are fakes, and ``ray.kill`` is
replaced by one that blocks its thread as a slow GCS would.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import ray

from actors import named, standby
from actors.standby import StandbySet, _retire
from tests.unit.test_activation_kills import SilentActor
from tests.unit.test_named_lookups import SLOW_S, longest_stall


class SilentStandby(SilentActor):
    def __init__(self) -> None:
        super().__init__()
        self.keep = self.retire = self.ready  # every call unanswered


def spawning(handle: SilentStandby) -> Callable[[], Awaitable[Any]]:
    async def spawn() -> SilentStandby:
        return handle

    return spawn


async def start_given_up(handle: SilentStandby) -> None:
    await StandbySet(1, spawning(handle))._start()


async def keeping_round(handle: SilentStandby) -> None:
    standbys = StandbySet(1, spawning(SilentStandby()))  # never spawns: no refill here
    standbys._ready.append(handle)
    await standbys._keep_once(0.05)


async def retire_unanswered(handle: SilentStandby) -> None:
    await _retire(handle, timeout_s=0.05)


@pytest.mark.parametrize("operation", [start_given_up, keeping_round, retire_unanswered])
async def test_a_silent_standby_is_killed_without_stalling_the_loop(
    operation: Callable[[SilentStandby], Awaitable[None]], monkeypatch: pytest.MonkeyPatch
) -> None:
    killed: list[Any] = []

    def slow_kill(handle: Any, no_restart: bool = True) -> None:
        killed.append(handle)
        time.sleep(SLOW_S)

    monkeypatch.setattr(ray, "kill", slow_kill)
    monkeypatch.setattr(standby, "START_TIMEOUT_S", 0.05)
    monkeypatch.setattr(named, "LOOKUP_TIMEOUT_S", 0.2)
    handle = SilentStandby()
    stall = await longest_stall(lambda: operation(handle))
    assert killed == [handle], "the silent standby was not killed: this measured nothing"
    assert stall < SLOW_S / 2, f"the loop was held {stall:.2f} s by a {SLOW_S} s kill"
