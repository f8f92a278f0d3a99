"""The running-slots contract, on Redis and in memory: caps across scopes, the queue in
rank order, re-entry, and a dead holder's slot coming back by itself."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import timedelta

import pytest

from storage.memory_slots import MemorySlots
from storage.redis_index.slots import RedisSlots
from tests.conftest import eventually
from torpor.ports import RunningSlots, SlotEntry, SlotUsage

LONG = timedelta(minutes=5)


@pytest.fixture(params=["memory", "redis"])
async def slots(request: pytest.FixtureRequest) -> AsyncIterator[RunningSlots]:
    if request.param == "memory":
        made: RunningSlots = MemorySlots()
    else:
        redis_url = request.getfixturevalue("redis_url")
        prefix = request.getfixturevalue("redis_prefix")
        made = RedisSlots(redis_url, prefix=prefix)
    yield made
    await made.close()


async def test_caps_queue_in_rank_order_and_hand_slots_on(slots: RunningSlots) -> None:
    await slots.register(
        members={"s3": 3, "s1": 1, "s2": 2, "s4": 4},
        scopes={"batch:b": 2, "tenant:t": 10},
        queue="batch:b",
    )
    assert await slots.enter(member="s1", ttl=LONG) is SlotEntry.ADMITTED
    assert await slots.enter(member="s2", ttl=LONG) is SlotEntry.ADMITTED
    assert await slots.enter(member="s4", ttl=LONG) is SlotEntry.WAITING
    assert await slots.enter(member="s3", ttl=LONG) is SlotEntry.WAITING
    assert await slots.enter(member="s1", ttl=LONG) is SlotEntry.ADMITTED  # re-entry
    assert await slots.usage(scope="batch:b") == SlotUsage(running=2, waiting=2)
    assert await slots.usage(scope="tenant:t", queue="batch:b") == SlotUsage(2, 2)
    # Leaving wakes the queue's heads in rank (document) order.
    assert await slots.leave(member="s1", forget=True, limit=1) == ["s3"]
    assert await slots.enter(member="s3", ttl=LONG) is SlotEntry.ADMITTED
    assert await slots.usage(scope="batch:b") == SlotUsage(running=2, waiting=1)
    assert await slots.enter(member="unknown", ttl=LONG) is SlotEntry.UNCAPPED


async def test_the_tenant_cap_holds_across_batches(slots: RunningSlots) -> None:
    for batch in ("x", "y"):
        await slots.register(
            members={f"{batch}1": 1, f"{batch}2": 2},
            scopes={f"batch:{batch}": 5, "tenant:t2": 3},
            queue=f"batch:{batch}",
        )
    entries = [await slots.enter(member=m, ttl=LONG) for m in ("x1", "y1", "x2", "y2")]
    assert entries == [SlotEntry.ADMITTED] * 3 + [SlotEntry.WAITING]


async def test_a_dead_holders_slot_expires_by_itself(slots: RunningSlots) -> None:
    await slots.register(members={"a": 1, "b": 2}, scopes={"batch:e": 1}, queue="batch:e")
    assert await slots.enter(member="a", ttl=timedelta(milliseconds=50)) is SlotEntry.ADMITTED
    assert await slots.enter(member="b", ttl=LONG) is SlotEntry.WAITING

    async def b_admitted() -> bool:
        return await slots.enter(member="b", ttl=LONG) is SlotEntry.ADMITTED

    await eventually(b_admitted, timeout_s=5, what="the expired slot is taken")


async def test_a_tenant_slot_given_back_wakes_the_other_batches_waiting_for_it(
    slots: RunningSlots,
) -> None:
    """A session waiting for its tenant's cap (its own batch's has room) waited in its
    batch's queue alone, which only its own batch's sessions wake: a slot given back by
    another batch woke that batch's queue, whose sessions took it every time, and this
    batch waited (its sessions retried now and then, the slot taken again by then) for as
    long as the others had sessions to run."""
    for batch in ("x", "y"):
        await slots.register(
            members={f"{batch}1": 1, f"{batch}2": 2},
            scopes={f"batch:{batch}": 5, "tenant:t3": 1},
            queue=f"batch:{batch}",
        )
    assert await slots.enter(member="x1", ttl=LONG) is SlotEntry.ADMITTED
    assert await slots.enter(member="x2", ttl=LONG) is SlotEntry.WAITING
    assert await slots.enter(member="y1", ttl=LONG) is SlotEntry.WAITING
    assert set(await slots.leave(member="x1", forget=True, limit=2)) == {"x2", "y1"}
    assert await slots.enter(member="y1", ttl=LONG) is SlotEntry.ADMITTED
    assert await slots.usage(scope="batch:y") == SlotUsage(running=1, waiting=0)
    # And back: y1's slot given back wakes x's session, y having none waiting.
    assert await slots.leave(member="y1", forget=True, limit=2) == ["x2"]
    assert await slots.enter(member="x2", ttl=LONG) is SlotEntry.ADMITTED
    assert await slots.leave(member="x2", forget=True, limit=2) == []
