"""Calls made together in one event loop go as one batch, each answered on its own."""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref

import pytest

from storage.loop_batches import LoopBatches


class Work:
    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    async def run(self, items: list[int]) -> list[int | BaseException]:
        self.batches.append(items)
        await asyncio.sleep(0)
        return [ValueError(f"odd {i}") if i % 2 else i * 10 for i in items]


async def test_calls_made_together_go_as_one_batch_each_answered_on_its_own() -> None:
    work, batches = Work(), LoopBatches[int, int](at_once=3)
    calls = [asyncio.ensure_future(batches.call(i, work.run)) for i in range(7)]
    outcomes = await asyncio.gather(*calls, return_exceptions=True)
    assert work.batches == [[0, 1, 2], [3, 4, 5], [6]]  # at most ``at_once`` a batch
    assert outcomes[0::2] == [0, 20, 40, 60]
    assert [str(e) for e in outcomes[1::2]] == ["odd 1", "odd 3", "odd 5"]
    assert await batches.call(8, work.run) == 80  # a call alone later: a batch of its own
    assert work.batches[-1] == [8]


async def test_work_that_fails_fails_every_call_of_its_batch_and_no_later_one() -> None:
    seen: list[list[int]] = []

    async def broken(items: list[int]) -> list[int | BaseException]:
        seen.append(items)
        if len(seen) == 1:
            raise OSError("disk gone")
        return list(items)

    batches = LoopBatches[int, int](at_once=8, failed=lambda exc: RuntimeError(f"said: {exc}"))
    first = await asyncio.gather(
        *(batches.call(i, broken) for i in range(3)), return_exceptions=True
    )
    assert [str(e) for e in first] == ["said: disk gone"] * 3
    assert await batches.call(5, broken) == 5


async def test_a_caller_cancelled_while_it_waits_leaves_the_others_answered() -> None:
    gate = asyncio.Event()

    async def slow(items: list[int]) -> list[int | BaseException]:
        await gate.wait()
        return list(items)

    batches = LoopBatches[int, int](at_once=8)
    calls = [asyncio.ensure_future(batches.call(i, slow)) for i in range(3)]
    await asyncio.sleep(0)
    calls[1].cancel()
    gate.set()
    assert await calls[0] == 0 and await calls[2] == 2
    with pytest.raises(asyncio.CancelledError):
        await calls[1]


def test_each_event_loop_has_its_own_queue() -> None:
    """A future is only ever answered on its own loop: two loops in two threads."""
    work, batches = Work(), LoopBatches[int, int](at_once=8)
    results: dict[str, list[int]] = {}

    def in_a_loop(name: str, items: range) -> None:
        async def go() -> list[int]:
            return list(await asyncio.gather(*(batches.call(i, work.run) for i in items)))

        results[name] = asyncio.run(go())

    threads = [
        threading.Thread(target=in_a_loop, args=("a", range(0, 6, 2))),
        threading.Thread(target=in_a_loop, args=("b", range(10, 16, 2))),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert results == {"a": [0, 20, 40], "b": [100, 120, 140]}
    assert all(set(b) <= {0, 2, 4} or set(b) <= {10, 12, 14} for b in work.batches)


def test_a_loop_that_is_gone_is_not_held() -> None:
    """The queues are held weakly by loop; the finished drainer held its loop (a task
    holds its loop), so every loop that ever made a call was kept while the batches
    lived (a store outlives many loops: tests, scripts)."""
    work, batches = Work(), LoopBatches[int, int](at_once=8)
    loops: list[weakref.ref[asyncio.AbstractEventLoop]] = []

    async def go() -> int:
        loops.append(weakref.ref(asyncio.get_running_loop()))
        return await batches.call(2, work.run)

    assert [asyncio.run(go()) for _ in range(3)] == [20, 20, 20]
    gc.collect()
    assert [ref() for ref in loops] == [None, None, None]
