"""What one Redis round trip of the index costs an event loop, alone and beside work.

    .venv/bin/python bench/bench_round_trips.py [--n 3000] [--work-ms 0.4]

Three figures, medians over ``--n`` rounds on the machine's Redis, through the index's own
connection (``storage.redis_index.pipelining``, the lean wire):

- a lone PING;
- a snapshot-sized read of the local folder store followed by ``--work-ms`` of CPU on the
  loop (what an activation's snapshot load does), alone;
- both at once, as an activation takes its lease while its snapshot loads: the read
  started first (a task), the round trip asked for second. Written from the caller's
  frame the request is on the wire before the read runs; sent by a task of its own it
  left once the read was done. On this VM most of a round trip is the client's own CPU
  (syscalls, wake-ups, parsing), so the two add up either way: what the caller's-frame
  write saves is the task's turn, in every lone round trip.

And the loop's CPU per lone round trip (``time.process_time``, this process only, so the
server's share is left out), three ways: through the index (the queue, the caller's-frame
write and the sender task that follows each batch to its end); the lean wire alone on a
connection of its own (one write, the reply parsed into its future: no queue, no task);
and redis-py's own call. The first minus the second is the most a queue without a task
per lone round trip could save.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from storage.local_store import LocalObjectStore  # noqa: E402
from storage.redis_index import RedisIndex  # noqa: E402
from storage.redis_index.wire import WireConnection, settings_of  # noqa: E402

REDIS = os.environ.get("TORPOR_BENCH_REDIS", "redis://127.0.0.1:6379/0")


async def run(n: int, work_s: float) -> None:
    index = RedisIndex(REDIS, prefix=f"tpbench-rt:{os.getpid()}:")
    with tempfile.TemporaryDirectory() as tmp:
        store = LocalObjectStore(tmp)
        await store.put("snapshot", os.urandom(6000))

        async def load() -> None:
            await store.get("snapshot")
            end = time.perf_counter() + work_s
            while time.perf_counter() < end:  # the decode's CPU, on the loop
                pass

        for _ in range(300):  # connected and warm
            await index.batched("PING")
        alone, loading, both = [], [], []
        for _ in range(n):
            started = time.perf_counter()
            await index.batched("PING")
            alone.append(time.perf_counter() - started)
            started = time.perf_counter()
            await load()
            loading.append(time.perf_counter() - started)
            started = time.perf_counter()
            loaded = asyncio.ensure_future(load())
            await index.batched("PING")
            await loaded
            both.append(time.perf_counter() - started)
        await store.close()
        cpu = await cpu_per_round_trip(index, n)
    await index.close()
    ms = [statistics.median(xs) * 1000 for xs in (alone, loading, both)]
    print(
        f"round trip alone p50 {ms[0]:.3f} ms; load alone {ms[1]:.3f} ms; "
        f"load ‖ round trip {ms[2]:.3f} ms (the sum would be {ms[0] + ms[1]:.3f}; n={n})"
    )
    via, wire, client = (statistics.median(xs) * 1e6 / ROUND for xs in cpu)
    print(
        f"CPU per lone round trip, median of {len(cpu[0])} rounds of {ROUND}: through the "
        f"index {via:.1f} us; lean wire alone {wire:.1f} us; redis-py {client:.1f} us "
        f"(queue and sender task: {via - wire:.1f} us, {(via - wire) / via:.0%})"
    )


ROUND = 100  # calls per CPU reading: process_time ticks are coarse for one call


async def cpu_per_round_trip(index: RedisIndex, n: int) -> list[list[float]]:
    """CPU seconds per ROUND lone PINGs, the three ways alternated round by round (a noisy
    machine drifts: alternating keeps the three in the same spells)."""
    settings = settings_of(index.client)
    assert settings is not None, "the lean wire needs a plain TCP Redis"
    wire = WireConnection(settings)
    await wire.execute([("PING",)])  # connected
    via: list[float] = []
    alone: list[float] = []
    client: list[float] = []
    ways = (
        (via, lambda: index.batched("PING")),
        (alone, lambda: wire.execute([("PING",)])),
        (client, lambda: index.client.execute_command("PING")),
    )
    for _ in range(max(3, n // ROUND)):
        for into, call in ways:
            started = time.process_time()
            for _ in range(ROUND):
                await call()
            into.append(time.process_time() - started)
    wire.close()
    return [via, alone, client]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=3000)
    parser.add_argument("--work-ms", type=float, default=0.4, help="CPU after the read")
    args = parser.parse_args()
    asyncio.run(run(args.n, args.work_ms / 1000))


if __name__ == "__main__":
    main()
