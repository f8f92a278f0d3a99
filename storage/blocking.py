"""Run blocking storage calls (boto3's, each a request over the network) off the loop.

One slow S3 write must not stall every webhook a replica is serving, so adapters never
call a blocking client on the loop thread. They run in a pool of this process's own,
``THREADS`` wide, not asyncio's default one, which is ``min(32, cores + 4)`` wide: six
threads on a 2-core node, so at most six requests to S3 were ever in flight per process
(the client's 32 pooled connections unused past that), every other call queued behind
them whatever it waited for. A repair of 100 sleeping sessions against the S3 test
server 20 ms away took 4.1-4.2 s with them and 2.5-2.8 s with these
(``bench/bench_scale.py --s3 --s3-rtt-ms 20``; that server does one write at a time).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

THREADS = 32  # as many as the S3 client's pooled connections (``max_pool_connections``)
_POOLS: dict[int, ThreadPoolExecutor] = {}  # per process: a forked child starts its own
_LOCK = threading.Lock()


def _forked() -> None:
    """In a forked child: the parent's pool (its threads are not the child's) and a lock
    another of its threads may have held at the fork are let go."""
    global _LOCK
    _LOCK = threading.Lock()
    _POOLS.clear()


os.register_at_fork(after_in_child=_forked)


def _pool() -> ThreadPoolExecutor:
    pid = os.getpid()
    pool = _POOLS.get(pid)
    if pool is None:
        with _LOCK:
            pool = _POOLS.get(pid)
            if pool is None:  # threads are started as calls need them
                pool = _POOLS[pid] = ThreadPoolExecutor(THREADS, thread_name_prefix="torpor-io")
    return pool


async def off_loop(fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
    """``fn(*args, **kwargs)`` in the pool, in the caller's context (its log fields and
    trace), as ``asyncio.to_thread`` would."""
    call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(_pool(), call)
