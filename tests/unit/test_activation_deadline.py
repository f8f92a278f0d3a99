"""A dedicated activation has one deadline for all its attempts (``DEDICATED_DEADLINE_S``):
past it the request fails with ``ActivationUnavailable`` (typed, retryable: its timer
brings it round) raised from why its last attempt failed, and no attempt's wait outlasts
it. Without it, actors that never answered were waited on ``MAX_ATTEMPTS`` times, a start
and an answer each: hours, holding a coalescer's slot or a sweep. No Ray is started: the
actor class is replaced, at the module boundary, by one that makes fake actors.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import ray

from actors import ray_activator
from actors.activation_calls import MAX_ATTEMPTS
from tests.unit.test_activation_exhausted import Dying
from tests.unit.test_activation_kills import SilentActor, Standbys
from tests.unit.test_named_creation import Actor, SlowClass, an_activator
from torpor.errors import ActivationUnavailable
from torpor.ports import Reason

DEADLINE_S = 0.3


@pytest.fixture(autouse=True)
def short_deadline(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The activation's deadline is ``DEADLINE_S``; every kill is taken (and counted)."""
    monkeypatch.setattr(ray_activator, "DEDICATED_DEADLINE_S", DEADLINE_S)
    killed: list[Any] = []
    monkeypatch.setattr(ray, "kill", lambda handle, no_restart=True: killed.append(handle))
    return killed


async def given_up(actor: Any, monkeypatch: pytest.MonkeyPatch) -> tuple[Exception, float]:
    """The error a dedicated activation whose every actor is ``actor`` ends with, and how
    long it took to."""
    monkeypatch.setattr(ray_activator, "SessionActor", SlowClass(actor, until=lambda: None))
    started = time.monotonic()
    with pytest.raises(ActivationUnavailable) as raised:
        async with asyncio.timeout(5):
            await an_activator()._dedicated("s_1", Reason.SUBMIT, 0.0)
    assert raised.value.retryable
    return raised.value, time.monotonic() - started


async def test_silent_actors_are_tried_until_the_deadline_not_max_attempts_times(
    short_deadline: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each attempt's actor is silent for its whole start time: the activation stops at
    its deadline, after a few attempts, each actor killed."""
    monkeypatch.setattr(ray_activator, "START_TIMEOUT_S", 0.05)
    actor = SilentActor()
    error, took = await given_up(actor, monkeypatch)
    assert isinstance(error.__cause__, TimeoutError), "why it failed is not in the log"
    assert actor.ready.calls <= DEADLINE_S / 0.05 + 1 < MAX_ATTEMPTS, (
        f"{actor.ready.calls} attempts: the activation ran past its deadline"
    )
    # Each one given its whole start time was killed; the last may have been cut short.
    assert set(short_deadline) == {actor}
    assert actor.ready.calls - 1 <= len(short_deadline) <= actor.ready.calls
    assert took < DEADLINE_S + 1.0


async def test_an_attempt_waits_for_its_actor_no_longer_than_the_deadline_leaves(
    short_deadline: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A start is given ``START_TIMEOUT_S`` (600 s) of its own, but not past the
    activation's deadline; cut short, the actor is not shown silent and keeps its name
    (the retry finds it and gives it its whole time)."""
    actor = SilentActor()
    error, took = await given_up(actor, monkeypatch)
    assert isinstance(error.__cause__, TimeoutError)
    assert actor.ready.calls == 1
    assert took < DEADLINE_S + 1.0, f"the actor's start was waited on {took:.2f} s"
    assert short_deadline == [], "an actor whose start the deadline cut short was killed"


async def test_actors_dying_under_every_call_are_retried_until_the_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every attempt fails at once (the actor died under the call): the retries back off,
    and stop at the deadline, raised from the last death."""
    actor, dying = Actor(), Dying()
    actor.ready = dying  # type: ignore[assignment]
    error, took = await given_up(actor, monkeypatch)
    assert 1 < len(dying.raised) < MAX_ATTEMPTS
    assert error.__cause__ is dying.raised[-1], "why it failed is not in the log"
    assert took < DEADLINE_S + 1.0


async def test_standbys_that_do_not_answer_are_given_no_more_than_the_deadline(
    short_deadline: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The adoption shares the activation's deadline: a silent standby is waited on no
    longer than it leaves (and killed: taken from the set, nobody else knows it), the
    next ones are not taken, and no named actor is made past it."""
    named = SilentActor()
    monkeypatch.setattr(ray_activator, "SessionActor", SlowClass(named, until=lambda: None))
    first, second = SilentActor(), SilentActor()
    activator = an_activator()
    activator.standby = Standbys(first, second)
    started = time.monotonic()
    with pytest.raises(ActivationUnavailable) as raised:
        async with asyncio.timeout(5):
            await activator._dedicated("s_1", Reason.SUBMIT, 0.0)
    assert raised.value.retryable
    assert isinstance(raised.value.__cause__, TimeoutError), "why it failed is not in the log"
    assert time.monotonic() - started < DEADLINE_S + 1.0
    assert (first.adopt.calls, second.adopt.calls) == (1, 0)
    assert short_deadline == [first]
    assert named.ready.calls == 0, "a named actor was made past the deadline"


async def test_a_running_actor_the_deadline_cuts_short_is_kept(
    short_deadline: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The actor running the session is asked first; when the deadline, not its own
    answer time, ends the wait, it is neither killed nor forgotten."""
    named = SlowClass(Actor(), until=lambda: None)
    monkeypatch.setattr(ray_activator, "SessionActor", named)
    running = SilentActor()
    activator = an_activator()
    activator.standby = Standbys()
    activator._adopted["s_1"] = running
    with pytest.raises(ActivationUnavailable) as raised:
        async with asyncio.timeout(5):
            await activator._dedicated("s_1", Reason.SUBMIT, 0.0)
    assert isinstance(raised.value.__cause__, TimeoutError), "why it failed is not in the log"
    assert running.activate.calls == 1
    assert short_deadline == []
    assert activator._adopted == {"s_1": running}
    assert named.calls == 0, "another actor was given the session it may be running"
