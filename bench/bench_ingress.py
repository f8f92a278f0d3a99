"""Ingress benchmark: signed webhooks to 202 vs a trivial endpoint, same app, same run.

    .venv/bin/python bench/bench_ingress.py            # both proxies, one after the other
    .venv/bin/python bench/bench_ingress.py --proxy default

Each webhook is unique and valid (fresh nonce, fresh event id) and goes the whole way:
verify → replay claims → resolve → inbox write → audit append → 202, and then wakes its
session (pooled placement) behind the answer. The load comes from wrk (2 threads, 32
connections), fed pre-signed requests by a Lua script. Storage: local folder + Redis.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from torpor.entry.ingress import HOOKS_FIRST, SERVER_MIDDLEWARES, USER_LOOP  # noqa: E402

REDIS = os.environ.get("TORPOR_BENCH_REDIS", "redis://127.0.0.1:6379/0")
SECRET = "b" * 64

WRK_LUA = r"""
local requests = {}
local counter = 0
local threads = {}
function setup(thread)
  thread:set("id", counter)
  table.insert(threads, thread)
  counter = counter + 1
end
function init(args)
  local file = args[1]
  local nthreads = tonumber(args[2])
  method = args[3] or "POST"
  local i = 0
  non2xx = 0
  if file == nil or file == "-" then return end
  for line in io.lines(file) do
    if i % nthreads == id then
      local sep = line:find("\t")
      local headers = {}
      for k, v in line:sub(1, sep - 1):gmatch("([^=;]+)=([^;]*)") do headers[k] = v end
      table.insert(requests, wrk.format("POST", nil, headers, line:sub(sep + 1)))
    end
    i = i + 1
  end
  nxt = 1
end
function request()
  if method == "GET" then return wrk.format("GET", nil, {}, nil) end
  if #requests == 0 then
    return wrk.format("POST", nil, {["Content-Type"]="application/json"}, "{}")
  end
  local r = requests[nxt]
  nxt = nxt % #requests + 1
  return r
end
function response(status, headers, body)
  if status < 200 or status >= 300 then non2xx = non2xx + 1 end
end
function done(summary, latency, requests)
  local bad = 0
  for _, t in ipairs(threads) do bad = bad + t:get("non2xx") end
  io.write(string.format("RESULT %d %d %.3f %.3f %.3f %d\n", summary.requests,
    summary.duration, latency:percentile(50) / 1000, latency:percentile(99) / 1000,
    summary.requests / (summary.duration / 1e6), bad))
end
"""


def wrk(
    url: str, lua: Path, duration_s: int, requests_file: Path | None, method: str = "POST"
) -> dict[str, Any]:
    args = ["wrk", "-t2", "-c32", f"-d{duration_s}s", "--latency", "-s", str(lua), url]
    args += ["--", str(requests_file) if requests_file else "-", "2", method]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    match = re.search(r"RESULT (\d+) (\d+) ([\d.]+) ([\d.]+) ([\d.]+) (\d+)", out)
    if not match:
        raise RuntimeError(f"unexpected wrk output:\n{out}")
    n, _, p50, p99, rps, bad = match.groups()
    return {
        "requests": int(n),
        "p50_ms": float(p50),
        "p99_ms": float(p99),
        "rps": float(rps),
        "non_2xx": int(bad),
    }


def write_requests(path: Path, cids: list[str], per_session: int = 1) -> None:
    """Unique, freshly signed webhooks (signed now: the window is five minutes),
    ``per_session`` distinct events for each waiting session."""
    from torpor.webhooks.signing import Scheme, sign

    now = datetime.now(UTC)
    with path.open("w") as fh:
        for n, cid in ((n, cid) for n in range(per_session) for cid in cids):
            body = json.dumps({"id": f"e-{n}-{cid}", "correlationId": cid}).encode()
            headers = sign(Scheme.TORPOR, body, SECRET, now=now)
            headers["Content-Type"] = "application/json"
            fh.write(";".join(f"{k}={v}" for k, v in headers.items()) + "\t")
            fh.write(body.decode() + "\n")


def sequential(
    base: str,
    cids: list[tuple[str, str]],
    deferred: list[str] | None = None,
    state_key: str | None = None,
    sender_nice: int | None = None,
    samples: str | None = None,
) -> dict[str, float]:
    """One signed webhook at a time on one kept-alive connection: POST → 202, and POST →
    the session's next agent step (pooled placement; the bench agent stamps its step in
    Redis with the wall clock). With ``deferred`` (correlation ids of other sessions),
    first POST → 202 on the app that defers activation: the same path with no session
    resuming beside it on the two cores.

    With ``state_key`` (the index's hash of session states), the next webhook is sent
    only once the session before has ended (its step committed, its lease given back):
    each webhook meets an idle system. Without it, the next goes as soon as the step is
    stamped, while the session before still commits on the same two cores (a packet
    capture showed its commit's round trips inside the next webhook's handling).

    With ``sender_nice``, the thread that sends runs at that niceness for the pass
    (Linux's nice is per thread: the Ray driver's own threads keep theirs). A sender
    ahead of the server's processes on the cores stands in for one on another machine: a
    figure that moves with it is the sender waiting for a core, not the server (one run:
    the 202 did not move, README).

    With ``samples`` (a file name), each webhook's figures are appended to that file as
    a JSON line, with the ``CLOCK_MONOTONIC`` millisecond it was sent at: a tail can
    then be laid beside what else the machine did (``bench/tails.py``)."""
    import http.client
    from urllib.parse import urlsplit

    import redis

    from torpor.webhooks.signing import Scheme, sign

    client = redis.Redis.from_url(REDIS)
    where = urlsplit(base)
    conn = http.client.HTTPConnection(where.hostname or "127.0.0.1", where.port, timeout=30)
    trivial: list[float] = []
    client.delete("torpor-bench:steps")  # stamps of an earlier run

    sent: list[float] = []  # CLOCK_MONOTONIC ms each webhook was sent at
    stolen: list[float] = []  # the hypervisor's steal so far, read as each was sent

    def accepted(path: str, event_id: str, cid: str) -> float:
        """One freshly signed webhook POSTed on ``conn``: ms to its 202."""
        body = json.dumps({"id": event_id, "correlationId": cid}).encode()
        headers = {**sign(Scheme.TORPOR, body, SECRET, now=datetime.now(UTC))}
        headers["Content-Type"] = "application/json"
        if samples is not None:
            stolen.append(steal_ms())
        sent.append(time.monotonic() * 1000)
        p0 = time.perf_counter()
        conn.request("POST", path, body=body, headers=headers)
        response = conn.getresponse()
        response.read()
        took = (time.perf_counter() - p0) * 1000
        if response.status != 202:
            raise RuntimeError(f"sequential webhook to {path} answered {response.status}")
        return took

    thread = threading.get_native_id()
    niceness = os.getpriority(os.PRIO_PROCESS, thread)
    if sender_nice is not None:
        os.setpriority(os.PRIO_PROCESS, thread, sender_nice)  # PermissionError: no CAP_SYS_NICE
    try:
        for _ in range(len(cids)):  # the floor: a trivial POST on the same connection
            p0 = time.perf_counter()
            conn.request(
                "POST", "/v1/noop", body=b"{}", headers={"Content-Type": "application/json"}
            )
            conn.getresponse().read()
            trivial.append((time.perf_counter() - p0) * 1000)
        alone = [accepted("/deferred/v1/hooks/bench", f"seqd-{cid}", cid) for cid in deferred or []]
        accept, step = one_by_one(cids, accepted, client, state_key)
    finally:
        os.setpriority(os.PRIO_PROCESS, thread, niceness)
    conn.close()
    client.close()
    if samples is not None:  # written after the pass (between webhooks: one /proc/stat read)
        stolen.append(steal_ms())
        # Steal is counted at the clock tick after it happened: a stall inside one
        # webhook's span can show in the next one's (``bench/tails.py`` shows both).
        steals = [b - a for a, b in itertools.pairwise(stolen)]
        mode = (
            "back-to-back"
            if state_key is None
            else "idle"
            if sender_nice is None
            else f"idle, sender at nice {sender_nice}"
        )
        rows: list[dict[str, Any]] = [
            {"pass": mode, "kind": "alone", "sent_ms": t, "accept_ms": a, "steal_ms": st}
            for t, a, st in zip(sent[: len(alone)], alone, steals[: len(alone)], strict=True)
        ]
        rows += [
            {
                "pass": mode,
                "kind": "resume",
                "sent_ms": t,
                "accept_ms": a,
                "step_ms": st,
                "steal_ms": stole,
            }
            for t, a, st, stole in zip(
                sent[len(alone) :], accept, step, steals[len(alone) :], strict=True
            )
        ]
        # Which process each thread is, for a trace of the machine taken meanwhile.
        rows.append({"processes": thread_names()})
        with open(samples, "a") as fh:
            fh.writelines(json.dumps(row) + "\n" for row in rows)
    accept.sort()
    step.sort()
    trivial.sort()
    alone.sort()
    return {
        "trivial_p50": trivial[len(trivial) // 2],
        "alone_p50": alone[len(alone) // 2] if alone else None,
        "alone_p99": alone[min(len(alone) - 1, int(0.99 * len(alone)))] if alone else None,
        "accept_p50": accept[len(accept) // 2],
        "accept_p99": accept[min(len(accept) - 1, int(0.99 * len(accept)))],
        "step_p50": step[len(step) // 2],
        "step_p99": step[min(len(step) - 1, int(0.99 * len(step)))],
        "n": len(step),
    }


def one_by_one(
    cids: list[tuple[str, str]],
    accepted: Callable[[str, str, str], float],
    client: Any,
    state_key: str | None,
) -> tuple[list[float], list[float]]:
    """Each session's webhook in turn: ms to its 202, ms to its agent's step stamp."""
    accept: list[float] = []
    step: list[float] = []
    for sid, cid in cids:
        t0 = time.time()
        accept.append(accepted("/v1/hooks/bench", f"seq-{cid}", cid))
        while True:  # this session's step stamp; blocked in Redis, not polling it: a
            # poll every half millisecond took CPU from the two cores it measures
            popped = client.blpop(["torpor-bench:steps"], timeout=30)
            if popped is None:
                raise RuntimeError(f"{sid} never stepped")
            stamped, at = popped[1].decode().split()
            if stamped == sid:
                step.append((float(at) - t0) * 1000)
                break
        if state_key is not None:  # between measurements: its polling costs them nothing
            ends = time.monotonic() + 30
            while not (client.hget(state_key, sid) or b"").startswith(b"COMPLETED"):
                if time.monotonic() > ends:
                    raise RuntimeError(f"{sid} never completed")
                time.sleep(0.001)
    return accept, step


_RAY_TASK = re.compile(r"^(ray::[^ .]+)\.\w+")


def cpu_by_process() -> dict[int, tuple[str, float]]:
    """CPU seconds so far of every process on the machine, by process id, with its short
    name (``cpu_share`` compares two readings process by process)."""
    return processes()


def processes() -> dict[int, tuple[str, float]]:
    """Every process on the machine: its short name and its CPU seconds so far."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, tuple[str, float]] = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        used = (int(fields[11]) + int(fields[12])) / tick
        out[int(pid)] = (short_name(args, stat[stat.index("(") + 1 : stat.rindex(")")]), used)
    return out


def short_name(args: list[bytes], comm: str) -> str:
    """A process's name from its command line (Ray names its workers there: ServeReplica,
    PoolHost, raylet...), or its ``comm`` for a kernel thread."""
    name = args[0].decode(errors="replace").rsplit("/", 1)[-1][:40]
    if not name:  # a kernel thread (or py-spy): by its kind (kworker/1:2 -> kworker)
        return "kernel " + comm.split("/")[0]
    if name.startswith(("ray::", "python")) or "ray" in name:
        name = " ".join(a.decode(errors="replace") for a in args[:2])
        # A Ray worker's title names the task it runs now (``ray::ServeReplica:app:
        # Ingress.check_health``, then ``...Ingress`` again): one name per worker.
        name = _RAY_TASK.sub(r"\1", name)[-40:]
    return name


def steal_ms() -> float:
    """CPU time the hypervisor has taken from this machine's CPUs so far (all of them), in
    ms: ``/proc/stat``'s steal, counted in clock ticks. A VM whose vCPU is descheduled
    stalls every process on it at once, using no CPU: a webhook slowed by that is the
    machine, not the path."""
    with open("/proc/stat", "rb") as fh:
        fields = fh.readline().split()
    return int(fields[8]) * 1000 / os.sysconf("SC_CLK_TCK")


def thread_names() -> dict[int, str]:
    """Every thread on the machine, by id: its process's short name."""
    out: dict[int, str] = {}
    for pid, (name, _) in processes().items():
        try:
            out.update((int(tid), name) for tid in os.listdir(f"/proc/{pid}/task"))
        except OSError:  # exited meanwhile
            continue
    return out


def cpu_used(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]
) -> dict[str, float]:
    """CPU seconds each process used between two readings, summed by name. Compared by
    process id: keyed by name, a worker whose title changed between the readings (Ray
    names the task it runs) counted all its CPU since it started (one run printed 3.91
    ms a webhook for a replica at 823 webhooks/s, more than the two cores)."""
    used: dict[str, float] = {}
    for pid, (name, total) in after.items():
        earlier = before.get(pid)
        used[name] = used.get(name, 0.0) + total - (earlier[1] if earlier else 0.0)
    return used


def cpu_share(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], requests: int
) -> str:
    """The biggest CPU users between two readings, in ms of CPU per request."""
    used = cpu_used(before, after)
    top = sorted(used.items(), key=lambda kv: -kv[1])[:6]
    return ", ".join(f"{k.strip()} {1000 * v / max(1, requests):.2f}" for k, v in top if v > 0)


SETTLE_S = 60.0  # ``--settle-s``


# The processes a webhook's 202 waits for (Serve's own proxy, under ``--proxy default``).
EDGE = ("haproxy", "ProxyActor", "ServeReplica")
SESSIONS = ("PoolHost",)  # the processes that run the sessions it resumes


def pin_apart(*, edge: bool) -> dict[int, set[int]]:
    """``--pin``: the pool hosts on CPU 1 and, with ``edge`` (``--pin apart``), the edge
    (HAProxy, the apps' replicas) on CPU 0, for the one-at-a-time passes: a 202 then never
    waits for a core while the session before it commits. Without ``edge`` (``--pin
    pool``) the edge may run on either CPU, and finds CPU 0 free of sessions. Every thread
    of each process is pinned (Linux's affinity is per thread; threads made later inherit
    their maker's). Returns each thread's affinity before, for ``unpin``."""
    if not {0, 1} <= os.sched_getaffinity(0):
        sys.exit(f"--pin needs CPUs 0 and 1; this process may use {os.sched_getaffinity(0)}")
    before: dict[int, set[int]] = {}
    for name, tid in threads_of(EDGE + SESSIONS if edge else SESSIONS):
        cpu = 0 if any(e in name for e in EDGE) else 1
        try:
            had = os.sched_getaffinity(tid)
            os.sched_setaffinity(tid, {cpu})
        except ProcessLookupError:  # the thread ended meanwhile
            continue
        before[tid] = had
    return before


def unpin(before: dict[int, set[int]]) -> None:
    """Each thread ``pin_apart`` pinned back on the CPUs it had (threads started while
    pinned: on every CPU), before the throughput phases."""
    every = os.sched_getaffinity(0)
    for _, tid in threads_of(EDGE + SESSIONS):
        try:
            os.sched_setaffinity(tid, before.get(tid, every))
        except ProcessLookupError:
            continue


def threads_of(names: tuple[str, ...]) -> Iterator[tuple[str, int]]:
    """Each thread (its process's short name, its id) of the processes named ``names``."""
    for pid, (name, _) in processes().items():
        if not any(n in name for n in names):
            continue
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:  # the process ended meanwhile
            continue
        yield from ((name, int(tid)) for tid in tids)


def settle(timeout_s: float | None = None) -> None:
    """Until Ray's processes are quiet (under 5 % of a core for a second): a redeployed
    app's controller spends seconds of CPU after ``serve.run`` returns (health checks,
    the old replica's shutdown), which the next phase would otherwise pay for. At most
    ``SETTLE_S``: on a machine where Ray's own daemons never drop under it, each of the
    three waits is that long."""
    deadline = time.monotonic() + (SETTLE_S if timeout_s is None else timeout_s)
    before = cpu_by_process()
    while time.monotonic() < deadline:
        time.sleep(1.0)
        after = cpu_by_process()
        busy = sum(v for k, v in cpu_used(before, after).items() if "ray" in k.lower())
        if busy < 0.05:
            return
        before = after


class OffCpuRecording:
    """``perf record`` of every context switch, with stacks, while the one-at-a-time
    passes run (``--offcpu``; ``bench/offcpu.py`` reads it). Beside the recording,
    ``<out>.json``: the window (``CLOCK_MONOTONIC`` ms, perf's clock with ``-k mono``) and
    the replicas' and pool hosts' process ids."""

    READY_S = 10.0  # perf writes its header once its buffers are mapped on every CPU

    def __init__(self, out: str) -> None:
        self.out = out
        self._perf: subprocess.Popen[bytes] | None = None
        self._said: BinaryIO | None = None  # perf's stderr
        self._from_ms = 0.0

    def start(self) -> None:
        Path(self.out).unlink(missing_ok=True)
        self._said = Path(self.out + ".log").open("wb")  # noqa: SIM115 - closed in stop
        self._perf = subprocess.Popen(
            [
                "perf",
                "record",
                "-q",
                "-e",
                "sched:sched_switch",
                "-g",
                "-a",
                "-k",
                "mono",
                "-o",
                self.out,
            ],
            stdout=subprocess.DEVNULL,
            # A file, not a pipe: nobody reads perf's warnings while it records, and a
            # full pipe would stop it.
            stderr=self._said,
        )
        deadline = time.monotonic() + self.READY_S
        while not (Path(self.out).exists() and Path(self.out).stat().st_size > 0):
            if self._perf.poll() is not None or time.monotonic() > deadline:
                self._perf.kill()
                self._said.close()
                said = Path(self.out + ".log").read_text(errors="replace").strip()[-500:]
                raise SystemExit(f"--offcpu: perf record did not start: {said}")
            time.sleep(0.05)
        self._from_ms = time.monotonic() * 1000

    def stop(self) -> str:
        """Stop recording; the summary line of what was written."""
        to_ms = time.monotonic() * 1000
        assert self._perf is not None
        self._perf.send_signal(signal.SIGINT)  # perf flushes and writes its index on SIGINT
        self._perf.wait(timeout=120)
        if self._said is not None:
            self._said.close()
        watched = {
            pid: name.strip()
            for pid, (name, _) in processes().items()
            if "ServeReplica" in name or "PoolHost" in name
        }
        Path(self.out + ".json").write_text(
            json.dumps({"from_ms": self._from_ms, "to_ms": to_ms, "pids": watched})
        )
        return f"off-CPU recording: {self.out} ({len(watched)} processes watched): bench/offcpu.py"


def offcpu_file(path: str, proxy: str, proxies: list[str]) -> str:
    """The recording of ``proxy``'s run: ``path``, or with both proxies one file each
    (``--offcpu``, ``--profile-pool``)."""
    resolved = str(Path(path).resolve())
    return f"{resolved}.{proxy}" if len(proxies) > 1 else resolved


def profile_pool(out: str, duration_s: int) -> list[subprocess.Popen[bytes]]:
    """py-spy on every pool host for the resuming phase, collapsed stacks each
    (``<out>.<pid>.txt``): where a resume's CPU goes, the store's worker threads included
    (``bench/spy_shares.py`` sums them). py-spy takes CPU from the phase it samples: the
    figures of a profiled run are not compared with an unprofiled one's."""
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True, check=True)
    pids = [line.split()[0] for line in ps.stdout.splitlines() if "ray::PoolHost" in line]
    if not pids:
        print("  --profile-pool: no pool host process found, nothing sampled", flush=True)
    return [py_spy(pid, f"{out}.{pid}.txt", duration_s, "raw") for pid in pids]


def py_spy(
    pid: str, out: str, duration_s: int, fmt: str, *, gil: bool = False
) -> subprocess.Popen[bytes]:
    """py-spy sampling ``pid`` for ``duration_s`` into ``out`` (busy threads only)."""
    return subprocess.Popen(
        [
            str(Path(sys.executable).with_name("py-spy")),
            "record",
            "-p",
            pid,
            "-d",
            str(duration_s),
            "-r",
            "200",
            "-f",
            fmt,
            "-o",
            out,
            "--nonblocking",
            *(["--gil"] if gil else []),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def profile_replica(out: str, duration_s: int, name: str) -> subprocess.Popen[bytes]:
    """py-spy on the Serve replica for the accept phase: a flame graph (``.svg``) or
    collapsed stacks (``.txt``), native frames left out (Python's own work is the point).
    A name with ``.gil.`` in it samples only the thread that holds the GIL: the replica's
    I/O threads blocked in a system call are then not counted as work."""
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True, check=True)
    pid = next(line.split()[0] for line in ps.stdout.splitlines() if name in line)
    fmt = "raw" if out.endswith(".txt") else "flamegraph"
    return py_spy(pid, out, duration_s, fmt, gil=".gil." in Path(out).name)


async def child(
    proxy: str,
    duration_s: int,
    sessions: int,
    seq_n: int,
    profile: str | None = None,
    replicas: int = 1,
    resume_s: int = 4,
    sender_nice: int | None = None,
    samples: str | None = None,
    offcpu: str | None = None,
    pin: str | None = None,
    profile_pool_out: str | None = None,
) -> dict[str, Any]:
    import ray
    import redis
    from ray import serve

    from actors.ray_activator import RayActivator
    from actors.wiring import open_services
    from serve_app import application
    from tests.support.s3_server import free_port
    from torpor.lifecycle import SessionState
    from torpor.service.sessions import SessionService
    from torpor.settings import Settings

    tmp = Path(tempfile.mkdtemp(prefix="torpor-bench-"))
    prefix = f"tpbench-in:{secrets.token_hex(3)}:"
    port = free_port()
    config: dict[str, Any] = {
        "storage": {
            "object_store_url": f"file://{tmp / 'objects'}",
            "index_url": REDIS,
            "redis_prefix": prefix,
        },
        "namespace": "benchin",
        # A benchmark: Ray may store its secrets. The trivial POST baseline is off by
        # default (it is unauthenticated).
        "security": {"inline_secrets_in_ray": True, "benchmark_noop": True},
        "public_url": f"http://127.0.0.1:{port}",
        "pool": {"size": 2},
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
    settings = Settings.build(config)
    ray.init(
        address="local",  # a Ray of its own, even when others run on this machine
        num_cpus=2 * replicas,  # logical: each app's replicas ask for one CPU each
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "TORPOR_BENCH_REDIS": REDIS}},
    )
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(
        application(settings, start_reconciler=False, replicas=replicas),
        name="torpor",
        route_prefix="/",
    )
    # The same app with activation deferred to the reconciler's sweep (the backpressure
    # setting at 0), deployed beside it now: a redeploy between phases left the controller
    # busy (seconds of CPU) while the next phase ran.
    serve.run(
        application(
            Settings.build({**config, "max_inflight_activations": 0}),
            start_reconciler=False,
            replicas=replicas,
            route_prefix="/deferred",
        ),
        name="deferred",
        route_prefix="/deferred",
    )
    base = f"http://127.0.0.1:{port}"

    services = open_services(settings)
    control = SessionService(services, RayActivator(services))
    gate = asyncio.Semaphore(32)

    async def one(i: int) -> str:
        async with gate:
            return (await control.submit(tenant="bench", agent="bench", input={"i": i})).session_id

    passes = 2 if sender_nice is None else 3  # one-at-a-time passes, seq_n sessions each
    ids = list(await asyncio.gather(*(one(i) for i in range(2 * sessions + passes * seq_n))))

    async def all_in(wanted: list[str], state: SessionState) -> None:
        while True:
            states = await services.index.session_states(wanted)
            if len(states) == len(wanted) and all(s is state for s in states.values()):
                return
            await asyncio.sleep(0.2)

    await all_in(ids, SessionState.SUSPENDED)
    await asyncio.sleep(2)  # the last suspends bind their waits after committing
    cids = [(await services.snapshots.load(sid)).waits[0].correlation_id for sid in ids]

    # Phase 0: one webhook at a time, each resuming its session (pooled): the latencies.
    seq_ids = ids[2 * sessions :]
    seq_cids = cids[2 * sessions :]
    # After the deploys' own CPU has settled (the controller's health checks after
    # ``serve.run``): one webhook at a time measures the path, not what shares the cores.
    settle()
    seq = idle = ahead = None
    recording = OffCpuRecording(offcpu) if offcpu and seq_n else None
    if recording is not None:
        recording.start()
    pinned = pin_apart(edge=pin == "apart") if pin else None
    try:
        if seq_n:
            pairs = list(zip(seq_ids, seq_cids, strict=True))
            others = cids[sessions:]  # the deferring app's sessions: one webhook each here
            seq = sequential(base, pairs[:seq_n], deferred=others[:seq_n], samples=samples)
            state_key = services.index.keys.session_state  # type: ignore[attr-defined]
            idle = sequential(base, pairs[seq_n : 2 * seq_n], state_key=state_key, samples=samples)
            try:
                ahead = (
                    None
                    if sender_nice is None
                    else sequential(
                        base,
                        pairs[2 * seq_n :],
                        deferred=others[seq_n : 2 * seq_n],
                        state_key=state_key,
                        sender_nice=sender_nice,
                        samples=samples,
                    )
                )
            except PermissionError:  # raising a thread's priority needs CAP_SYS_NICE
                ahead = {"refused": True}
    finally:
        if pinned is not None:
            unpin(pinned)
    recorded = recording.stop() if recording is not None else None

    lua = tmp / "bench.lua"
    lua.write_text(WRK_LUA)
    settle()
    health = wrk(base + "/healthz", lua, duration_s, None, method="GET")
    cpu0 = cpu_by_process()
    noop = wrk(base + "/v1/noop", lua, duration_s, None)
    noop["cpu"] = cpu_share(cpu0, cpu_by_process(), noop["requests"])

    # Phase 1: every accepted webhook resumes its session right away, on this same
    # 2-core machine (pool hosts share the CPUs with the proxy and the replica).
    first = tmp / "first.tsv"
    write_requests(first, cids[:sessions])
    spies = profile_pool(profile_pool_out, min(duration_s, resume_s)) if profile_pool_out else []
    cpu0 = cpu_by_process()
    # Each webhook resumes its session once: a second round of the same requests would
    # be cheap 409 replays, so this phase is kept short enough not to run out of unique
    # ones (its figure is flagged invalid if it did: non-2xx above 0).
    full = wrk(base + "/v1/hooks/bench", lua, min(duration_s, resume_s), first)
    full["cpu"] = cpu_share(cpu0, cpu_by_process(), full["requests"])
    for spy_on_pool in spies:
        try:
            spy_on_pool.wait(timeout=60)
        except subprocess.TimeoutExpired:
            spy_on_pool.kill()  # its samples are lost; the run's figures are not

    # Phase 2: activation deferred: what the verify → dedupe → inbox → 202 path costs
    # alone. Several distinct events per session, so a fast proxy cannot run out of
    # unique ones.
    second = tmp / "second.tsv"
    write_requests(second, cids[sessions:], per_session=6)
    settle()
    spy = profile_replica(profile, duration_s, "ServeReplica:deferred") if profile else None
    cpu0 = cpu_by_process()
    accept_only = wrk(base + "/deferred/v1/hooks/bench", lua, duration_s, second)
    accept_only["cpu"] = cpu_share(cpu0, cpu_by_process(), accept_only["requests"])
    if spy is not None:
        spy.wait(timeout=60)

    # Which way each app's replica took its webhooks (its /healthz says).
    edge = {
        app: edge_report(base + path) for app, path in (("torpor", ""), ("deferred", "/deferred"))
    }
    await services.close()
    serve.shutdown()
    ray.shutdown()
    client = redis.Redis.from_url(REDIS)
    for key in client.scan_iter(match=prefix + "*", count=1000):
        client.delete(key)
    return {
        "proxy": proxy,
        "noop": noop,
        "health": health,
        "full": full,
        "accept": accept_only,
        "unique": {"full": sessions, "accept": 6 * sessions},
        "sequential": seq,
        "idle": idle,
        "ahead": ahead,
        "sender_nice": sender_nice,
        "offcpu": recorded,
        "edge": edge,
        "pinned_threads": None if pinned is None else len(pinned),
    }


def edge_report(app_url: str) -> dict[str, Any]:
    """What the app's /healthz says of its webhook path (``torpor.entry.hooks``)."""
    with urllib.request.urlopen(app_url + "/healthz", timeout=10) as answer:
        report: dict[str, Any] = json.loads(answer.read()).get("ingress", {})
    return report


def main() -> None:
    global SETTLE_S
    parser = argparse.ArgumentParser()
    parser.add_argument("--proxy", choices=["default", "haproxy", "both"], default="both")
    parser.add_argument("--duration", type=int, default=10)
    parser.add_argument("--sessions", type=int, default=3000, help="unique webhooks per phase")
    parser.add_argument("--sequential", type=int, default=300, help="one-at-a-time webhooks")
    parser.add_argument(
        "--profile",
        help="py-spy the replica in the accept phase into this .svg (or .txt; a name with"
        " .gil. in it: only the thread holding the GIL)",
    )
    parser.add_argument("--replicas", type=int, default=1, help="ingress replicas per app")
    parser.add_argument(
        "--serve-wrapped",
        action="store_true",
        help="webhooks through Serve's per-request wrappers, as before torpor took them"
        " in the replica's server (HAProxy only; for a comparison)",
    )
    parser.add_argument(
        "--settle-s",
        type=float,
        default=SETTLE_S,
        help="how long each phase may wait for Ray's processes to go quiet before it starts"
        " (0: not at all, for a run that only checks the phases work)",
    )
    parser.add_argument(
        "--resume-duration",
        type=int,
        default=4,
        help="seconds of the resuming phase (its unique webhooks must last that long)",
    )
    parser.add_argument(
        "--sender-nice",
        type=int,
        help="one more one-at-a-time pass, into an idle system, the sender at this niceness"
        " (e.g. -10: a stand-in for a sender on another machine; needs CAP_SYS_NICE)",
    )
    parser.add_argument(
        "--samples",
        help="append each one-at-a-time webhook's figures to this file (JSON lines, with"
        " the CLOCK_MONOTONIC ms it was sent at; bench/tails.py reads them)",
    )
    parser.add_argument(
        "--offcpu",
        help="record every context switch with its stack (perf) while the one-at-a-time"
        " passes run, into this file; bench/offcpu.py reads it (needs perf and tracefs)",
    )
    parser.add_argument(
        "--pin",
        choices=["apart", "pool"],
        help="for the one-at-a-time passes, the pool hosts on CPU 1 and (apart) the edge"
        " (HAProxy, replicas) on CPU 0 (an experiment: does the 202 wait for a core?)",
    )
    parser.add_argument(
        "--profile-pool",
        help="py-spy every pool host in the resuming phase: collapsed stacks into"
        " <this>.<pid>.txt each (bench/spy_shares.py reads them); the phase's figures"
        " then pay for the sampling",
    )
    parser.add_argument("--child", action="store_true")
    args = parser.parse_args()
    SETTLE_S = args.settle_s
    if args.child:
        result = asyncio.run(
            child(
                args.proxy,
                args.duration,
                args.sessions,
                args.sequential,
                args.profile,
                args.replicas,
                args.resume_duration,
                args.sender_nice,
                args.samples,
                args.offcpu,
                args.pin,
                args.profile_pool,
            )
        )
        print("JSON " + json.dumps(result), flush=True)
        return
    proxies = ["default", "haproxy"] if args.proxy == "both" else [args.proxy]
    failed = False
    if args.offcpu:
        # Before minutes of setup: perf, and the scheduler's tracepoint it records.
        events = ("/sys/kernel/tracing", "/sys/kernel/debug/tracing")
        if shutil.which("perf") is None or not any(
            Path(root, "events/sched/sched_switch").exists() for root in events
        ):
            sys.exit(
                "--offcpu needs perf (apt-get install linux-perf) and tracefs mounted"
                " (mount -t tracefs nodev /sys/kernel/tracing)"
            )
    for proxy in proxies:
        # Each replica runs the app on its own loop, as `torpor serve` has it.
        env = {**os.environ, "PYTHONPATH": str(ROOT), USER_LOOP: os.environ.get(USER_LOOP, "0")}
        if proxy == "haproxy":
            env["RAY_SERVE_ENABLE_HA_PROXY"] = "1"
            # As `torpor serve` has it (``choose_ingress``): webhooks before Serve's wrappers.
            if not args.serve_wrapped:
                env.setdefault(SERVER_MIDDLEWARES, HOOKS_FIRST)
        started = time.perf_counter()
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--child",
                "--proxy",
                proxy,
                "--duration",
                str(args.duration),
                "--sessions",
                str(args.sessions),
                "--sequential",
                str(args.sequential),
                *(["--profile", str(Path(args.profile).resolve())] if args.profile else []),
                "--replicas",
                str(args.replicas),
                "--settle-s",
                str(args.settle_s),
                "--resume-duration",
                str(args.resume_duration),
                *(["--sender-nice", str(args.sender_nice)] if args.sender_nice is not None else []),
                *(["--samples", str(Path(args.samples).resolve())] if args.samples else []),
                *(["--offcpu", offcpu_file(args.offcpu, proxy, proxies)] if args.offcpu else []),
                *(["--pin", args.pin] if args.pin else []),
                *(
                    ["--profile-pool", offcpu_file(args.profile_pool, proxy, proxies)]
                    if args.profile_pool
                    else []
                ),
            ],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
        line = next((x for x in out.stdout.splitlines() if x.startswith("JSON ")), None)
        if line is None:
            print(f"{proxy}: failed\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
            continue
        r = json.loads(line[5:])
        noop, health = r["noop"], r["health"]
        print(
            f"{proxy}: trivial POST (body received, ignored) {noop['rps']:.0f} req/s, "
            f"p50 {noop['p50_ms']:.1f} ms, p99 {noop['p99_ms']:.1f} ms; trivial GET "
            f"{health['rps']:.0f} req/s ({time.perf_counter() - started:.0f} s)"
        )
        print(f"  CPU ms per trivial POST by process: {noop['cpu']}")
        taking = {app: bool(e.get("webhooks_before_serve")) for app, e in r["edge"].items()}
        print(
            "  webhooks answered before Serve's per-request wrappers (each app's /healthz): "
            + ", ".join(f"{app} app {'yes' if on else 'no'}" for app, on in taking.items())
        )
        if proxy == "haproxy" and not args.serve_wrapped and not all(taking.values()):
            # torpor serve's path under HAProxy: a run that did not take it measured
            # something else (the replica lost its middleware, or the route its binding).
            failed = True
            print("  FAILED: an app's server does not take webhooks before Serve", flush=True)
        targets = {"accept": 50, "full": 25} if proxy == "haproxy" else {}
        for phase, label in (
            ("accept", "webhook -> 202, activation deferred"),
            ("full", "webhook -> 202, each resumes its session"),
        ):
            h = r[phase]
            target = f" [target >= {targets[phase]}%]" if phase in targets else ""
            if h["non_2xx"]:  # replays or failures are not the path this phase measures
                target += " INVALID: non-2xx answers (too few unique webhooks, or errors)"
            print(
                f"  {label}: {h['rps']:.0f} req/s ({100 * h['rps'] / noop['rps']:.0f}% of "
                f"trivial){target}, p50 {h['p50_ms']:.1f} ms, p99 {h['p99_ms']:.1f} ms, "
                f"non-2xx {h['non_2xx']}/{h['requests']} (unique {r['unique'][phase]})",
                flush=True,
            )
            if "cpu" in h:
                print(f"    CPU ms per webhook by process: {h['cpu']}")
        if r["sequential"]:
            q = r["sequential"]
            aims = (
                (" [target <= 2.5]", " [target p50 <= 5, p99 <= 10]")
                if proxy == "haproxy"
                else ("", "")
            )
            print(
                f"  one at a time (n={q['n']}), the next sent at the step stamp: trivial POST"
                f" p50 {q['trivial_p50']:.1f} ms; "
                f"POST -> 202 p50 {q['accept_p50']:.1f} ms"
                f"{aims[0]}, p99 {q['accept_p99']:.1f} ms; POST -> agent step p50 "
                f"{q['step_p50']:.1f} ms, p99 {q['step_p99']:.1f} ms{aims[1]}",
                flush=True,
            )
            if r.get("idle"):
                q2 = r["idle"]
                print(
                    f"    each into an idle system (the next sent once the session before"
                    f" has ended): POST -> 202 p50 {q2['accept_p50']:.1f} ms{aims[0]}, p99"
                    f" {q2['accept_p99']:.1f} ms; POST -> agent step p50 {q2['step_p50']:.1f}"
                    f" ms, p99 {q2['step_p99']:.1f} ms{aims[1]}",
                    flush=True,
                )
            q3 = r.get("ahead")
            if q3 and q3.get("refused"):
                print("    (the sender's priority could not be raised: no CAP_SYS_NICE)")
            elif q3:
                print(
                    f"    the same, the sender at nice {r['sender_nice']} (ahead of the"
                    f" server's processes on the cores, as a sender on another machine):"
                    f" trivial POST p50 {q3['trivial_p50']:.1f} ms; POST -> 202 p50"
                    f" {q3['accept_p50']:.1f} ms{aims[0]}, p99 {q3['accept_p99']:.1f} ms;"
                    f" POST -> agent step p50 {q3['step_p50']:.1f} ms, p99"
                    f" {q3['step_p99']:.1f} ms{aims[1]}; activation deferred p50"
                    f" {q3['alone_p50']:.1f} ms",
                    flush=True,
                )
            if q.get("alone_p50") is not None:
                print(
                    f"    POST -> 202 with activation deferred (no session resuming beside"
                    f" it): p50 {q['alone_p50']:.1f} ms, p99 {q['alone_p99']:.1f} ms",
                    flush=True,
                )
        if r.get("pinned_threads") is not None:
            print(
                f"  the one-at-a-time passes ran pinned ({args.pin}): {r['pinned_threads']}"
                " threads"
                + (" of the edge on CPU 0," if args.pin == "apart" else "")
                + " of the pool hosts on CPU 1",
                flush=True,
            )
        if r.get("offcpu"):
            print(f"  {r['offcpu']}", flush=True)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
