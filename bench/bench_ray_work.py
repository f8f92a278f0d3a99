"""Ray work tool vs webhook: time from the work's completion to the agent's next step.

    .venv/bin/python bench/bench_ray_work.py [--sessions 40]

Two agents with one long-running call each, in one Ray instance, one run, alternating:

* ``ray``: the call's work is a Ray task (``actors.ray_work``); the task records the
  wall-clock time as its last act, its watcher writes the answer into the session's
  inbox and asks for an activation;
* ``webhook``: the same call answered by a signed webhook (torpor scheme) through the
  webhook gateway, in this process (the HTTP edge's own cost is ``bench_ingress.py``'s);
  "completion" is the moment the webhook is signed.

Both end when the next agent step begins (it records its wall-clock time in Redis).
Storage: local folder + the machine's Redis, dedicated placement (a fresh session actor
per activation in both cases).
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
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import ray  # noqa: E402
import redis  # noqa: E402

from actors.ray_activator import RayActivator  # noqa: E402
from actors.wiring import open_services  # noqa: E402
from torpor.lifecycle import SessionState  # noqa: E402
from torpor.models import DispatchStatus  # noqa: E402
from torpor.service.gateway import WebhookGateway  # noqa: E402
from torpor.service.sessions import SessionService  # noqa: E402
from torpor.settings import Settings  # noqa: E402
from torpor.webhooks.signing import Scheme, generate_secret, sign  # noqa: E402

REDIS = os.environ.get("TORPOR_BENCH_REDIS", "redis://127.0.0.1:6379/0")
PREFIX = "torpor-bench:"
SECRET = generate_secret(Scheme.TORPOR)
# Named by reference, never inline: actors read it from their (inherited) environment.
os.environ["TORPOR_BENCH_WORK_SECRET"] = SECRET


def settings_for(tmp: Path, namespace: str) -> Settings:
    def agent(path: str, tool: str, tag: str) -> dict[str, Any]:
        return {
            "factory": "bench.plugins:OneCallAgent",
            "options": {"tool": tool, "tag": tag},
            "tools": [f"bench.plugins:{path}"],
        }

    return Settings.build(
        {
            "storage": {
                "object_store_url": f"file://{tmp / 'objects'}",
                "index_url": REDIS,
                "redis_prefix": PREFIX + namespace + ":",
            },
            "namespace": namespace,
            "agents": {
                "ray": agent("ray_work", "ray_work", "ray"),
                "webhook": agent("WebhookWork", "webhook_work", "webhook"),
            },
            "sources": {
                "work": {
                    "tenant": "acme",
                    "scheme": "torpor",
                    "secrets": ["env:TORPOR_BENCH_WORK_SECRET"],
                    "mapping": {
                        "event_id_path": "eventId",
                        "type_path": "eventType",
                        "correlation_id_path": "correlationId",
                        "data_path": "result",
                    },
                }
            },
        }
    )


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def stamps(r: redis.Redis, key: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for raw in r.lrange(key, 0, -1):
        sid, at = raw.decode().split()
        out[sid] = float(at)
    return out


async def until(predicate: Any, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("the bench stalled")
        await asyncio.sleep(0.01)


async def until_suspended(services: Any, sid: str, timeout_s: float = 120.0) -> None:
    """Until the wait's request went out: by then its correlation id is bound."""
    deadline = time.monotonic() + timeout_s
    while not await _dispatched(services, sid):
        if time.monotonic() > deadline:
            raise TimeoutError("the bench stalled")
        await asyncio.sleep(0.01)


async def _dispatched(services: Any, sid: str) -> bool:
    snap = await services.snapshots.load(sid)
    return snap.state is SessionState.SUSPENDED and any(
        e.status is DispatchStatus.DISPATCHED for e in snap.outbox
    )


async def run(sessions: int, tmp: str) -> dict[str, Any]:
    r = redis.Redis.from_url(REDIS)
    for key in ("steps:ray", "steps:webhook", "done:ray"):
        r.delete(PREFIX + key)
    namespace = "bench-work-" + os.urandom(3).hex()
    settings = settings_for(Path(tmp), namespace)
    services = open_services(settings)
    control = SessionService(services, RayActivator(services))
    gateway = WebhookGateway(control)
    ray_lat: list[float] = []
    hook_lat: list[float] = []
    try:
        for i in range(sessions):
            # The Ray tool: submit, the work runs and answers by itself.
            sid = (await control.submit(tenant="acme", agent="ray", input=i)).session_id
            await until(lambda s=sid: s in stamps(r, PREFIX + "steps:ray"))
            done = stamps(r, PREFIX + "done:ray")[sid]
            ray_lat.append(stamps(r, PREFIX + "steps:ray")[sid] - done)
            # The webhook: submit, wait until suspended, then answer it.
            sid = (await control.submit(tenant="acme", agent="webhook", input=i)).session_id

            await until_suspended(services, sid)
            wait = (await services.snapshots.load(sid)).waits[0]
            raw = json.dumps(
                {
                    "eventId": f"e-{sid}",
                    "eventType": "work.done",
                    "correlationId": wait.correlation_id,
                    "result": {"ok": True},
                }
            ).encode()
            completed = time.time()
            headers = {
                **sign(Scheme.TORPOR, raw, SECRET, now=services.clock.now()),
                "Content-Type": "application/json",
            }
            answer = await gateway.receive("work", raw, headers, now=services.clock.now())
            status = answer.status
            assert status == 202, status
            await until(lambda s=sid: s in stamps(r, PREFIX + "steps:webhook"))
            hook_lat.append(stamps(r, PREFIX + "steps:webhook")[sid] - completed)
            print(f"{i}: ray {ray_lat[-1]:.3f} s, webhook {hook_lat[-1]:.3f} s", file=sys.stderr)
    finally:
        await control.drain()
        await services.close()
        # This run's index and step stamps: nothing of it stays in Redis.
        for key in r.scan_iter(match=f"{PREFIX}{namespace}:*", count=1000):
            r.delete(key)
        for key in ("steps:ray", "steps:webhook", "done:ray"):
            r.delete(PREFIX + key)

    def summary(values: list[float]) -> dict[str, float]:
        return {
            "p50_ms": round(1000 * statistics.median(values), 1),
            "p99_ms": round(1000 * percentile(values, 0.99), 1),
            "max_ms": round(1000 * max(values), 1),
        }

    return {
        "sessions": sessions,
        "ray_task_tool": summary(ray_lat),
        "webhook": summary(hook_lat),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sessions", type=int, default=40)
    args = parser.parse_args()
    # The store's folder outlives Ray: the pool hosts and work watchers keep it open until
    # ``ray.shutdown`` ends them (a store that closes moves its kept files into the
    # folder), and a folder removed before that raced their last writes into it.
    with tempfile.TemporaryDirectory() as tmp:
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "TORPOR_BENCH_REDIS": REDIS}},
        )
        try:
            result = asyncio.run(run(args.sessions, tmp))
        finally:
            ray.shutdown()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
