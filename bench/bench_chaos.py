"""Chaos benchmark: many webhook deliveries under faults; nothing lost, nothing twice.

    .venv/bin/python bench/bench_chaos.py                    # 1,100 sessions, ~10,700 deliveries
    .venv/bin/python bench/bench_chaos.py --sessions 100     # a quick end-to-end run

Sessions of the test agent ``purchase`` (extract, then ask the OA system for approval and
wait) run on pooled Ray hosts. The driver plays the OA system: it answers each request
through the ``WebhookGateway`` in-process (the same code the Serve app runs), signed with
the torpor scheme, and also sends what real senders send under faults:

* duplicates: the same event freshly signed again (a sender's retry), shuffled with the
  originals so some arrive first;
* stale and reordered answers: a ``drift`` answer makes a share of the sessions re-plan (a
  new wait, epoch 2, same business key); then the *first* request's late ``rejected``
  answer arrives addressed by business key only; every session also gets late answers to
  its closed wait after it ended (by correlation id and by business key);
* forged (wrong secret) and replayed (byte-identical copy of an accepted request) ones.

Meanwhile a pool host is killed (twice), the reconciler (a separate process running the
sweeper) is killed -9 and restarted, the index (this run's Redis prefix) is flushed, and
the object store (the S3 test server behind ``tests/support/fault_proxy.py``) answers
503 bursts and loses the answers of conditional PUTs that committed.

It prints sessions lost, duplicate side effects, stale writes applied and forged or
replayed requests accepted (each must be 0) and the time to drain.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

REDIS = os.environ.get("TORPOR_BENCH_REDIS", "redis://127.0.0.1:6379/0")
SECRET = "c" * 64
FORGED_SECRET = "f" * 64
BUCKET = "chaos"

RECONCILER = """
import asyncio, json, logging, sys
import ray
from actors.ray_activator import RayActivator
from actors.wiring import open_services
from torpor.service.sessions import SessionService
from torpor.service.sweeper import Sweeper
from torpor.settings import Settings

async def main() -> None:
    settings = Settings.build(json.loads(sys.argv[1]))
    ray.init(address=sys.argv[2], namespace=settings.namespace, log_to_driver=False)
    services = open_services(settings)
    sweeper = Sweeper(SessionService(services, RayActivator(services), background=True))
    while True:
        try:
            await sweeper.sweep_once()
        except Exception:  # the bench's runner keeps sweeping whatever one sweep did
            logging.exception("sweep failed")
        await asyncio.sleep(settings.reconciler.interval_s)

asyncio.run(main())
"""


@dataclass
class Tally:
    sent: Counter[str] = field(default_factory=Counter)  # deliveries by kind
    statuses: Counter[tuple[str, int]] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)  # 5xx answers by error class
    retries: int = 0
    accepted_bad: int = 0  # forged or replayed answered 202
    absorbed_replays: int = 0  # replays answered 200 duplicate (absorbed, not applied)


class Chaos:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.tally = Tally()
        self.prefix = f"tpchaos:{secrets.token_hex(3)}:"
        self.tmp = Path(tempfile.mkdtemp(prefix="torpor-chaos-"))
        self.reconciler: subprocess.Popen[bytes] | None = None
        self.t0 = time.monotonic()
        self.chaos_log: list[str] = []  # what was done to the system, and when
        self.stuck: set[str] = set()  # errors a delivery kept getting, said once each

    def note(self, what: str) -> None:
        self.chaos_log.append(f"{time.monotonic() - self.t0:6.1f}s {what}")
        print(self.chaos_log[-1], flush=True)

    # -- set-up ---------------------------------------------------------------------------

    def config(self, s3_endpoint: str, s3: dict[str, str]) -> dict[str, Any]:
        from tests.support.tools import agent_config

        agents = agent_config(REDIS, self.prefix, placement="pooled", expected_s=86400)
        return {
            "namespace": f"chaos{secrets.token_hex(2)}",
            "security": {"inline_secrets_in_ray": True},  # a benchmark: Ray may store them
            "storage": {
                "object_store_url": f"s3://{BUCKET}/run",
                "index_url": REDIS,
                "redis_prefix": self.prefix,
                "s3": {**s3, "endpoint_url": s3_endpoint},
            },
            "pool": {"size": self.args.pool},
            "lease": {"ttl_s": 6.0, "heartbeat_s": 2.0},
            "reconciler": {"interval_s": 1.0, "wake_grace_s": 5.0},
            "sources": {
                "oa": {
                    "tenant": "acme",
                    "scheme": "torpor",
                    "secrets": [SECRET],
                    "tolerance_s": 900.0,  # late replays are refused as replays, not as old
                    "mapping": {
                        "event_id_path": "id",
                        "default_type": "oa.approval.decided",
                        "correlation_id_path": "correlationId",
                        "business_key_path": "doc",
                    },
                }
            },
            "agents": agents,
        }

    def start_reconciler(self) -> None:
        import ray

        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        address = ray.get_runtime_context().gcs_address
        self.reconciler = subprocess.Popen(
            [sys.executable, "-c", RECONCILER, json.dumps(self.raw_config), address],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=open(self.tmp / "reconciler.log", "ab"),  # noqa: SIM115
        )

    def kill_reconciler(self) -> None:
        assert self.reconciler is not None
        os.kill(self.reconciler.pid, signal.SIGKILL)
        self.reconciler.wait()
        self.note(f"reconciler pid {self.reconciler.pid} killed -9")

    async def kill_pool_host(self, slot: int) -> None:
        import ray

        from actors.pool import host_name

        # A host being made again (after an earlier death: ``_check_host`` makes a new
        # one when the old does not answer) is briefly not found by name: looked up
        # again for a while, and, if it stays away, noted instead of ending the run (a
        # CI run under load hit it once in three).
        deadline = time.monotonic() + 10.0
        while True:
            try:
                host = ray.get_actor(host_name(slot), namespace=self.raw_config["namespace"])
                break
            except ValueError:
                if time.monotonic() > deadline:
                    self.note(f"pool host {slot} not found by name: not killed")
                    return
                await asyncio.sleep(0.2)
        ray.kill(host, no_restart=False)  # Ray restarts it, as after a node loss
        self.note(f"pool host {slot} killed")

    async def flush_index(self) -> int:
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(REDIS)
        keys = [k async for k in client.scan_iter(match=f"{self.prefix}*", count=1000)]
        # Keep the simulated OA world: it is the external system, not torpor's index.
        keys = [k for k in keys if not k.decode().startswith(f"{self.prefix}world:")]
        for i in range(0, len(keys), 500):
            await client.delete(*keys[i : i + 500])
        await client.aclose()
        return len(keys)

    # -- sending --------------------------------------------------------------------------

    def signed(
        self, body: dict[str, Any], *, secret: str = SECRET, ago_s: int = 0
    ) -> tuple[bytes, dict[str, str]]:
        """Signed now (or ``ago_s`` earlier): a re-send signed at another second is a new
        signed content, not a byte-identical replay, as a real sender's retry would be."""
        from torpor.webhooks.signing import Scheme, sign

        raw = json.dumps(body).encode()
        at = datetime.now(UTC) - timedelta(seconds=ago_s)
        headers = sign(Scheme.TORPOR, raw, secret, now=at)
        return raw, {**headers, "Content-Type": "application/json"}

    async def post(self, kind: str, raw: bytes, headers: dict[str, str]) -> int:
        from torpor.errors import TorporError, WebhookRejected

        for attempt in range(60):
            try:
                result = await self.gateway.receive("oa", raw, headers, now=datetime.now(UTC))
                status = result.status
            except WebhookRejected as exc:
                status = exc.status
            except (TorporError, OSError) as exc:
                self.tally.errors[f"{type(exc).__name__}: {str(exc)[:80]}"] += 1
                said = f"{type(exc).__name__}: {exc}"[:300]
                if attempt >= 10 and said not in self.stuck:
                    # A sender refused this long is the run's story when it overruns: say
                    # what it keeps getting while it happens, not only in the last report
                    # (which a run cut off by its caller never prints). Once per error.
                    self.stuck.add(said)
                    self.note(f"a {kind} delivery refused {attempt} times, now: {said}")
                retryable = isinstance(exc, OSError) or getattr(exc, "retryable", True)
                status = getattr(exc, "status", 500)
                if retryable or attempt < 2:
                    # A real sender retries a 5xx later, freshly signed (same event id);
                    # a plain 500 only a few times.
                    self.tally.retries += 1
                    await asyncio.sleep(min(2.0, 0.05 * 2**attempt))
                    if kind not in {"forged", "replay"}:
                        raw, headers = self.signed(json.loads(raw))
                    continue
            self.tally.statuses[(kind, status)] += 1
            if kind in {"forged", "replay"} and status == 202:
                self.tally.accepted_bad += 1
            if kind == "replay" and status == 200:
                self.tally.absorbed_replays += 1
            return status
        self.tally.statuses[(kind, 599)] += 1
        return 599

    async def send_all(
        self, batch: list[tuple[str, bytes, dict[str, str]]], chaos: list[tuple[float, Any]]
    ) -> list[int]:
        gate = asyncio.Semaphore(self.args.concurrency)
        done = 0
        pending = sorted(chaos, key=lambda c: c[0])

        async def one(kind: str, raw: bytes, headers: dict[str, str]) -> int:
            nonlocal done
            async with gate:
                self.tally.sent[kind] += 1
                status = await self.post(kind, raw, headers)
                done += 1
                while pending and done >= pending[0][0] * len(batch):
                    _, action = pending.pop(0)
                    await action()
                return status

        return list(await asyncio.gather(*(one(*item) for item in batch)))

    # -- phases ---------------------------------------------------------------------------

    async def dispatched(
        self, docs: set[str], *, after: dict[str, str]
    ) -> dict[str, dict[str, Any]]:
        """The latest OA request per doc that reached the world, other than ``after``'s
        (the request keys seen before: a re-plan asks again under a higher epoch)."""
        found: dict[str, dict[str, Any]] = {}
        for key, entry in (await self.world.entries("dispatch")).items():
            doc = entry["doc"]
            if doc in docs and key != after.get(doc):
                epoch = int(key.rpartition(":")[2])
                if doc not in found or epoch > found[doc]["epoch"]:
                    found[doc] = {**entry, "key": key, "epoch": epoch}
        return found

    async def until(self, what: str, predicate: Any, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not await predicate():
            if time.monotonic() > deadline:
                raise SystemExit(f"timed out waiting for {what}: {await self.states()}")
            await asyncio.sleep(0.5)

    async def states(self) -> dict[str, int]:
        """Sessions by state, from their snapshots (the durable truth)."""
        found: Counter[str] = Counter()
        for sid in self.ids.values():
            try:
                found[(await self.services.snapshots.load(sid)).state.value] += 1
            except Exception as exc:  # the verdict counts it as lost
                found[type(exc).__name__] += 1
        return dict(found)

    async def run(self) -> dict[str, Any]:
        import ray

        from bench.stalls import watch

        watch(asyncio.get_running_loop())

        from actors.ray_activator import RayActivator
        from actors.wiring import open_services
        from tests.support.fault_proxy import FaultProxy, conditional_put
        from tests.support.s3_server import S3TestServer
        from tests.support.tools import World
        from torpor.service.gateway import WebhookGateway
        from torpor.service.sessions import SessionService
        from torpor.settings import Settings

        args = self.args
        server = S3TestServer().start()
        from tests.conftest import make_bucket

        make_bucket(server, BUCKET)
        proxy = FaultProxy(server.endpoint).start()
        boto = server.boto_kwargs()
        s3 = {
            "region": boto["region"],
            "access_key_id": boto["access_key_id"],
            "secret_access_key": boto["secret_access_key"],
        }
        self.raw_config = self.config(proxy.endpoint, s3)
        settings = Settings.build(self.raw_config)
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            namespace=settings.namespace,
            runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "TORPOR_BENCH_REDIS": REDIS}},
        )
        services = open_services(settings)
        sessions = SessionService(services, RayActivator(services), background=True)
        self.gateway = WebhookGateway(sessions)
        self.world = World(REDIS, self.prefix)
        self.start_reconciler()
        t0 = self.t0 = time.monotonic()

        n = args.sessions
        docs = [f"D{i:05d}" for i in range(n)]
        replan = set(self.rng.sample(docs, max(1, n * args.replan_pct // 100)))
        gate = asyncio.Semaphore(16)

        async def submit(doc: str) -> str:
            async with gate:
                made = await sessions.submit(
                    tenant="acme",
                    agent="purchase",
                    input={"doc": doc, "amount": 100.0},
                    idempotency_key=f"chaos-{doc}",
                )
                return made.session_id

        ids = dict(zip(docs, await asyncio.gather(*(submit(d) for d in docs)), strict=True))
        self.ids, self.services = ids, services
        everyone = set(docs)

        async def all_dispatched(wanted: set[str], after: dict[str, str]) -> bool:
            return len(await self.dispatched(wanted, after=after)) == len(wanted)

        await self.until(
            "every first request", lambda: all_dispatched(everyone, {}), args.wait_timeout_s
        )
        first = await self.dispatched(everyone, after={})
        first_keys = {doc: entry["key"] for doc, entry in first.items()}
        t_submitted = time.monotonic()
        print(f"{n} sessions waiting after {t_submitted - t0:.0f}s", flush=True)

        # Round 1: every first answer (drift for the re-plan share), duplicates, forgeries.
        batch: list[tuple[str, bytes, dict[str, str]]] = []
        originals: list[tuple[bytes, dict[str, str]]] = []
        for doc in docs:
            status = "drift" if doc in replan else "approved"
            body = {"id": f"a1-{doc}", "correlationId": first[doc]["correlation_id"],
                    "doc": doc, "status": status}  # fmt: skip
            raw, headers = self.signed(body)
            originals.append((raw, headers))
            batch.append(("original", raw, headers))
            batch += [
                ("duplicate", *self.signed(body, ago_s=k + 1)) for k in range(args.duplicates)
            ]
            batch.append(("forged", *self.signed(body, secret=FORGED_SECRET)))
        self.rng.shuffle(batch)  # duplicates overtake originals: reordered deliveries

        async def host0() -> None:
            await self.kill_pool_host(0)

        async def host1() -> None:
            await self.kill_pool_host(args.pool - 1)

        async def reconciler() -> None:
            self.kill_reconciler()
            self.start_reconciler()

        async def flush() -> None:
            self.note(f"index flushed ({await self.flush_index()} keys)")

        async def s3_faults() -> None:
            proxy.fail(503, "SlowDown", times=40)
            proxy.reset_after_commit(times=25, match=conditional_put)
            self.note("object store: 40 x 503 SlowDown, 25 conditional PUTs lose their answer")

        chaos = [(0.2, host0), (0.35, reconciler), (0.5, flush), (0.6, s3_faults), (0.8, host1)]
        await self.send_all(batch, chaos)
        print(f"round 1 sent after {time.monotonic() - t0:.0f}s", flush=True)

        # Round 2: the re-planned sessions ask again (epoch 2); the first request's late
        # answer arrives addressed by business key only, then the real answer.
        await self.until(
            "every re-plan", lambda: all_dispatched(replan, first_keys), args.wait_timeout_s
        )
        second = await self.dispatched(replan, after=first_keys)
        stale = [("stale", *self.signed({"id": f"late1-{d}", "doc": d, "status": "rejected"}))
                 for d in sorted(replan)]  # fmt: skip
        replays = [("replay", raw, headers) for raw, headers in originals]
        self.rng.shuffle(replays)
        await self.send_all(stale + replays[: len(replays) // 2], [(0.5, flush)])
        batch = []
        for doc in sorted(replan):
            body = {"id": f"a2-{doc}", "correlationId": second[doc]["correlation_id"],
                    "doc": doc, "status": "approved"}  # fmt: skip
            batch += [("original", *self.signed(body))]
            batch += [
                ("duplicate", *self.signed(body, ago_s=k + 1)) for k in range(args.duplicates)
            ]
            batch.append(("forged", *self.signed(body, secret=FORGED_SECRET)))
        self.rng.shuffle(batch)
        await self.send_all(batch, [(0.5, reconciler)])

        # Drain: every session must end; late answers to closed waits change nothing.
        t_sent = time.monotonic()

        async def all_ended() -> bool:
            states = await services.index.session_states(list(ids.values()))
            return len(states) == n and all(s.terminal for s in states.values())

        lost_reason = ""
        try:
            await self.until("every session to end", all_ended, args.drain_timeout_s)
        except SystemExit as exc:
            lost_reason = str(exc)
        t_drained = time.monotonic()
        late: list[tuple[str, bytes, dict[str, str]]] = []
        for doc in docs:
            cid = first[doc]["correlation_id"]
            late.append(("stale", *self.signed({"id": f"late2-{doc}", "correlationId": cid,
                                                "doc": doc, "status": "rejected"})))  # fmt: skip
            late.append(("stale", *self.signed({"id": f"late3-{doc}", "doc": doc,
                                                "status": "rejected"})))  # fmt: skip
        late += replays[len(replays) // 2 :]
        self.rng.shuffle(late)
        await self.send_all(late, [])
        await asyncio.sleep(3 * settings.reconciler.interval_s)  # let any wrong wake run
        await sessions.drain()

        # Verdicts from the durable truth: snapshots and the OA world's ledger.
        lost, wrong, decisions = 0, 0, Counter[str]()
        for sid in ids.values():
            try:
                snap = await services.snapshots.load(sid)
            except Exception:
                lost += 1
                continue
            if not snap.terminal:
                lost += 1
                continue
            result = snap.result if isinstance(snap.result, dict) else {}
            decision = str(result.get("decision"))
            decisions[decision] += 1
            if decision != "approved":
                wrong += 1
        keys_by_doc = Counter(e["doc"] for e in (await self.world.entries("dispatch")).values())
        # One request per wait: one wait for most, two for the re-planned ones.
        extra_effects = sum(
            max(0, count - (2 if doc in replan else 1)) for doc, count in keys_by_doc.items()
        )
        compensations = len(await self.world.entries("compensate"))
        total = sum(self.tally.sent.values())
        report = {
            "sessions": n,
            "replanned": len(replan),
            "deliveries": total,
            "by_kind": dict(self.tally.sent),
            "duplicate_pct": round(100 * self.tally.sent["duplicate"] / total, 1),
            "stale_or_reordered_pct": round(100 * self.tally.sent["stale"] / total, 1),
            "forged_or_replayed_pct": round(
                100 * (self.tally.sent["forged"] + self.tally.sent["replay"]) / total, 1
            ),
            "statuses": {f"{k} {s}": c for (k, s), c in sorted(self.tally.statuses.items())},
            "sender_retries": self.tally.retries,
            "errors": dict(self.tally.errors.most_common(5)),
            "proxy": {"failed": proxy.stats.failed, "reset_after_commit": proxy.stats.reset},
            "decisions": dict(decisions),
            "compensations": compensations,
            "sessions_lost": lost,
            "duplicate_side_effects": extra_effects,
            "stale_writes_applied": wrong,
            "forged_or_replayed_accepted": self.tally.accepted_bad,
            "replays_absorbed_as_duplicate": self.tally.absorbed_replays,
            "drain_s": round(t_drained - t_sent, 1),
            "drain_note": lost_reason,
            "total_s": round(time.monotonic() - t0, 1),
            "chaos": self.chaos_log,
        }
        if self.reconciler is not None:
            self.kill_reconciler()
        await self.world.close()
        await services.close()
        ray.shutdown()
        proxy.stop()
        server.stop()
        await self.flush_index()
        return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=1100)
    parser.add_argument("--duplicates", type=int, default=4, help="fresh re-sends per answer")
    parser.add_argument("--replan-pct", type=int, default=15)
    parser.add_argument("--pool", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--drain-timeout-s", type=float, default=180.0)
    parser.add_argument(
        "--wait-timeout-s",
        type=float,
        default=600.0,
        help="how long each round may take to send its requests before the run gives up",
    )
    parser.add_argument("--seed", type=int, default=9)
    args = parser.parse_args()
    report = asyncio.run(Chaos(args).run())
    print(json.dumps(report, indent=2))
    failed = [
        k
        for k in (
            "sessions_lost",
            "duplicate_side_effects",
            "stale_writes_applied",
            "forged_or_replayed_accepted",
        )
        if report[k]
    ]
    print("CHAOS " + ("FAILED: " + ", ".join(failed) if failed else "OK: 0 / 0 / 0 / 0"))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
