"""Thread pools of this process's own, for blocking calls run off the event loop.

asyncio's default executor is ``min(32, cores + 4)`` threads wide (six on a 2-core
node) and shared with everything, sync tools included: one kind of call that blocks
(a tool stuck past its deadline, whose thread cannot be stopped) held every other kind
up. Each kind of call gets a pool here. A forked child makes pools of its own: the
parent's threads are not the child's, and a pool that counted them as its own would
start none and queue every call for ever.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


class ProcessPool:
    """``threads`` wide, started as calls need threads, one per process."""

    def __init__(self, threads: int, name: str) -> None:
        self.threads = threads
        self.name = name
        self._pools: dict[int, ThreadPoolExecutor] = {}
        self._lock = threading.Lock()
        os.register_at_fork(after_in_child=self._forked)

    def _forked(self) -> None:
        # A lock another of the parent's threads held at the fork is let go too.
        self._lock = threading.Lock()
        self._pools.clear()

    def executor(self) -> ThreadPoolExecutor:
        pid = os.getpid()
        pool = self._pools.get(pid)
        if pool is None:
            with self._lock:
                pool = self._pools.get(pid)
                if pool is None:
                    pool = ThreadPoolExecutor(self.threads, thread_name_prefix=self.name)
                    self._pools[pid] = pool
        return pool

    async def run(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """``fn(*args, **kwargs)`` in the pool, in the caller's context (its log fields
        and trace), as ``asyncio.to_thread`` would."""
        call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self.executor(), call)

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        """``fn(*args, **kwargs)`` in the pool, in the caller's context, made even if
        nobody waits for it any more: for work that must be done once asked for (a kill
        of a silent actor), where ``run``'s is dropped while it still waits for a thread
        if its caller is cancelled or gives up. A caller that awaits it through
        ``asyncio.wrap_future`` must ``shield`` that: cancelling the wrapper cancels the
        call while it is still queued."""
        call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
        try:
            return self.executor().submit(call)
        except RuntimeError as error:
            # Only the pool's refusal of new work: its own ("after shutdown") or the
            # interpreter's, once ``concurrent.futures``' exit hook has run. Any other
            # (a thread that could not start) comes after the call was queued, which
            # would then be made twice.
            if not str(error).startswith(REFUSED):
                raise
        # Nobody would make it later: it is made here, in the caller's thread, with no
        # deadline but its own (``kill`` promises to raise nothing; it raised this error
        # from an exit handler). Outside the ``except``: the call's own error is not
        # chained to the pool's refusal.
        return _made_here(call)


# ``ThreadPoolExecutor.submit``'s refusals: "cannot schedule new futures after shutdown"
# and "... after interpreter shutdown" (the same text in CPython 3.9 to 3.13, read here).
REFUSED = "cannot schedule new futures after"


def _made_here(call: Callable[[], T]) -> Future[T]:
    """``call()`` made in this thread, as a done future: its result or its error."""
    made: Future[T] = Future()
    try:
        made.set_result(call())
    except BaseException as error:  # the caller's own future reports it, as a pool's would
        made.set_exception(error)
    return made
