"""Waiting for a request's few concurrent writes, each outcome kept.

``asyncio.gather(*aws, return_exceptions=True)`` makes a future of its own, a task per
coroutine and a callback per child, and answers a turn of the loop after the last child.
A webhook awaits two such groups of one or two writes, most of them already running as
tasks: :func:`settled` awaits them in the caller's task instead (one coroutine run there,
any other started as a task), for the same answer (about 3 % of a webhook's
instructions, ``bench/profile_gateway.py --instructions``). :func:`gathered` is
``gather`` itself, but for one awaitable or none: a session's resume reads its inbox and
writes its sealed chunks so, most often with one or none to wait for.

Neither is for awaitables whose first steps must come in their order (two index calls
meant to share one round trip): the one run in the caller's task starts first. That one
also shares the caller's context (a ``logs.update`` in it reaches the caller), where a
task has a copy of its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any


async def settled(*aws: Awaitable[Any]) -> list[Any]:
    """Each awaitable's result, or the exception it raised, in order, all run at once.

    As ``gather`` with ``return_exceptions=True``: a child cancelled on its own gives its
    ``CancelledError``; the caller cancelled cancels every child, waits for them all to
    finish and raises ``CancelledError``, even where a child absorbed the cancel. Unlike
    ``gather``'s, the one run in the caller's task shares the caller's context.
    """
    task = asyncio.current_task()
    # Cancels asked of the caller before this: only one asked since is the caller's now.
    before = task.cancelling() if task is not None else 0
    running = [asyncio.ensure_future(aw) for aw in aws[:-1]]
    last = aws[-1] if aws else None
    outcomes: list[Any] = []
    try:
        if last is not None:  # the last one in this task: no task, no turn of the loop
            outcome = await _outcome(last, task, before)
        for child in running:
            outcomes.append(await _outcome(child, task, before))
    except BaseException as exc:
        for child in running:
            child.cancel()
        if isinstance(exc, asyncio.CancelledError):
            # The caller cancelled: every child has ended before this raises, so none
            # outlives the request that started it. Interrupted or closed, the children
            # are not waited for (an interrupt is not held behind their clean-up).
            await asyncio.gather(*running, return_exceptions=True)
        raise
    if last is not None:
        outcomes.append(outcome)
    return outcomes


async def _outcome(aw: Awaitable[Any], task: asyncio.Task[Any] | None, before: int) -> Any:
    """What ``aw`` returned or raised; ``CancelledError`` raised if the caller was asked
    to cancel meanwhile, whatever the child made of it."""
    outcome: Any
    try:
        outcome = await aw
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as exc:  # a value, as gather's, a child's own cancel included
        if isinstance(exc, asyncio.CancelledError):
            if asyncio.isfuture(aw):
                if not aw.done():
                    raise  # the cancel came to the caller while it waited (``aw`` runs on)
            elif task is not None and task.cancelling():
                # Run in the caller's task, its cancel and the child's own look alike; a
                # cancel asked before the call, still to be delivered, is among them.
                # Taken for the caller's: a cancel raised too often beats one lost.
                raise
        outcome = exc
    if task is not None and task.cancelling() > before:
        raise asyncio.CancelledError
    return outcome


async def gathered(*aws: Awaitable[Any]) -> list[Any]:
    """``asyncio.gather(*aws)``: each result in order, the first error raised; a lone
    awaitable awaited in the caller's task, and none answered at once."""
    if not aws:
        return []
    if len(aws) == 1:
        return [await aws[0]]
    return await asyncio.gather(*aws)
