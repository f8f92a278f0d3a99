"""Profile the signed-webhook path in one process: verify → admit → inbox → audit → 202.

    .venv/bin/python bench/profile_gateway.py [--n 2000] [--out bench/profiles/gateway.txt]

No Ray and no HTTP: the gateway is called directly (local folder + the machine's Redis,
activations deferred to the reconciler as in the ingress bench's accept phase, or with
``--resume`` run in this process after each 202, as a pool host would), so the
figures are the Python work of the path and the storage round trips alone. Prints wall
and CPU time per webhook and writes pyinstrument's call tree as text; with ``--timeline``
instead, when each stage of the path is reached (``bench/stages.py``) and how many round
trips to the index each webhook made (counted, not timed); with ``--instructions``,
the machine instructions this process ran per webhook, counted by valgrind's callgrind,
all threads and the event loop's alone. The loop's is repeatable where times are not:
within 0.2 % whatever else the machine does (the store's writes pinned to it,
``pin_inline_writes``), so a cut of 1 % shows on a noisy day; the total moves by up to
1 % with the worker threads' own upkeep, which runs by the clock. With ``--resume``
the activation shares this process's event loop with the gateway (a pool host is another
process), so the 202 comes later than it would: read the resume's marks from there.

The loop is uvloop, as in Serve's replicas (a Ray worker installs it, and ``ray[serve]``
brings it through uvicorn's standard extra); ``--loop asyncio`` for the standard
library's, whose scheduling is Python code and a third of the instructions counted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402
import uvloop  # noqa: E402
from starlette.datastructures import Headers  # noqa: E402

from actors.wiring import open_services, session_runtime  # noqa: E402
from bench.stages import RoundTrips, Timeline, floors, instrument  # noqa: E402
from storage.small_objects import CHECKPOINT_EVERY  # noqa: E402
from torpor.lifecycle import SessionState  # noqa: E402
from torpor.service.activator import InlineActivator  # noqa: E402
from torpor.service.gateway import WebhookGateway  # noqa: E402
from torpor.service.sessions import SessionService  # noqa: E402
from torpor.settings import Settings  # noqa: E402
from torpor.webhooks.signing import Scheme, sign  # noqa: E402


class Deferred:
    """Activations left to the reconciler: the accept path alone is measured."""

    async def request(self, session_id: str, **_: object) -> None:
        return None


REDIS = os.environ.get("TORPOR_BENCH_REDIS", "redis://127.0.0.1:6379/0")
LOOPS = {"uvloop": uvloop.new_event_loop, "asyncio": asyncio.new_event_loop}
SECRET = "b" * 64


def as_served(body: bytes, signed: dict[str, str]) -> Headers:
    """The headers as a Serve replica hands them to the gateway: Starlette's ``Headers``
    over the raw request's (wrk's own two, then the signed request's), each decoded
    again whenever they are read."""
    sent = {"host": "127.0.0.1:8000", "content-length": str(len(body)), **signed}
    raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in sent.items()]
    return Headers(raw=raw)


def settings_for(tmp: Path, prefix: str, deferred: bool) -> Settings:
    return Settings.build(
        {
            "storage": {
                "object_store_url": f"file://{tmp / 'objects'}",
                "index_url": REDIS,
                "redis_prefix": prefix,
            },
            "max_inflight_activations": 0 if deferred else 64,
            "sources": {
                "bench": {
                    "tenant": "bench",
                    "scheme": "torpor",
                    "secrets": [SECRET],
                    "mapping": {
                        "event_id_path": "id",
                        "default_type": "bench.go",
                        "correlation_id_path": "correlationId",
                    },
                }
            },
            "agents": {
                "bench": {
                    "factory": "bench.plugins:BenchAgent",
                    "tools": ["bench.plugins:WaitForWorld"],
                    "placement": "pooled",
                }
            },
        }
    )


async def run(args: argparse.Namespace) -> None:
    prefix = f"tpbench-prof:{os.getpid()}:"
    try:
        await measure(args, prefix)
    finally:  # every way out: the runs under load and the timeline return early
        client = redis.Redis.from_url(REDIS)
        for key in client.scan_iter(match=prefix + "*", count=1000):
            client.delete(key)
        client.close()


async def measure(args: argparse.Namespace, prefix: str) -> None:
    timeline, trips = Timeline(), RoundTrips()
    if args.timeline:
        instrument(timeline, resume=args.resume)
        trips.install()
    with tempfile.TemporaryDirectory() as tmp:
        build = SessionService(
            (s := open_services(settings_for(Path(tmp), prefix, deferred=False))),
            InlineActivator(session_runtime(s, "bench")),
        )
        ids = [
            (await build.submit(tenant="bench", agent="bench", input={"i": i})).session_id
            for i in range(args.n)
        ]
        states = await s.index.session_states(ids)
        assert all(st is SessionState.SUSPENDED for st in states.values())
        cids = [(await s.snapshots.load(sid)).waits[0].correlation_id for sid in ids]
        await s.close()

        services = open_services(settings_for(Path(tmp), prefix, deferred=not args.resume))
        # --resume: each webhook's activation runs here right after its 202 (what a pool
        # host does: the lease, the snapshot, the agent's step, three commits).
        activator = (
            InlineActivator(session_runtime(services, "bench")) if args.resume else Deferred()
        )
        control = SessionService(services, activator)
        gateway = WebhookGateway(control)
        now = datetime.now(UTC)
        requests: list[tuple[bytes, Headers]] = []
        for cid in cids:
            body = json.dumps({"id": f"e-{cid}", "correlationId": cid}).encode()
            signed = sign(Scheme.TORPOR, body, SECRET, now=now)
            signed["Content-Type"] = "application/json"
            requests.append((body, as_served(body, signed)))
        warm = args.n // 10
        for body, headers in requests[:warm]:
            await gateway.receive("bench", body, headers, now=now)
        half = (len(requests) + warm) // 2
        print(f"measuring (pid {os.getpid()})", flush=True)
        await asyncio.sleep(args.attach_pause)  # time for strace/py-spy/perf to attach
        if args.concurrency > 1:  # under load: CPU per webhook, no profile
            await under_load(gateway, requests[warm:], now, args.concurrency, tmp)
            print_upkeep(services.store)
            await services.close()
            return
        timeline.clear()
        trips.clear()
        if args.under_callgrind:
            await callgrind("on")
        wall0, times0, free0 = time.perf_counter(), os.times(), free_inodes(tmp)
        for body, headers in requests[warm:half]:
            result = await gateway.receive("bench", body, headers, now=now)
            assert result.status == 202, result
        n = half - warm
        if args.under_callgrind:
            await callgrind("off")
            print(f"COUNTED {n}", flush=True)
            await services.close()
            return
        wall = (time.perf_counter() - wall0) / n * 1000
        times1, made = os.times(), (free0 - free_inodes(tmp)) / n
        user = (times1.user - times0.user) / n * 1000
        system = (times1.system - times0.system) / n * 1000
        print(
            f"signed webhook -> 202 in process: {wall:.2f} ms wall, {user + system:.2f} ms CPU"
            f" ({user:.2f} user, {system:.2f} kernel; {made:.2f} inodes allocated each; n={n})"
        )
        if args.timeline:
            print("stages, median ms since the request came in:", *timeline.report(), sep="\n")
            print(trips.report(n))
            print("this machine's floors:", *await floors(services.index.batched, tmp), sep="\n")
            print_upkeep(services.store)
            await services.close()
            return
        from pyinstrument import Profiler  # only the profiled pass needs it

        profiler = Profiler(interval=0.001, async_mode="enabled")
        wall0, cpu0 = time.perf_counter(), time.process_time()
        with profiler:
            for body, headers in requests[half:]:
                result = await gateway.receive("bench", body, headers, now=now)
                assert result.status == 202, result
        n = len(requests) - half
        wall = (time.perf_counter() - wall0) / n * 1000
        cpu = (time.process_time() - cpu0) / n * 1000
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            text = profiler.output_text(unicode=False, color=False, show_all=False)
            Path(args.out).write_text(  # noqa: ASYNC240 - once, after the measurement
                f"# bench/profile_gateway.py, n={n} (profiled: {wall:.2f} ms wall, {cpu:.2f} ms "
                "CPU each)\n" + text
            )
        print_upkeep(services.store)
        await services.close()


def print_upkeep(store: object) -> None:
    """How this process's checkpoints kept the rows' log short (a local folder store):
    restarts that miss their turn leave every commit appended, each flush dearer."""
    figures = getattr(store, "figures", None)
    if figures is None:
        return
    f = figures()
    if not any(f.values()):
        print(f"the rows' log: no checkpoint yet (one every {CHECKPOINT_EVERY} flushes)")
        return
    print(
        f"the rows' log: {f['rows_log_restarts']} restarts, {f['rows_log_truncations']}"
        f" emptied, {f['rows_log_checkpoints_missed']} checkpoints missed their turn;"
        f" {f['rows_log_bytes'] / 1e6:.1f} MB at the last checkpoint"
    )


def free_inodes(folder: str) -> int:
    """The file system's free inodes: what a run allocated, net of what it freed (the
    machine's other processes count too: run it on a quiet machine)."""
    return os.statvfs(folder).f_ffree


async def under_load(
    gateway: WebhookGateway,
    requests: list[tuple[bytes, Headers]],
    now: datetime,
    concurrency: int,
    tmp: str,
) -> None:
    """``concurrency`` webhooks in flight at all times: wall and CPU per webhook."""
    pending = iter(requests)

    async def worker() -> None:
        for body, headers in pending:
            result = await gateway.receive("bench", body, headers, now=now)
            assert result.status == 202, result

    wall0, times0, free0 = time.perf_counter(), os.times(), free_inodes(tmp)
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    times1, n = os.times(), len(requests)
    made = (free0 - free_inodes(tmp)) / n
    user = (times1.user - times0.user) / n * 1000
    system = (times1.system - times0.system) / n * 1000
    print(
        f"signed webhooks -> 202 in process, {concurrency} at once: "
        f"{n / (time.perf_counter() - wall0):.0f}/s, {user + system:.2f} ms CPU each"
        f" ({user:.2f} user, {system:.2f} kernel; {made:.2f} inodes allocated each; n={n})"
    )


async def callgrind(switch: str) -> None:
    """This process's instruction counting turned ``on`` or ``off`` (it runs under
    ``valgrind --tool=callgrind --instr-atstart=no``). An ``off`` is read back (an ``off``
    not taken would count the close and the interpreter's exit too); an ``on`` not taken
    counts nothing, which ``count_instructions`` refuses, and read back here it would
    count the reading."""
    await vgdb("instrumentation", switch)
    if switch == "on":
        return
    state = re.search(r"instrumentation: (\w+)", await vgdb("status", "internal"))
    if state is None or state.group(1) != switch:
        raise RuntimeError(f"callgrind's instrumentation is not {switch}: {state}")


async def vgdb(*command: str) -> str:
    """``command`` sent to this process's valgrind, its answer. Awaited while the loop
    keeps running code: valgrind takes a command between the blocks it runs, and a loop
    blocked in ``epoll_wait`` runs none (``vgdb`` then wakes it with ptrace, which a
    machine may refuse)."""
    asked = await asyncio.create_subprocess_exec(
        "vgdb",
        f"--pid={os.getpid()}",
        *command,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    answer = asyncio.ensure_future(asked.communicate())
    deadline = time.monotonic() + 120
    while not answer.done():
        if time.monotonic() > deadline:
            asked.kill()
            raise RuntimeError(f"valgrind did not answer {' '.join(command)!r}")
        await asyncio.sleep(0.005)
    out, _ = answer.result()
    if asked.returncode != 0:
        raise RuntimeError(f"vgdb {' '.join(command)} failed ({asked.returncode}): {out[-500:]!r}")
    return out.decode(errors="replace")


def pin_inline_writes() -> None:
    """Under callgrind, the local store's small writes made on the loop's thread, as one
    webhook at a time makes them on a quiet machine. The store chooses by the wall time
    its inline writes took (``local_io._Inline``), which valgrind stretches some fifty
    times but not the disk's: left to choose, it moved writes to its worker threads as
    the machine's load rose, and the count with them (one commit: 7.15 to 7.38 M a
    webhook with its resume; by thread, a worker's share 4.4 M in one run, 14.6 M in
    the next)."""
    from storage import local_io

    local_io.INLINE_BURST_S = float("inf")
    local_io.INLINE_FLUSH_BUDGET_S = float("inf")


def count_instructions(n: int, loop: str, resume: bool) -> None:
    """``--instructions``: this script again under callgrind, counting only its one-at-a-
    time pass; prints the instructions per webhook (this process's threads, not Redis's)."""
    if shutil.which("valgrind") is None or shutil.which("vgdb") is None:
        sys.exit("--instructions needs valgrind (apt-get install valgrind)")
    # The set-up and the count run some 30x slower under valgrind; a resume, 4x more.
    deadline = 60 + n * (4 if resume else 1)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        started = time.perf_counter()
        try:
            done = subprocess.run(
                [
                    "valgrind",
                    "--tool=callgrind",
                    "--instr-atstart=no",
                    "--separate-threads=yes",  # a file a thread: out-01 is the loop's
                    f"--callgrind-out-file={out}",
                    sys.executable,
                    __file__,
                    "--under-callgrind",
                    "--n",
                    str(n),
                    "--loop",
                    loop,
                    *(["--resume"] if resume else []),
                ],
                capture_output=True,
                text=True,
                timeout=deadline,
                check=False,
            )
        except subprocess.TimeoutExpired:  # the run is killed
            sys.exit(f"the counted run took more than {deadline} s")
        counted = re.search(r"^COUNTED (\d+)$", done.stdout, re.MULTILINE)
        # "totals": the events counted while on ("summary" may say 0 when toggled).
        by_thread = {
            path.name.rsplit("-", 1)[-1]: int(found.group(1))
            for path in out.parent.glob(f"{out.name}-*")
            if (found := re.search(r"^totals: (\d+)", path.read_text(), re.MULTILINE))
        }
        loop_thread = by_thread.get("01", 0)
        if done.returncode != 0 or counted is None or loop_thread == 0:
            sys.exit(f"the counted run failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    webhooks = int(counted.group(1))
    print(
        f"signed webhook -> 202 in process: {sum(by_thread.values()) / webhooks / 1e6:.3f} M"
        f" instructions each{' with its resume' if resume else ''}, the loop's thread"
        f" {loop_thread / webhooks / 1e6:.3f} M (callgrind, n={webhooks}, one at a time,"
        f" {loop}; {time.perf_counter() - started:.0f} s)"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument(
        "--concurrency", type=int, default=1, help="webhooks in flight at once (no profile)"
    )
    parser.add_argument(
        "--attach-pause", type=float, default=0.0, help="seconds to wait after 'measuring'"
    )
    parser.add_argument(
        "--resume", action="store_true", help="each webhook also resumes its session here"
    )
    parser.add_argument(
        "--timeline",
        action="store_true",
        help="print when each stage of the path is reached (bench/stages.py), no profile",
    )
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="count the instructions per webhook under valgrind's callgrind (one at a time)",
    )
    parser.add_argument(
        "--loop",
        choices=LOOPS,
        default="uvloop",
        help="the event loop: uvloop, Serve's (default), or the standard library's",
    )
    parser.add_argument("--under-callgrind", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(ROOT / "bench" / "profiles" / "gateway.txt"))
    args = parser.parse_args()
    if args.instructions:
        count_instructions(args.n, args.loop, args.resume)
        return
    if args.under_callgrind:
        pin_inline_writes()
    with asyncio.Runner(loop_factory=LOOPS[args.loop]) as runner:
        runner.run(run(args))


if __name__ == "__main__":
    main()
