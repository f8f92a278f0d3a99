"""Every call out has a deadline, and a plain ``def`` never blocks the event loop.

``call_out`` runs a tool hook or an agent step: a coroutine function is awaited, a plain
function runs in a worker thread (so the lease heartbeat keeps beating while it blocks).
Either is bounded by ``timeout_s``; a call that overruns raises ``CallTimedOut``.

A timed-out coroutine is cancelled. A thread cannot be: it keeps running, so a call made
under an idempotency key that is still running in this process is joined, not started a
second time. Across processes the same holds by construction: a dedicated session actor
takes its threads with it when it exits, and a pooled session always lands on the host
``hash(session_id)`` selects, where this registry sees the first call.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from torpor.errors import CallTimedOut

T = TypeVar("T")

# Thread-run calls still in flight, by idempotency key (one event loop per process here).
_running: dict[str, asyncio.Future[Any]] = {}


def running(key: str) -> bool:
    """Whether a thread-run call under ``key`` is still in flight in this process."""
    return key in _running


async def bounded(call: Awaitable[T], *, timeout_s: float | None, what: str) -> T:
    """Await ``call`` for at most ``timeout_s`` seconds (None: no limit)."""
    if timeout_s is None:
        return await call
    try:
        # In this task, not a task of its own (``asyncio.wait_for`` makes one): the call
        # starts at once, which is what lets an agent step called ahead begin before the
        # wake's commit (``torpor.session.wake``), and costs a turn of the loop less.
        async with asyncio.timeout(timeout_s):
            return await call
    except TimeoutError:
        raise CallTimedOut(
            f"{what} did not finish within {timeout_s:g} s", what=what, timeout_s=timeout_s
        ) from None


async def call_out(
    fn: Callable[..., Any],
    *args: Any,
    timeout_s: float | None,
    what: str,
    key: str | None = None,
    **kwargs: Any,
) -> Any:
    """Call ``fn`` with a deadline: awaited if async, in a worker thread if a plain def."""
    if _is_async(fn):
        return await bounded(fn(*args, **kwargs), timeout_s=timeout_s, what=what)
    future = _running.get(key) if key is not None else None
    if future is None:
        future = asyncio.ensure_future(asyncio.to_thread(functools.partial(fn, *args, **kwargs)))
        if key is not None:
            _running[key] = future
            future.add_done_callback(lambda _: _running.pop(key, None))
    # shield: the deadline abandons the wait, not the thread, which cannot be stopped.
    out = await bounded(asyncio.shield(future), timeout_s=timeout_s, what=what)
    if inspect.isawaitable(out):  # a plain def that hands back a coroutine
        out = await bounded(out, timeout_s=timeout_s, what=what)
    return out


def _is_async(fn: Callable[..., Any]) -> bool:
    target = fn.func if isinstance(fn, functools.partial) else fn
    return inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(
        getattr(target, "__call__", None)  # noqa: B004 - an async callable object
    )
