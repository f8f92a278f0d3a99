"""An activation that used up its attempts fails with ``ActivationUnavailable`` (typed,
retryable: its timer brings it round) raised from why its last attempt failed, so the
log says why: the actor dying under the call, or silent. No Ray is started: the actor
class is replaced, at the module boundary, by one whose actors fail each call.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import ray
from ray.exceptions import RayActorError

from actors import ray_activator
from actors.session_actor import CLOSING
from tests.unit.test_activation_kills import SilentActor
from tests.unit.test_named_creation import Actor, SlowClass, an_activator
from torpor.errors import ActivationUnavailable
from torpor.ports import Reason

ATTEMPTS = 3


class Dying:
    """An actor method whose every call fails as the actor dies under it."""

    def __init__(self) -> None:
        self.raised: list[RayActorError] = []

    def remote(self, *args: object) -> asyncio.Future[Any]:
        error = RayActorError()
        self.raised.append(error)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        future.set_exception(error)
        return future


@pytest.fixture(autouse=True)
def few_attempts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ray_activator, "START_TIMEOUT_S", 0.05)
    monkeypatch.setattr(ray_activator, "ACTIVATE_TIMEOUT_S", 0.05)
    monkeypatch.setattr(ray_activator, "MAX_ATTEMPTS", ATTEMPTS)
    monkeypatch.setattr(ray, "kill", lambda handle, no_restart=True: None)


async def exhausted(actor: Any, monkeypatch: pytest.MonkeyPatch) -> ActivationUnavailable:
    """The error a dedicated activation ends with when every actor made is ``actor``."""
    monkeypatch.setattr(ray_activator, "SessionActor", SlowClass(actor, until=lambda: None))
    with pytest.raises(ActivationUnavailable) as raised:
        async with asyncio.timeout(5):
            await an_activator()._dedicated("s_1", Reason.SUBMIT, 0.0)
    assert raised.value.retryable
    return raised.value


async def test_a_dedicated_activation_whose_actors_died_is_raised_from_the_last_death(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    actor = Actor()
    actor.ready = Dying()  # type: ignore[assignment]
    error = await exhausted(actor, monkeypatch)
    assert len(actor.ready.raised) == ATTEMPTS
    assert error.__cause__ is actor.ready.raised[-1], "why it failed is not in the log"


async def test_a_dedicated_activation_whose_actors_were_silent_is_raised_from_the_silence(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    error = await exhausted(SilentActor(), monkeypatch)
    assert isinstance(error.__cause__, TimeoutError), "why it failed is not in the log"


async def test_a_dedicated_activation_whose_actors_were_closing_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An answer is no error: the last one is in the message, and no cause is made up."""
    actor = Actor()
    actor.activate.answer = CLOSING
    error = await exhausted(actor, monkeypatch)
    assert actor.activate.calls == ATTEMPTS
    assert error.__cause__ is None
    assert repr(CLOSING) in str(error)
