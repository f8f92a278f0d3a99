"""Foundation benchmarks: snapshot size, decode time, save+load round trip, Redis bytes per
bound wait.

    .venv/bin/python bench/bench_storage.py [--rounds 200] [--waits 10000]

Figures are medians over one run (this machine is shared and noisy: compare within a run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from storage.codec import SnapshotCodec  # noqa: E402
from storage.local_store import LocalObjectStore  # noqa: E402
from storage.redis_index import RedisIndex  # noqa: E402
from storage.s3_store import S3ObjectStore  # noqa: E402
from storage.snapshots import ObjectSnapshots  # noqa: E402
from tests.support.factories import busy_snapshot  # noqa: E402
from tests.support.s3_server import S3TestServer  # noqa: E402
from torpor.ids import new_correlation_id, new_session_id  # noqa: E402
from torpor.models import SessionSnapshot  # noqa: E402
from torpor.ports import ObjectStore, WaitBinding  # noqa: E402

# The 0.1 storage targets (docs/performance-history.md, "Up to 0.3"); a million waits'
# own target, 250 B, is bench_scale.py's.
ENCODED_TARGET_PCT = 25
WAIT_TARGET_B = 300


def size_figures() -> tuple[int, int, int]:
    snap = busy_snapshot(200)
    raw = len(snap.model_dump_json().encode())
    pretty = len(snap.model_dump_json(indent=2).encode())
    encoded = len(SnapshotCodec().encode(snap))
    return raw, pretty, encoded


def decode_ms(messages: int, rounds: int) -> tuple[float, float, float]:
    """Median ms to decode one encoded snapshot: whole in one pass (what ``load`` does
    for the current version), whole in two steps (``json.loads``, then validating the
    dict: what an older version's body still takes, and every body took before), and
    the part repair and the sweeps read (``WaitingSession``)."""
    codec = SnapshotCodec()
    data = codec.encode(busy_snapshot(messages))
    raw = zlib.decompress(data[codec.header_end(data) :])

    def two_steps() -> None:
        SessionSnapshot.model_validate(json.loads(raw))

    def median(fn: Callable[[], object]) -> float:
        samples = []
        for _ in range(rounds):
            started = time.perf_counter()
            for _ in range(20):
                fn()
            samples.append((time.perf_counter() - started) / 20 * 1000)
        return statistics.median(samples)

    return (
        median(lambda: codec.decode(data)),
        median(lambda: (zlib.decompress(data[codec.header_end(data) :]), two_steps())),
        median(lambda: codec.decode_waiting(data)),
    )


async def round_trip_ms(store: ObjectStore, rounds: int) -> float:
    snapshots = ObjectSnapshots(store)
    snap = await snapshots.create(busy_snapshot(200))
    times = []
    for i in range(rounds):
        t0 = time.perf_counter()
        loaded = await snapshots.load(snap.session_id)
        await snapshots.save(
            loaded.model_copy(update={"variables": {"i": i}}), expected_generation=loaded.generation
        )
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


async def bytes_per_wait(url: str, waits: int, *, spread_s: float) -> float:
    prefix = f"tpbench{os.getpid()}:"  # two runs at once never clear each other's keys
    client = redis.Redis.from_url(url)
    for key in client.scan_iter(match=prefix + "*", count=1000):
        client.delete(key)
    index = RedisIndex(url, prefix=prefix)
    now = datetime.now(UTC)
    before = int(client.info("memory")["used_memory"])
    for i in range(waits):
        deadline = now + timedelta(hours=24, seconds=spread_s * i / waits)
        await index.bind_wait(
            WaitBinding(
                tenant="acme",
                correlation_id=new_correlation_id(),
                session_id=new_session_id(),
                epoch=3,
                step_id="2",
                deadline=deadline,
            ),
            business_key=f"PR-{i:06d}",
            grace=timedelta(days=7),
            now=now,
        )
    after = int(client.info("memory")["used_memory"])
    for key in client.scan_iter(match=prefix + "*", count=1000):
        client.delete(key)
    await index.close()
    client.close()
    return (after - before) / waits


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--waits", type=int, default=10_000)
    parser.add_argument(
        "--redis", default=os.environ.get("TORPOR_BENCH_REDIS", "redis://127.0.0.1:6379/0")
    )
    args = parser.parse_args()

    raw, pretty, encoded = size_figures()
    print(
        f"snapshot, 200 messages: raw JSON {raw} B, indented JSON {pretty} B, "
        f"encoded {encoded} B = {100 * encoded / raw:.1f}% of raw JSON "
        f"[target <= {ENCODED_TARGET_PCT}%] -> {verdict(100 * encoded / raw <= ENCODED_TARGET_PCT)}"
    )

    for messages in (12, 200):
        one_pass, two_steps, waiting = decode_ms(messages, args.rounds)
        print(
            f"decode, {messages} messages: whole {one_pass:.3f} ms (in two steps, as before "
            f"and for an older version: {two_steps:.3f} ms); the part repair reads "
            f"{waiting:.3f} ms"
        )

    with tempfile.TemporaryDirectory() as tmp:
        local = await round_trip_ms(LocalObjectStore(Path(tmp)), args.rounds)
    print(f"save+load round trip, local folder: median {local:.2f} ms ({args.rounds} rounds)")

    server = S3TestServer().start()
    try:
        server.create_bucket("bench")
        s3 = S3ObjectStore("bench", "b", **server.boto_kwargs())
        remote = await round_trip_ms(s3, args.rounds)
        await s3.close()
    finally:
        server.stop()
    print(f"save+load round trip, S3 test server (moto over HTTP): median {remote:.2f} ms")

    spread = await bytes_per_wait(args.redis, args.waits, spread_s=24 * 3600)
    burst = await bytes_per_wait(args.redis, args.waits, spread_s=60)
    n = args.waits
    spreads = (("deadlines spread over 24 h", spread), ("all due within one minute", burst))
    for what, figure in spreads:
        print(
            f"Redis bytes per bound wait, {n} waits, {what}: {figure:.0f} B "
            f"[target <= {WAIT_TARGET_B} B] -> {verdict(figure <= WAIT_TARGET_B)}"
        )
    print("  (the target is at 10,000 waits; at 1,000,000: bench_scale.py, <= 250 B)")


def verdict(met: bool) -> str:
    return "met" if met else "NOT met"


if __name__ == "__main__":
    asyncio.run(main())
