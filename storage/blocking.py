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

from collections.abc import Callable
from typing import ParamSpec, TypeVar

from torpor.threads import ProcessPool

P = ParamSpec("P")
T = TypeVar("T")

THREADS = 32  # as many as the S3 client's pooled connections (``max_pool_connections``)
IO = ProcessPool(THREADS, "torpor-io")  # per process: a forked child starts its own


async def off_loop(fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
    """``fn(*args, **kwargs)`` in the pool, in the caller's context (its log fields and
    trace), as ``asyncio.to_thread`` would."""
    return await IO.run(fn, *args, **kwargs)
