"""The local folder store's durable writes: latency one at a time, a burst of creates, and
how many flushes (fsync, fdatasync) each costs.

    .venv/bin/python bench/bench_local_store.py [--n 300] [--gap-ms 5] [--folder /tmp]

One process, no Ray: ``put_if_absent`` of an inbox-sized object (700 B) one at a time
with an idle gap between (as webhooks come one at a time), ten at once (a burst), and a
compare-and-swap of a snapshot-sized object (4 KB). Flushes are counted by wrapping
``os.fsync`` and ``os.fdatasync`` for the run, so the same script measures an older
checkout too (``PYTHONPATH=<checkout>``): the figures to compare come from one run of
each, back to back.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

ROOT = Path(os.environ.get("PYTHONPATH", "").split(os.pathsep)[0] or Path(__file__).parents[1])
sys.path.insert(0, str(ROOT))

from storage.local_store import LocalObjectStore  # noqa: E402

FLUSHES = [0]


def counted(flush: Callable[[int], None]) -> Callable[[int], None]:
    def wrapper(fd: int) -> None:
        FLUSHES[0] += 1
        flush(fd)

    return wrapper


async def measure(store: LocalObjectStore, n: int, gap_s: float) -> dict[str, tuple[float, float]]:
    """(median ms, flushes per operation) for each kind of write."""
    out: dict[str, tuple[float, float]] = {}

    async def timed(name: str, rounds: int, op: Callable[[int], Awaitable[object]]) -> None:
        times: list[float] = []
        before = FLUSHES[0]
        for i in range(rounds):
            await asyncio.sleep(gap_s)
            started = time.perf_counter()
            await op(i)
            times.append(time.perf_counter() - started)
        out[name] = (statistics.median(times) * 1000, (FLUSHES[0] - before) / rounds)

    event = b"e" * 700
    await timed(  # a new session folder each time, as every webhook in the bench
        "create one at a time",
        n,
        lambda i: store.put_if_absent(f"inbox/{secrets.token_hex(8)}/e{i}", event),
    )
    await timed(
        "ten creates at once",
        n // 10,
        lambda i: asyncio.gather(
            *(store.put_if_absent(f"burst/{i}/{j}", event) for j in range(10))
        ),
    )
    snapshot = os.urandom(4096)
    etags: dict[int, str] = {}

    async def cas(i: int) -> None:
        key = f"sessions/s{i % 20}"
        if i % 20 not in etags:
            etags[i % 20] = await store.put(key, snapshot)
        etags[i % 20] = await store.put_if_match(key, snapshot[::-1], etag=etags[i % 20])

    await timed("compare-and-swap", n, cas)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=300)
    parser.add_argument("--gap-ms", type=float, default=5.0)
    parser.add_argument("--folder", default=tempfile.gettempdir())
    args = parser.parse_args()
    os.fsync = counted(os.fsync)
    os.fdatasync = counted(os.fdatasync)
    with tempfile.TemporaryDirectory(dir=args.folder) as tmp:
        store = LocalObjectStore(tmp)
        figures = asyncio.run(measure(store, args.n, args.gap_ms / 1000))
    print(f"local folder store at {ROOT} (n={args.n}, {args.gap_ms} ms between operations)")
    for name, (ms, flushes) in figures.items():
        print(f"  {name}: p50 {ms:.3f} ms, {flushes:.1f} flushes each")


if __name__ == "__main__":
    main()
