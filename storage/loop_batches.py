"""Calls made together in one event loop, handed over as one batch.

A store's creates (a webhook's inbox event, its replay marker, its audit block; many
webhooks' at once under load) each cost a hop to a worker thread, a transaction or a
flush. Those asked for while the loop was busy elsewhere go together: the first call
starts a task on its loop that drains the loop's queue, ``at_once`` at a time, and
answers each caller with its own result or error. A queue per event loop: a future is
only ever resolved on its own loop, and a store may outlive the loop that first used it
(tests, scripts), so the queues are held weakly by loop.
"""

from __future__ import annotations

import asyncio
import functools
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")
Work = TypeVar("Work", bound="asyncio.Future[Any]")


Run = Callable[[list[Item]], Awaitable[Sequence[Result | BaseException]]]


class LoopBatches(Generic[Item, Result]):
    def __init__(
        self, *, at_once: int, failed: Callable[[Exception], BaseException] = lambda exc: exc
    ) -> None:
        """Should a batch's work raise, every item of the batch gets ``failed(error)``."""
        self._at_once = at_once
        self._failed = failed
        self._queues: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, list[tuple[Item, asyncio.Future[Result]]]
        ] = weakref.WeakKeyDictionary()
        self._drainers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Task[None]] = (
            weakref.WeakKeyDictionary()
        )

    async def call(self, item: Item, run: Run[Item, Result]) -> Result:
        """``item`` done with the others asked for in this loop meanwhile, by ``run``: the
        work for one batch, answering each item in order. The same for every call; given
        with each rather than kept, so the batches hold no reference to their owner (a
        store's bound method would keep the store alive past its last user)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Result] = loop.create_future()
        queue = self._queues.setdefault(loop, [])
        queue.append((item, done))
        drainer = self._drainers.get(loop)
        if drainer is None or drainer.done():
            drainer = self._drainers[loop] = loop.create_task(self._drain(queue, run))
            # Not kept once done: a task holds its loop, which the weak key would not free.
            drainer.add_done_callback(functools.partial(forget_when_done, self._drainers))
        return await done

    async def _drain(
        self, queue: list[tuple[Item, asyncio.Future[Result]]], run: Run[Item, Result]
    ) -> None:
        while queue:
            batch = queue[: self._at_once]
            del queue[: self._at_once]
            outcomes: Sequence[Result | BaseException]
            try:
                outcomes = await run([item for item, _ in batch])
            except Exception as exc:  # the batch's work itself failed: every item with it
                outcomes = [self._failed(exc)] * len(batch)
            for (_, done), outcome in zip(batch, outcomes, strict=True):
                if done.done():  # its caller was cancelled meanwhile
                    continue
                if isinstance(outcome, BaseException):
                    done.set_exception(outcome)
                else:
                    done.set_result(outcome)


def forget_when_done(
    held: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Work], done: Work
) -> None:
    """A loop's finished task or future let go (unless a newer one is its loop's
    already): a future holds its loop, which the weak key would then never free. Added
    as ``done``'s callback with ``held`` bound."""
    loop = done.get_loop()
    if held.get(loop) is done:
        del held[loop]
