"""The local folder store's durable writes: latency one at a time, a burst of creates, and
how many flushes (fsync, fdatasync) each costs.

    .venv/bin/python bench/bench_local_store.py [--n 300] [--gap-ms 5] [--folder /tmp]

One process, no Ray: ``put_if_absent`` of an inbox-sized object (700 B) one at a time
with an idle gap between (as webhooks come one at a time), ten at once (a burst), and a
compare-and-swap of a snapshot-sized object (4 KB); then rounds of a webhook's three
creates beside a resume's three snapshot commits, back to back (``--churn``; run
``sync`` and wait 6 s first: the kernel's search for a free inode skips every inode
freed in the last 5 s, or 300 s while its block is not yet written back, so an earlier
run's cleanup slows the next). Flushes are counted by wrapping
``os.fsync`` and ``os.fdatasync`` for the run, so the same script measures an older
checkout too (``PYTHONPATH=<checkout>``): the figures to compare come from one run of
each, back to back.

``--restart N`` then measures what a process that exits leaves the next one: a child
process runs ``--churn``'s rounds for a while (its replaced files kept to be recycled),
closes its store and exits; ``--restart-pause`` seconds later (11: past the quarantine
of its kept files) a new store in this process creates objects one at a time (a
webhook's inbox event in a new folder each): p50 and CPU per create, and the inodes the
file system allocated for them (its free count before and after: run it on a quiet
machine).
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


async def churn(store: LocalObjectStore, rounds: int) -> tuple[float, float, float]:
    """A webhook's creates and a resume's commits, back to back: three creates (an inbox
    event, an audit block, a replay marker) and three compare-and-swaps of snapshots per
    round. Each compare-and-swap replaces a file: (p50 ms per round, CPU ms per round,
    of which in the kernel), the process's worker threads included."""
    snapshot = os.urandom(4096)
    etags = {s: await store.put(f"sessions/s{s}", snapshot) for s in range(64)}
    times: list[float] = []
    cpu0 = os.times()
    for i in range(rounds):
        started = time.perf_counter()
        session = secrets.token_hex(8)
        await store.put_if_absent(f"inbox/{session}/e", b"e" * 700)
        await store.put_if_absent(f"audit/{session}", b"a" * 400)
        await store.put_if_absent(f"replay/{session}", b"r" * 60, durable=False)
        for k in range(3):
            s = (3 * i + k) % 64
            etags[s] = await store.put_if_match(f"sessions/s{s}", snapshot, etag=etags[s])
        times.append(time.perf_counter() - started)
    cpu1 = os.times()
    user, kernel = cpu1.user - cpu0.user, cpu1.system - cpu0.system
    return (
        statistics.median(times) * 1000,
        (user + kernel) / rounds * 1000,
        kernel / rounds * 1000,
    )


async def after_restart(
    folder: str, rounds: int, creates: int, pause_s: float
) -> tuple[float, float, float]:
    """A child churns ``rounds`` rounds on ``folder`` and exits; ``pause_s`` later,
    ``creates`` creates here: (p50 ms, CPU ms per create, inodes allocated per create)."""
    child = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--child-churn", str(rounds), "--folder", folder
    )
    assert await child.wait() == 0
    # What a restart takes at least (a Ray worker's start is seconds here), and the
    # quarantine a kept file waits out before anyone writes it again (``storage.blanks``).
    await asyncio.sleep(pause_s)
    store = LocalObjectStore(folder)
    times: list[float] = []
    free0, cpu0 = os.statvfs(folder).f_ffree, os.times()
    for _ in range(creates):
        started = time.perf_counter()
        await store.put_if_absent(f"inbox/{secrets.token_hex(8)}/e", b"e" * 700)
        times.append(time.perf_counter() - started)
    cpu1, made = os.times(), os.statvfs(folder).f_ffree - free0
    await store.close()
    cpu = (cpu1.user - cpu0.user + cpu1.system - cpu0.system) / creates * 1000
    return statistics.median(times) * 1000, cpu, -made / creates


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=300)
    parser.add_argument("--gap-ms", type=float, default=5.0)
    parser.add_argument("--folder", default=tempfile.gettempdir())
    parser.add_argument(
        "--churn", type=int, default=3000, help="rounds of 3 creates + 3 compare-and-swaps"
    )
    parser.add_argument(
        "--restart", type=int, default=0, help="creates after a churning process exited"
    )
    parser.add_argument(
        "--restart-pause", type=float, default=11.0, help="seconds between exit and creates"
    )
    parser.add_argument("--child-churn", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_churn:  # the process that exits (``--restart``)
        asyncio.run(churn(LocalObjectStore(args.folder), args.child_churn))
        return
    os.fsync = counted(os.fsync)
    os.fdatasync = counted(os.fdatasync)
    with tempfile.TemporaryDirectory(dir=args.folder) as tmp:
        store = LocalObjectStore(tmp)
        figures = asyncio.run(measure(store, args.n, args.gap_ms / 1000))
        churned = asyncio.run(churn(store, args.churn)) if args.churn else None
        restarted = None
        if args.restart:
            asyncio.run(store.close())
            fresh = f"{tmp}/restart"
            rounds = max(args.churn, 1000)
            restarted = asyncio.run(after_restart(fresh, rounds, args.restart, args.restart_pause))
    where = args.folder  # a folder made and removed under it: its disk is what is measured
    print(f"local folder store under {where} (n={args.n}, {args.gap_ms} ms between operations)")
    for name, (ms, flushes) in figures.items():
        print(f"  {name}: p50 {ms:.3f} ms, {flushes:.1f} flushes each")
    if churned is not None:
        p50, cpu, kernel = churned
        print(
            f"  3 creates + 3 compare-and-swaps back to back ({args.churn} rounds): p50 {p50:.2f}"
            f" ms a round, {cpu:.2f} ms CPU ({kernel:.2f} in the kernel)"
        )
    if restarted is not None:
        p50, cpu, made = restarted
        print(
            f"  after a churning process exited: {args.restart} creates, p50 {p50:.3f} ms,"
            f" {cpu:.3f} ms CPU, {made:.2f} inodes allocated each"
        )


if __name__ == "__main__":
    main()
