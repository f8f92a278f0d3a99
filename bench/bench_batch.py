"""Batch benchmark: a document set through the 202, the fan-out and the admission cap.

    .venv/bin/python bench/bench_batch.py                          # 1,000 documents, dedicated
    .venv/bin/python bench/bench_batch.py --n 10000 --placement pooled

On a local Ray, the machine's Redis and a local folder (so the figures are torpor's, not a
network store's). It measures:

* the time to the 202: parsing the request body (10,000 documents) and ``accept`` (the
  documents and the manifest written, the fan-out timer set) — what ``POST /v1/batches``
  does before it answers (the Serve proxy adds its ~3 ms);
* the time until every session is SUSPENDED (fan-out + activations + admission queue),
  sampling the RUNNING sessions in the registry and the live session actors in Ray;
* Redis and object-store bytes per (sleeping) session.

The agent is ``bench.plugins:BenchAgent``: one long-running tool, then it sleeps. The
sweeper runs in this process every 0.2 s (it wakes the admission queue's heads).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
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
from storage.local_store import LocalObjectStore  # noqa: E402
from torpor.api import BatchCreate  # noqa: E402
from torpor.service.batches import BatchService  # noqa: E402
from torpor.service.sessions import SessionService  # noqa: E402
from torpor.service.sweeper import Sweeper  # noqa: E402
from torpor.settings import Settings  # noqa: E402

REDIS = os.environ.get("TORPOR_BENCH_REDIS", "redis://127.0.0.1:6379/0")
PREFIX = "torpor-bench-batch:"


def settings_for(tmp: Path, placement: str, cap: int, namespace: str) -> Settings:
    return Settings.build(
        {
            "storage": {
                "object_store_url": f"file://{tmp / 'objects'}",
                "index_url": REDIS,
                "redis_prefix": f"{PREFIX}{namespace}:",
            },
            "namespace": namespace,
            "pool": {"size": 2},
            "batches": {"max_running_per_batch": cap, "max_running_per_tenant": cap * 4},
            "runtime": {"max_live_session_actors": cap * 4},
            "agents": {
                "bench": {
                    "factory": "bench.plugins:BenchAgent",
                    "tools": ["bench.plugins:WaitForWorld"],
                    "placement": placement,
                }
            },
        }
    )


def live_session_actors(namespace: str) -> int:
    from ray.util import list_named_actors

    return sum(
        1
        for a in list_named_actors(all_namespaces=True)
        if a["namespace"] == namespace and a["name"].startswith("session:")
    )


def redis_bytes(prefix: str) -> tuple[int, int]:
    client = redis.Redis.from_url(REDIS)
    total, keys = 0, 0
    for key in client.scan_iter(match=prefix + "*", count=2000):
        total += int(client.memory_usage(key, samples=0) or 0)  # type: ignore[arg-type]
        keys += 1
    client.close()
    return total, keys


def folder_bytes(root: Path) -> tuple[int, int]:
    files = [p for p in root.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files), len(files)


class NoActivation:
    """``--accept-only``: nothing is activated (and no Ray is started)."""

    async def request(self, session_id: str, *, reason: Any, agent: str | None = None) -> None:
        return None


async def accept_only(args: argparse.Namespace) -> dict[str, Any]:
    """Only the 202 path, ``--rounds`` times: no Ray, no fan-out."""
    documents = [{"doc": f"DOC-{i:05d}", "amount": float(i % 997)} for i in range(args.n)]
    body = json.dumps({"agent": "bench", "documents": documents}).encode()
    times = []
    with tempfile.TemporaryDirectory() as tmp:
        settings = settings_for(Path(tmp), args.placement, args.cap, f"ba{os.getpid()}")
        services = open_services(settings)
        batches = BatchService(SessionService(services, NoActivation()))
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            request = BatchCreate.model_validate_json(body)
            await batches.accept(tenant="acme", agent=request.agent, documents=request.documents)
            times.append(time.perf_counter() - t0)
        o_bytes, _ = folder_bytes(LocalObjectStore.objects_in(Path(tmp) / "objects"))
        await services.close()
        client = redis.Redis.from_url(REDIS)
        for key in client.scan_iter(match=settings.storage.redis_prefix + "*", count=2000):
            client.delete(key)
        client.close()
    times.sort()
    return {
        "documents": args.n,
        "request_bytes": len(body),
        "to_202_s_median": round(times[len(times) // 2], 3),
        "to_202_s_max": round(times[-1], 3),
        "stored_bytes_per_batch": o_bytes // args.rounds,
    }


async def run(args: argparse.Namespace, tmp: str) -> dict[str, Any]:
    namespace = f"bb{os.getpid()}"
    documents = [{"doc": f"DOC-{i:05d}", "amount": float(i % 997)} for i in range(args.n)]
    body = json.dumps({"agent": "bench", "documents": documents}).encode()
    settings = settings_for(Path(tmp), args.placement, args.cap, namespace)
    services = open_services(settings)
    control = SessionService(services, RayActivator(services), background=True)
    batches = BatchService(control)
    sweeper = Sweeper(control)

    # -- the 202 ----------------------------------------------------------------------
    t0 = time.perf_counter()
    request = BatchCreate.model_validate_json(body)
    manifest = await batches.accept(tenant="acme", agent=request.agent, documents=request.documents)
    to_202 = time.perf_counter() - t0

    # -- fan-out and admission until every session sleeps ------------------------------
    t0 = time.perf_counter()
    batches.start_fan_out(manifest.batch_id)
    ids = manifest.sessions()
    peak_running = peak_actors = 0
    fanned_out_s: float | None = None
    last_print = 0.0
    sweeping = True

    async def sweep() -> None:
        while sweeping:
            await sweeper.sweep_once()
            await asyncio.sleep(0.2)

    sweeper_task = asyncio.create_task(sweep())
    while True:
        states = await services.index.session_states(ids)
        counts: dict[str, int] = {}
        for state in states.values():
            counts[state.value] = counts.get(state.value, 0) + 1
        peak_running = max(peak_running, counts.get("RUNNING", 0))
        if args.placement == "dedicated":
            peak_actors = max(peak_actors, live_session_actors(namespace))
        if fanned_out_s is None and not batches._fan_outs:
            fanned_out_s = time.perf_counter() - t0
        now = time.perf_counter() - t0
        if now - last_print > 10:
            last_print = now
            print(f"  {now:6.0f} s {counts}", flush=True)
        if counts.get("SUSPENDED", 0) == args.n:
            break
        if now > args.timeout_s:
            raise SystemExit(f"not all suspended after {args.timeout_s} s: {counts}")
        await asyncio.sleep(0.25)
    all_suspended = time.perf_counter() - t0
    sweeping = False
    await sweeper_task
    await control.drain()

    # -- footprint --------------------------------------------------------------------
    r_bytes, r_keys = redis_bytes(settings.storage.redis_prefix)
    o_bytes, o_files = folder_bytes(LocalObjectStore.objects_in(Path(tmp) / "objects"))
    await services.close()
    client = redis.Redis.from_url(REDIS)
    for key in client.scan_iter(match=settings.storage.redis_prefix + "*", count=2000):
        client.delete(key)
    client.close()
    return {
        "documents": args.n,
        "placement": args.placement,
        "cap": args.cap,
        "request_bytes": len(body),
        "to_202_s": round(to_202, 3),
        "fan_out_s": None if fanned_out_s is None else round(fanned_out_s, 1),
        "all_suspended_s": round(all_suspended, 1),
        "sessions_per_s": round(args.n / all_suspended, 1),
        "peak_running": peak_running,
        "peak_live_session_actors": peak_actors if args.placement == "dedicated" else None,
        "redis_bytes_per_session": round(r_bytes / args.n),
        "redis_keys": r_keys,
        "object_bytes_per_session": round(o_bytes / args.n),
        "objects": o_files,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=1000, help="documents in the batch")
    parser.add_argument("--placement", choices=["dedicated", "pooled"], default="dedicated")
    parser.add_argument("--cap", type=int, default=16, help="max_running_per_batch")
    parser.add_argument("--timeout-s", type=float, default=7200)
    parser.add_argument("--accept-only", action="store_true", help="only the 202 path, no Ray")
    parser.add_argument("--rounds", type=int, default=5, help="batches accepted (--accept-only)")
    args = parser.parse_args()
    if args.accept_only:
        print(json.dumps(asyncio.run(accept_only(args)), indent=2))
        return
    # The store's folder outlives Ray: the session actors and pool hosts keep it open
    # until ``ray.shutdown`` ends them (a store that closes moves its kept files into the
    # folder), and a folder removed before that raced their last writes into it.
    with tempfile.TemporaryDirectory() as tmp:
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "TORPOR_BENCH_REDIS": REDIS}},
        )
        try:
            result = asyncio.run(run(args, tmp))
        finally:
            ray.shutdown()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
