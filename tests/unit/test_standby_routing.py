"""Which actor a dedicated session's request goes to when the activator keeps standbys,
and what a restarted holder does with the standbys it finds (pure code, no Ray started:
the actors are fakes)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError

from actors import ray_activator, standby_inheritance
from actors.ray_activator import Admission, RayActivator
from actors.session_actor import ACCEPTED
from actors.standby import StandbySet, Standing
from tests.conftest import eventually
from torpor.ports import Reason
from torpor.settings import Placement, Settings


class Method:
    def __init__(self, answer: Any) -> None:
        self.answer = answer
        self.calls: list[tuple[object, ...]] = []

    def remote(self, *args: object) -> asyncio.Future[Any]:
        self.calls.append(args)
        if isinstance(self.answer, asyncio.Future):
            return self.answer
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        future.set_result(self.answer)
        return future


class Actor:
    """A session actor (named, or a standby): answers at once, sleeps when told."""

    def __init__(self) -> None:
        self.slept: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.ready = Method(1234)
        self.activate = Method(ACCEPTED)
        self.adopt = Method(ACCEPTED)
        self.finished = Method(self.slept)
        self.retire = Method(True)


async def nothing_alive() -> set[str]:
    return set()


async def spawn() -> Actor:
    return Actor()


def activator_with_standbys(named: Actor) -> tuple[Any, StandbySet]:
    activator: Any = RayActivator.__new__(RayActivator)  # no Ray: actors are fakes
    activator.namespace, activator.config = "t", object()
    activator._placements = {"s_1": Placement.DEDICATED}
    activator.admission = Admission(10, alive=nothing_alive)
    activator.standby = standby = StandbySet(1, spawn)
    activator._adopted, activator._adopting, activator._watchers = {}, {}, set()
    return activator, standby


async def test_requests_while_a_named_actor_runs_go_to_it_not_to_a_standby(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A session the empty standby set could not take got a named actor. Each request
    while that actor ran took a standby (refilled with a process start), which found the
    session leased and exited: a process started per request, for nothing."""
    named = Actor()
    monkeypatch.setattr(
        ray_activator,
        "SessionActor",
        SimpleNamespace(options=lambda **_: SimpleNamespace(remote=lambda *_: named)),
    )
    activator, standby = activator_with_standbys(named)
    async with asyncio.timeout(5):
        await activator.request("s_1", reason=Reason.SUBMIT)  # none ready: the named path
        assert len(named.activate.calls) == 1
        await standby.filled(timeout_s=5)
        taken = list(standby._ready)
        await activator.request("s_1", reason=Reason.EVENT)
        await activator.request("s_1", reason=Reason.EVENT)
    assert len(named.activate.calls) == 3, "the running actor took them"
    assert list(standby._ready) == taken and standby.started == 1
    assert all(not h.adopt.calls for h in taken)
    named.slept.set_result(None)  # it exits: the next request needs another actor
    async with asyncio.timeout(5):
        while "s_1" in activator._adopted:
            await asyncio.sleep(0)
    await standby.close()


def left_standby(answer: Any) -> Actor:
    """A standby a holder's predecessor left, answering ``inheritable`` with ``answer``
    (a future never done: it does not answer)."""
    left = Actor()
    left.inheritable = Method(answer)
    return left


async def test_a_left_standby_that_does_not_answer_its_new_holder_is_asked_to_go(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A restarted holder left a standby that did not answer whether it may be inherited
    (too busy then, or dead) to its own idle time: with ``standby_idle_s = 0`` that never
    comes, and nothing kept it or asked it to go, a process for ever. It is asked to
    retire (it exits unless it has a session), as one on other settings is; one that has
    a session is left to run it."""
    context = SimpleNamespace(get_runtime_env_string=lambda: "{}")
    monkeypatch.setattr(standby_inheritance.ray, "get_runtime_context", lambda: context)
    silent_answer: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    free = left_standby(Standing.FREE.value)
    silent = left_standby(silent_answer)
    taken = left_standby(Standing.TAKEN.value)
    standby = StandbySet(2, spawn)
    async with asyncio.timeout(10):

        async def left() -> list[Any]:
            return [free, silent, taken]

        joined = await standby.inherit(left, Settings(), timeout_s=0.05)
        await standby.retired()  # the asks to go run behind ``inherit``
    assert joined == 1 and list(standby._ready) == [free]
    assert len(silent.retire.calls) == 1, "the silent one is asked to go"
    assert not taken.retire.calls and not free.retire.calls
    await standby.close()


async def test_a_holders_first_refill_does_not_wait_for_a_silent_left_standby_to_go(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A restarted holder asks a left standby on other settings to go, and one that does
    not answer is asked for up to ``RETIRE_ATTEMPTS`` x ``RETIRE_TIMEOUT_S``. The holder's
    first refill waited for all of it (15 s per silent standby), its activations meanwhile
    starting processes on their path. The asks now run behind the refill, owned by the
    set: ``retired`` waits for them, and so does ``close``."""
    context = SimpleNamespace(get_runtime_env_string=lambda: "{}")
    monkeypatch.setattr(standby_inheritance.ray, "get_runtime_context", lambda: context)
    monkeypatch.setattr(standby_inheritance, "RETIRE_TIMEOUT_S", 60.0)  # far past the test's
    silent = left_standby(Standing.OTHER.value)
    never: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
    silent.retire = Method(never)  # asked to go, and never answers
    spawned = asyncio.Event()

    async def spawn_one() -> Actor:
        spawned.set()
        return Actor()

    async def left_by(holder: str, namespace: str) -> list[Actor]:
        return [silent]

    monkeypatch.setattr(ray_activator, "left_by", left_by)
    activator: Any = RayActivator.__new__(RayActivator)  # no Ray: actors are fakes
    activator.namespace, activator._holder, activator._predecessor = "t", "holder", None
    activator.config = SimpleNamespace(load=Settings)
    activator.standby = standby = StandbySet(1, spawn_one)
    activator.start_standbys()
    async with asyncio.timeout(10):
        await spawned.wait()  # the first refill started a standby
    assert len(silent.retire.calls) == 1 and not never.done(), "while it was still silent"
    retired = asyncio.create_task(standby.retired())
    await asyncio.sleep(0)
    assert not retired.done(), "the asks are still under way, and retired waits for them"
    async with asyncio.timeout(10):
        await activator._predecessor
    (asking,) = standby._retiring
    closing = asyncio.create_task(standby.close())
    await eventually(
        lambda: standby._closing, timeout_s=10, interval_s=0.01, what="close has begun"
    )
    async with asyncio.timeout(10):
        if not never.done():  # cancelled along with the ask on the old code
            never.set_result(True)  # the left standby answers, and goes
        await closing
        await retired
    # Cancelled with the set, the ask left the standby running to its idle time (for
    # ever with ``standby_idle_s = 0``): close lets it finish.
    assert not asking.cancelled(), "close ended the ask to go"
    assert not standby._retiring


async def test_left_standbys_found_before_the_holder_closed_are_asked_to_go(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The holder closing (its takeover cancelled) while it asked the standbys it found
    whether they may be inherited: none is kept, and each is asked to go. Before, the
    cancel dropped them unasked, to run on to their idle time (for ever with
    ``standby_idle_s = 0``)."""
    context = SimpleNamespace(get_runtime_env_string=lambda: "{}")
    monkeypatch.setattr(standby_inheritance.ray, "get_runtime_context", lambda: context)
    silent = left_standby(asyncio.get_running_loop().create_future())  # never answers
    free = left_standby(Standing.FREE.value)
    standby = StandbySet(1, spawn)

    async def left() -> list[Any]:
        return [silent, free]

    taking_over = asyncio.create_task(standby.inherit(left, Settings(), timeout_s=60))
    await eventually(
        lambda: silent.inheritable.calls,
        timeout_s=10,
        interval_s=0.01,
        what="the silent standby was asked (it does not answer)",
    )
    taking_over.cancel()
    async with asyncio.timeout(10):
        with pytest.raises(asyncio.CancelledError):
            await taking_over
    assert len(silent.retire.calls) == 1 and len(free.retire.calls) == 1
    assert standby.inherited == 0


async def test_left_standbys_found_after_the_set_closed_are_still_asked_to_go(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A set closed while it looked for its predecessor's standbys ends no task started
    after that: the asks to go are then made in ``inherit`` itself, not left unmade."""
    context = SimpleNamespace(get_runtime_env_string=lambda: "{}")
    monkeypatch.setattr(standby_inheritance.ray, "get_runtime_context", lambda: context)
    other = left_standby(Standing.OTHER.value)
    standby = StandbySet(1, spawn)
    await standby.close()

    async def left() -> list[Any]:
        return [other]

    async with asyncio.timeout(10):
        assert await standby.inherit(left, Settings(), timeout_s=0.05) == 0
    assert len(other.retire.calls) == 1 and not standby._retiring


def settled(answer: object) -> asyncio.Future[Any]:
    """A Ray call's answer, already there: ``answer`` returned, or raised if an error."""
    done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    if isinstance(answer, BaseException):
        done.set_exception(answer)
    else:
        done.set_result(answer)
    return done


async def test_a_left_standby_that_does_not_answer_its_retire_is_asked_again() -> None:
    """A holder that keeps no standbys asks the ones its predecessor left to go. The call
    was sent and forgotten on a handle just looked up by name: under load it went
    unanswered, and a standby on ``standby_idle_s = 0`` then ran for ever. Each is now
    asked until it answers (never killed: it may run a session), and the holder's start
    ends only once every one has answered or been asked its last time."""
    lost: asyncio.Future[bool] = asyncio.get_running_loop().create_future()  # never answered
    silent_once, quick = Actor(), Actor()
    # Not answered, then unreachable for a moment (not gone), then answered.
    answers = iter([lost, ActorUnavailableError("a network blip", None), True])

    def remote(*args: object) -> asyncio.Future[Any]:
        silent_once.retire.calls.append(args)
        answer = next(answers)
        return answer if isinstance(answer, asyncio.Future) else settled(answer)

    silent_once.retire.remote = remote  # type: ignore[method-assign]
    activator: Any = RayActivator.__new__(RayActivator)
    activator.namespace, activator.settings = "t", Settings.build({})

    async def left_by(holder: str, namespace: str) -> list[Actor]:
        return [silent_once, quick]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ray_activator, "left_by", left_by)
        patch.setattr(standby_inheritance, "RETIRE_TIMEOUT_S", 0.05)
        patch.setattr(standby_inheritance, "RETIRE_PAUSE_S", 0.01)
        async with asyncio.timeout(10):
            await activator._retire_left("holder")
    assert len(silent_once.retire.calls) == 3, "asked again after no answer, and unreachable"
    assert len(quick.retire.calls) == 1


@pytest.mark.parametrize("gone_after", [None, 5])
async def test_a_left_standby_said_unavailable_is_asked_until_its_exit_grace_has_passed(
    monkeypatch: pytest.MonkeyPatch, gone_after: int | None
) -> None:
    """Ray says at once that an actor exiting while calls it runs hold it is unavailable;
    its grace then ends it (``actors.exit_deadline``). Asked ``RETIRE_ATTEMPTS`` times in
    a row, the asks were spent before that and the standby counted as silent. It is now
    asked until its grace and one more timeout have passed, with a pause between asks
    (no tight loop), and is gone once Ray says it died."""
    monkeypatch.setattr(standby_inheritance, "RETIRE_TIMEOUT_S", 0.05)
    monkeypatch.setattr(standby_inheritance, "RETIRE_PAUSE_S", 0.05)
    loop = asyncio.get_running_loop()
    exiting = Actor()

    def remote(*args: object) -> asyncio.Future[Any]:
        exiting.retire.calls.append(args)
        if gone_after is not None and len(exiting.retire.calls) > gone_after:
            return settled(ActorDiedError())
        return settled(ActorUnavailableError("exiting", None))

    exiting.retire.remote = remote  # type: ignore[method-assign]
    started = loop.time()
    answered = await standby_inheritance.ask_to_retire(exiting, grace_s=0.5)
    took = loop.time() - started
    if gone_after is None:
        assert answered is False and took >= 0.5
        assert 3 < len(exiting.retire.calls) <= 0.55 / 0.05 + 1, "asked in a tight loop"
    else:
        assert answered is True and len(exiting.retire.calls) == gone_after + 1
