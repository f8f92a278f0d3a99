"""The cap on live dedicated session actors: admission, and a deferred request that waits
durably as a RETRY timer instead of being dropped (pure code, no Ray started)."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from actors.ray_activator import Admission, RayActivator
from storage.memory_index import MemoryIndex
from torpor.clock import ManualClock
from torpor.ports import Reason, TimerKind
from torpor.settings import Placement


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


async def test_admits_up_to_the_cap_then_refuses_until_an_actor_is_gone() -> None:
    alive = {"a", "b"}
    clock = Clock()

    async def live() -> set[str]:
        return set(alive)

    admission = Admission(2, alive=live, refresh_s=1.0, clock=clock)
    assert await admission.admit("a") and await admission.admit("b")
    assert await admission.admit("a"), "a live actor takes more requests"
    assert not await admission.admit("c")
    alive.discard("a")  # its session went to sleep and the actor exited
    assert not await admission.admit("c"), "Ray is asked at most once per refresh_s"
    clock.t = 1.0
    assert await admission.admit("c") and admission.live == 2


async def test_one_check_against_ray_at_a_time_however_slow_it_answers() -> None:
    """A GCS slower than ``refresh_s``: each request at the cap after that started one
    more listing, each holding one of the few lookup threads (``actors.named``) for as
    long as Ray took, which the hosts' and actors' makes then waited behind. Requests
    meanwhile are deferred, as before, and ask nothing."""
    clock, calls = Clock(), 0
    answer: asyncio.Future[set[str]] = asyncio.get_running_loop().create_future()

    async def slow_live() -> set[str]:
        nonlocal calls
        calls += 1
        return await answer

    admission = Admission(1, alive=slow_live, refresh_s=1.0, clock=clock)
    assert await admission.admit("a")
    first = asyncio.create_task(admission.admit("b"))  # at the cap: Ray is asked
    async with asyncio.timeout(5):  # a request held by the check fails here, not hangs
        while calls == 0:
            await asyncio.sleep(0.01)
        for later in range(3):
            clock.t += 2.0  # past refresh_s, the first check still unanswered
            assert not await admission.admit(f"c{later}"), "deferred while Ray is asked"
    assert calls == 1
    answer.set_result(set())  # "a" exited meanwhile
    assert await first and admission.live == 1


async def test_a_request_past_the_cap_leaves_a_retry_timer() -> None:
    index, clock = MemoryIndex(), ManualClock()
    activator: Any = RayActivator.__new__(RayActivator)  # no Ray: only the admission path
    activator.services = type(
        "S",
        (),
        {
            "index": index,
            "clock": clock,
            "config": type("C", (), {"retry_delay": timedelta(seconds=5)})(),
        },
    )()

    async def none_alive() -> set[str]:
        return set()

    activator.admission = Admission(0, alive=none_alive)
    activator._placements = {"s_1": Placement.DEDICATED}

    async def never(*_: object) -> None:
        raise AssertionError("no actor may be started past the cap")

    activator._dedicated = never
    await activator.request("s_1", reason=Reason.EVENT)
    later = clock.now() + timedelta(seconds=7)
    assert await index.due(kind=TimerKind.RETRY, now=later, limit=10) == ["s_1"]
    assert await index.due(kind=TimerKind.RETRY, now=clock.now(), limit=10) == []
