"""Run blocking storage calls (boto3, SQLite, file I/O) off the event loop.

One slow S3 write must not stall every webhook a replica is serving, so adapters never
call a blocking client on the loop thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


async def off_loop(fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
    return await asyncio.to_thread(fn, *args, **kwargs)
