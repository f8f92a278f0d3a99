"""``settled``: what ``asyncio.gather(..., return_exceptions=True)`` answers, in the
caller's task."""

from __future__ import annotations

import asyncio

import pytest

from torpor.awaiting import gathered, settled


async def value(v: object, gate: asyncio.Event | None = None) -> object:
    if gate is not None:
        await gate.wait()
    return v


async def failing(exc: BaseException) -> object:
    await asyncio.sleep(0)  # one turn of the loop first: it fails once started, as a write would
    raise exc


async def test_each_outcome_comes_back_in_order_errors_as_values() -> None:
    error = ValueError("no")
    running = asyncio.ensure_future(value("task"))
    outcomes = await settled(running, failing(error), value(3))
    assert outcomes == ["task", error, 3]
    assert await settled() == []


async def test_the_last_coroutine_runs_in_the_callers_task_and_the_others_at_once() -> None:
    seen: list[asyncio.Task[object] | None] = []
    gate = asyncio.Event()

    async def opens() -> str:
        seen.append(asyncio.current_task())
        gate.set()  # the first one waits on this: both run at once, or this never comes
        return "opened"

    async def caller() -> list[object]:
        seen.append(asyncio.current_task())
        return await settled(value("waited", gate), opens())

    assert await asyncio.wait_for(caller(), timeout=10) == ["waited", "opened"]
    assert seen[0] is seen[1]


async def test_a_child_cancelled_on_its_own_is_its_cancelled_error() -> None:
    never = asyncio.Event()
    alone = asyncio.ensure_future(value("x", never))
    asyncio.get_running_loop().call_soon(alone.cancel)
    outcomes = await settled(alone, value(2))
    assert isinstance(outcomes[0], asyncio.CancelledError)
    assert outcomes[1] == 2


async def test_the_caller_cancelled_cancels_every_child_and_raises() -> None:
    never = asyncio.Event()
    started = asyncio.Event()
    child = asyncio.ensure_future(value("x", never))

    async def last() -> object:
        started.set()
        await never.wait()
        return None

    waiting = asyncio.ensure_future(settled(child, last()))
    await started.wait()
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert child.cancelled()


async def test_gathered_answers_none_at_once_and_one_in_the_callers_task() -> None:
    assert await gathered() == []
    seen: list[asyncio.Task[object] | None] = []

    async def where() -> str:
        seen.append(asyncio.current_task())
        return "here"

    async def caller() -> list[object]:
        seen.append(asyncio.current_task())
        return await gathered(where())

    assert await asyncio.wait_for(caller(), timeout=10) == ["here"]
    assert seen[0] is seen[1]


async def test_gathered_raises_the_error_and_gathers_several_as_gather_does() -> None:
    with pytest.raises(ValueError, match="alone"):
        await gathered(failing(ValueError("alone")))
    assert await gathered(value(1), value(2), value(3)) == [1, 2, 3]
    with pytest.raises(KeyError):
        await gathered(value(1), failing(KeyError("k")))


async def test_the_callers_cancel_is_raised_though_a_child_absorbed_it() -> None:
    """As gather's: a child that catches the cancel and returns does not swallow the
    caller's cancel."""
    started = asyncio.Event()

    async def absorbing() -> str:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            return "absorbed"
        return "never"

    waiting = asyncio.ensure_future(settled(absorbing(), value(2)))
    await started.wait()
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting


async def test_every_child_has_ended_when_the_callers_cancel_is_raised() -> None:
    """No child outlives the caller: each is cancelled and waited for (its clean-up
    runs to its end) before the cancel reaches the caller."""
    started, cleaning, cleaned = asyncio.Event(), asyncio.Event(), asyncio.Event()
    release = asyncio.Event()

    async def slow_to_end() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        finally:
            cleaning.set()
            await release.wait()  # its clean-up takes a while
            cleaned.set()

    child = asyncio.ensure_future(slow_to_end())
    waiting = asyncio.ensure_future(settled(child, asyncio.Event().wait()))
    await started.wait()
    waiting.cancel()
    await cleaning.wait()  # the child was cancelled: its clean-up is under way
    assert not waiting.done()  # still waiting for the child's clean-up
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert child.done() and cleaned.is_set()


async def test_a_cancel_asked_of_the_caller_before_is_not_taken_for_a_childs() -> None:
    """A caller that caught an earlier cancel (without ``uncancel``) still gets a child's
    own cancel as that child's outcome."""
    task = asyncio.current_task()
    assert task is not None
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.Event().wait()  # the cancel lands here
    never = asyncio.Event()
    alone = asyncio.ensure_future(value("x", never))
    asyncio.get_running_loop().call_soon(alone.cancel)
    outcomes = await settled(alone, value(2))
    task.uncancel()
    assert isinstance(outcomes[0], asyncio.CancelledError) and outcomes[1] == 2


class Unusual(BaseException):
    """A BaseException that is neither an interrupt nor a cancel."""


async def test_a_child_raising_another_base_exception_is_its_outcome() -> None:
    unusual = Unusual()
    running = asyncio.ensure_future(failing(unusual))
    assert await settled(running, value(2)) == [unusual, 2]


async def test_an_interrupt_in_the_callers_task_is_raised_without_waiting_for_the_children() -> (
    None
):
    """Ctrl-C is not held back behind the children's clean-up (gather's would not be):
    they are cancelled and left to end."""
    never, waiting, held = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def slow_to_end() -> None:
        try:
            waiting.set()
            await never.wait()
        finally:
            await held.wait()  # a clean-up that waits

    child = asyncio.ensure_future(slow_to_end())
    await waiting.wait()
    with pytest.raises(KeyboardInterrupt):
        await settled(child, failing(KeyboardInterrupt()))
    assert child.cancelling() and not child.done()
    held.set()
    with pytest.raises(asyncio.CancelledError):
        await child


async def test_a_cancel_asked_just_before_the_call_is_the_callers() -> None:
    """The caller cancelled in the step that calls: the cancel lands in the child run in
    its task, and is raised as the caller's, not kept as that child's outcome."""
    child = asyncio.ensure_future(value("x"))

    async def caller() -> list[object]:
        task = asyncio.current_task()
        assert task is not None
        task.cancel()  # delivered at the first wait inside
        return await settled(child, value("y", asyncio.Event()))

    with pytest.raises(asyncio.CancelledError):
        await asyncio.ensure_future(caller())
