"""Runtime benchmarks on a local Ray: resume latency, throughput, sleeping footprint.

    .venv/bin/python bench/bench_runtime.py [--suspended 10000]

Storage: local folder + the machine's Redis (so the figures are the runtime's, not a
network store's). Both placements run in one Ray instance, in one run, so their ratio is
meaningful even on a noisy shared machine.
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
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import ray  # noqa: E402
import redis  # noqa: E402

from actors.ray_activator import RayActivator  # noqa: E402
from actors.wiring import open_services, session_runtime  # noqa: E402
from torpor.events import EventKind, InboxEvent  # noqa: E402
from torpor.lifecycle import SessionState  # noqa: E402
from torpor.ports import Reason  # noqa: E402
from torpor.ports.services import Services  # noqa: E402
from torpor.service.activator import InlineActivator  # noqa: E402
from torpor.service.sessions import SessionService  # noqa: E402
from torpor.settings import Settings  # noqa: E402

REDIS = os.environ.get("TORPOR_BENCH_REDIS", "redis://127.0.0.1:6379/0")
PREFIX = "torpor-bench:"


def settings_for(
    tmp: Path, placement: str, namespace: str, standby: int = 0, idle_s: float = 600.0
) -> Settings:
    return Settings.build(
        {
            "runtime": {"standby_session_actors": standby, "standby_idle_s": idle_s},
            "storage": {
                "object_store_url": f"file://{tmp / 'objects'}",
                "index_url": REDIS,
                "redis_prefix": PREFIX + namespace + ":",
            },
            "namespace": namespace,
            "pool": {"size": 2},
            "agents": {
                "bench": {
                    "factory": "bench.plugins:BenchAgent",
                    "tools": ["bench.plugins:WaitForWorld"],
                    "placement": placement,
                }
            },
        }
    )


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def wait_states(
    services: Services, ids: list[str], state: SessionState, timeout_s: float = 3600
) -> float:
    t0 = time.perf_counter()
    while True:
        states = await services.index.session_states(ids)
        if sum(1 for s in states.values() if s is state) == len(ids):
            return time.perf_counter() - t0
        if time.perf_counter() - t0 > timeout_s:
            raise TimeoutError(f"{len(ids)} sessions did not reach {state}")
        await asyncio.sleep(0.05)


async def create_suspended(control: SessionService, n: int, concurrency: int = 32) -> list[str]:
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> str:
        async with gate:
            return (await control.submit(tenant="bench", agent="bench", input={"i": i})).session_id

    ids = list(await asyncio.gather(*(one(i) for i in range(n))))
    await wait_states(control.services, ids, SessionState.SUSPENDED)
    await control.drain()
    return ids


async def deliver(control: SessionService, sid: str) -> None:
    await control.services.inbox.deliver(
        InboxEvent.new(
            kind=EventKind.CALLBACK,
            session_id=sid,
            source="bench",
            event_id="go",
            type="bench.go",
            received_at=control.services.clock.now(),
            correlation_id=(await control.services.snapshots.load(sid)).waits[0].correlation_id,
        )
    )


async def resume_latency(
    control: SessionService, activator: RayActivator, ids: list[str], rate: float
) -> list[float]:
    client = redis.Redis.from_url(REDIS)
    client.delete(PREFIX + "steps")
    for sid in ids:
        await deliver(control, sid)
    requested: dict[str, float] = {}
    tasks = []
    for sid in ids:
        t0 = time.time()
        requested[sid] = t0
        tasks.append(
            asyncio.create_task(
                activator.request(sid, reason=Reason.EVENT, agent="bench", requested_at=t0)
            )
        )
        await asyncio.sleep(1 / rate)
    await asyncio.gather(*tasks)
    await wait_states(control.services, ids, SessionState.COMPLETED)
    latencies = []
    for raw in client.lrange(PREFIX + "steps", 0, -1):
        sid, at = raw.decode().split()
        if sid in requested:
            latencies.append((float(at) - requested[sid]) * 1000)
    client.close()
    return latencies


async def throughput(control: SessionService, activator: RayActivator, ids: list[str]) -> float:
    for sid in ids:
        await deliver(control, sid)
    gate = asyncio.Semaphore(64)

    async def one(sid: str) -> None:
        async with gate:
            await activator.request(sid, reason=Reason.EVENT, agent="bench")

    t0 = time.perf_counter()
    await asyncio.gather(*(one(sid) for sid in ids))
    await wait_states(control.services, ids, SessionState.COMPLETED)
    return len(ids) / (time.perf_counter() - t0)


def ray_rss_mb() -> tuple[float, int]:
    """Total resident memory of this Ray instance's processes, and how many there are."""
    total, count = 0, 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            if b"ray" not in cmd or int(pid) == os.getpid():
                continue
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
                    count += 1
        except OSError:
            continue
    return total / 1024, count


def session_actor_count(namespace: str) -> int:
    from ray.util import list_named_actors

    return sum(
        1
        for a in list_named_actors(all_namespaces=True)
        if a["namespace"] == namespace and a["name"].startswith("session:")
    )


async def run(args: argparse.Namespace) -> None:
    ray.init(
        address="local",  # a Ray of its own, even when others run on this machine
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "TORPOR_BENCH_REDIS": REDIS}},
    )
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for placement, n_lat, rate, n_thr, standby in (
            ("dedicated", args.dedicated_n, args.dedicated_rate, args.dedicated_n, 0),
            ("standby", args.standby_n, args.standby_rate, args.standby, args.standby),
            ("pooled", args.pooled_n, args.pooled_rate, args.pooled_n * 2, 0),
        ):
            if not n_lat:
                continue
            kind = "pooled" if placement == "pooled" else "dedicated"
            settings = settings_for(Path(tmp) / placement, kind, f"bench{placement}", standby)
            services = open_services(settings)
            activator = RayActivator(services)
            control = SessionService(services, activator)
            # Sessions are created and put to sleep in this process: only the resumes
            # measured go through Ray (a dedicated create would spend a standby each).
            setup = SessionService(services, InlineActivator(session_runtime(services, "setup")))
            if activator.standby is not None:
                await activator.standby.filled(timeout_s=1200)
            if kind == "pooled":
                await activator.warm()  # measure running hosts, not their start
            ids = await create_suspended(setup, n_lat)
            started = activator.standby.started if activator.standby else 0
            missed = activator.standby.missed if activator.standby else 0
            lat = await resume_latency(control, activator, ids, rate)
            ids = await create_suspended(setup, n_thr)
            if activator.standby is not None:
                await activator.standby.filled(timeout_s=1200)
            started_thr = activator.standby.started if activator.standby else 0
            missed_thr = activator.standby.missed if activator.standby else 0
            thr = await throughput(control, activator, ids)
            # Every process start the burst caused: a standby's, which every adoption
            # starts behind it, counted once the set is full again.
            if activator.standby is not None:
                await activator.standby.filled(timeout_s=1200)
            starts = (
                (activator.standby.started - started_thr + activator.standby.missed - missed_thr)
                / n_thr
                if activator.standby
                else (1.0 if kind == "dedicated" else 0.0)
            )
            # The activations that found no standby ready and started a process on their
            # path (the rest waited for none: their process was started before them).
            on_path = (
                (activator.standby.missed - missed_thr) / n_thr
                if activator.standby
                else (1.0 if kind == "dedicated" else 0.0)
            )
            sustained = None
            if activator.standby is not None:
                # Past the standby set: every activation waits for a process to start.
                ids = await create_suspended(setup, args.standby_sustained)
                await activator.standby.filled(timeout_s=1200)
                sustained = await throughput(control, activator, ids)
            results[placement] = {
                "p50": statistics.median(lat),
                "p99": percentile(lat, 0.99),
                "n": len(lat),
                "rate": rate,
                "throughput": thr,
                "n_thr": n_thr,
            }
            r = results[placement]
            target = "  [target: >= 10/s, p50 <= 100 ms]" if kind == "dedicated" else ""
            print(
                f"{placement:9s} resume latency at {rate:g}/s: p50 {r['p50']:.1f} ms, "
                f"p99 {r['p99']:.1f} ms (n={len(lat)}); "
                f"{thr:.1f} activations/s (burst of {n_thr}); "
                f"process starts per activation {starts:.2f}, on its path {on_path:.2f}{target}",
                flush=True,
            )
            if activator.standby is not None:
                await activator.standby.filled(timeout_s=1200)  # the last refills counted
                total = n_lat + n_thr + args.standby_sustained
                # A standby's start, or a named actor's for an activation that found none.
                starts_all = activator.standby.started - started + activator.standby.missed - missed
                per = starts_all / total
                n = args.standby_sustained
                burst = (
                    f"{n} activations at once, past a standby set of {standby}: {sustained:.1f}/s "
                    f"(bounded by process starts)"
                    if n > standby
                    else f"{n} activations at once, within a standby set of {standby}: "
                    f"{sustained:.1f}/s"
                )
                print(
                    f"{placement:9s} {burst}; {per:.2f} process starts per activation in all",
                    flush=True,
                )
            await activator.close()
            await services.close()
        if "pooled" in results and "dedicated" in results:
            ratio = results["pooled"]["throughput"] / results["dedicated"]["throughput"]
            print(f"pooled / dedicated throughput: {ratio:.1f}x")

        if args.quiet:
            await after_a_quiet_spell(args, Path(tmp) / "quiet")

        if args.suspended:
            settings = settings_for(Path(tmp) / "many", "pooled", "benchmany")
            services = open_services(settings)
            control = SessionService(services, RayActivator(services))
            rss_before, procs_before = ray_rss_mb()
            t0 = time.perf_counter()
            await create_suspended(control, args.suspended, concurrency=64)
            elapsed = time.perf_counter() - t0
            rss_after, procs_after = ray_rss_mb()
            actors = session_actor_count("benchmany")
            used = redis.Redis.from_url(REDIS).info("memory")["used_memory"]
            print(
                f"{args.suspended} sessions suspended in {elapsed:.0f} s "
                f"({args.suspended / elapsed:.0f}/s, pooled); live session actors: {actors}; "
                f"Ray processes {procs_before}->{procs_after}, "
                f"RSS {rss_before:.0f}->{rss_after:.0f} MB; "
                f"Redis used_memory {used / 1e6:.1f} MB"
            )
            await services.close()
    client = redis.Redis.from_url(REDIS)
    for key in client.scan_iter(match=PREFIX + "*", count=1000):
        client.delete(key)
    ray.shutdown()


async def after_a_quiet_spell(args: argparse.Namespace, tmp: Path) -> None:
    """Dedicated activations with standbys after nobody needed one for ``--quiet``
    seconds, longer than their idle time: the activator must have kept them."""
    idle_s = args.standby_idle
    settings = settings_for(tmp, "dedicated", "benchquiet", args.standby, idle_s)
    services = open_services(settings)
    activator = RayActivator(services)
    control = SessionService(services, activator)
    setup = SessionService(services, InlineActivator(session_runtime(services, "setup")))
    assert activator.standby is not None
    await activator.standby.filled(timeout_s=1200)
    ids = await create_suspended(setup, args.quiet_n)
    started = activator.standby.started
    await asyncio.sleep(args.quiet)  # the quiet spell is the point: nothing is awaited
    lat = await resume_latency(control, activator, ids, args.standby_rate)
    starts = activator.standby.started - started
    print(
        f"standby   after {args.quiet:g} s with no activation (idle time {idle_s:g} s): "
        f"resume latency p50 {statistics.median(lat):.1f} ms, p99 {percentile(lat, 0.99):.1f}"
        f" ms (n={len(lat)}); standbys started meanwhile {starts}  [target: p50 <= 100 ms]",
        flush=True,
    )
    await activator.close()
    await services.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dedicated-n", type=int, default=30)
    # Below the ~1.4 activations/s a dedicated placement sustains here: a steady rate
    # above it only measures a growing queue.
    parser.add_argument("--dedicated-rate", type=float, default=0.5)
    # Standby actors: below the rate at which the set refills (a process start each).
    parser.add_argument("--standby", type=int, default=10, help="standby session actors")
    parser.add_argument("--standby-n", type=int, default=20)
    parser.add_argument("--standby-rate", type=float, default=1.0)
    parser.add_argument("--standby-sustained", type=int, default=20)
    parser.add_argument(
        "--quiet",
        type=float,
        default=0.0,
        help="a last phase: this many seconds with no activation, then --quiet-n at "
        "--standby-rate (with --standby-idle below it: do the standbys survive?)",
    )
    parser.add_argument("--quiet-n", type=int, default=5)
    parser.add_argument("--standby-idle", type=float, default=600.0, help="runtime.standby_idle_s")
    parser.add_argument("--pooled-n", type=int, default=200)
    parser.add_argument("--pooled-rate", type=float, default=20.0)
    parser.add_argument("--suspended", type=int, default=10_000)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
