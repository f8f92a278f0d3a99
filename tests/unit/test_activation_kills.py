"""An activation kills an actor that does not answer (its node gone but not yet declared
dead, a paused process) and goes on: the kill is clean-up, made off the loop with a
deadline, and its own failure is never the activation's outcome. No Ray is started: the
actor class is replaced, at the module boundary, by one that makes silent actors, and
``ray.kill`` by one that fails or blocks its thread as a slow GCS would.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any

import pytest
import ray
from ray.exceptions import RaySystemError

from actors import named, ray_activator
from tests.unit.test_named_creation import Actor, SlowClass, an_activator
from tests.unit.test_named_lookups import SLOW_S, longest_stall
from torpor.errors import ActivationUnavailable
from torpor.ports import Reason

ATTEMPTS = 2


class Silent:
    """An actor method that never answers."""

    def __init__(self) -> None:
        self.calls = 0

    def remote(self, *args: object) -> asyncio.Future[Any]:
        self.calls += 1
        return asyncio.get_running_loop().create_future()


class SilentActor(Actor):
    def __init__(self) -> None:
        super().__init__()
        self.ready = Silent()
        self.activate = Silent()
        self.adopt = Silent()


class Standbys:
    """A standby set holding ``handles``, ready."""

    def __init__(self, *handles: Any) -> None:
        self.handles = deque(handles)

    def take(self) -> Any | None:
        return self.handles.popleft() if self.handles else None


@pytest.fixture
def silent(monkeypatch: pytest.MonkeyPatch) -> SilentActor:
    """Every session actor made is silent; waited for briefly, ``ATTEMPTS`` times."""
    actor = SilentActor()
    monkeypatch.setattr(ray_activator, "SessionActor", SlowClass(actor, until=lambda: None))
    monkeypatch.setattr(ray_activator, "START_TIMEOUT_S", 0.05)
    monkeypatch.setattr(ray_activator, "ACTIVATE_TIMEOUT_S", 0.05)
    monkeypatch.setattr(ray_activator, "MAX_ATTEMPTS", ATTEMPTS)
    return actor


def kills_failing(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    killed: list[Any] = []

    def failing_kill(handle: Any, no_restart: bool = True) -> None:
        killed.append(handle)
        raise RaySystemError("the GCS refused the kill")

    monkeypatch.setattr(ray, "kill", failing_kill)
    return killed


async def test_a_kill_that_fails_leaves_a_dedicated_activation_its_own_outcome(
    silent: SilentActor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every attempt's actor is silent and its kill fails: the activation goes on to its
    next attempt, and fails as one whose actors never answered does (typed, retryable),
    not with the kill's error after the first."""
    killed = kills_failing(monkeypatch)
    with pytest.raises(ActivationUnavailable) as raised:
        async with asyncio.timeout(5):
            await an_activator()._dedicated("s_1", Reason.SUBMIT, 0.0)
    assert raised.value.retryable
    assert killed == [silent] * ATTEMPTS, "not every silent actor was asked to go"


async def test_a_kill_that_fails_leaves_an_adoption_its_own_outcome(
    silent: SilentActor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A silent standby whose kill fails is passed over, as one whose kill is taken."""
    killed = kills_failing(monkeypatch)
    standby = SilentActor()
    activator = an_activator()
    activator.standby = Standbys(standby)
    async with asyncio.timeout(5):
        adopted = await activator._adopt("s_1", Reason.SUBMIT, 0.0)
    assert adopted is False, "no standby took it: the named path is next"
    assert killed == [standby]


async def test_a_kill_the_gcs_is_slow_to_take_holds_neither_the_loop_nor_the_activation(
    silent: SilentActor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ray.kill`` waits in its thread for the GCS: made on the loop, every other
    coroutine of the process (a replica's webhooks) waited, once per attempt."""
    killed: list[Any] = []

    def slow_kill(handle: Any, no_restart: bool = True) -> None:
        killed.append(handle)
        time.sleep(SLOW_S)

    monkeypatch.setattr(ray, "kill", slow_kill)
    monkeypatch.setattr(named, "LOOKUP_TIMEOUT_S", 0.2)
    started = time.monotonic()
    stall = await longest_stall(lambda: an_activator()._dedicated("s_1", Reason.SUBMIT, 0.0))
    # Each attempt asks for the kill; one asked while the last is still under way is
    # that same kill (``named._killing``), not another queued behind it.
    assert killed and all(h is silent for h in killed), "no kill was made: this measured nothing"
    assert stall < SLOW_S / 2, f"the loop was held {stall:.2f} s by a {SLOW_S} s kill"
    assert time.monotonic() - started < ATTEMPTS * SLOW_S, "the kills had no deadline"
