"""``torpor demo``: the whole mission on one laptop, with nothing installed but torpor.

A batch of purchase requests and invoices goes through a procurement agent on a local
Ray: extract (sync) → ask the OA system for approval (long-running: the session sleeps,
holding no process) → on the signed webhook, the State Invalidation Guard re-checks the
ERP budget → order, re-plan or give up. A separate simulator process plays the OA/ERP
systems and an attacker. The demo knows every document's story up front and exits 0
only if every session reached the terminal state its story calls for.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

from torpor import outbound
from torpor.auth import new_api_key
from torpor.batches import SESSIONS_PAGE_MAX
from torpor.demo.scenario import DocPlan, Story, documents, plan_documents
from torpor.entry.ingress import Ingress, choose_ingress, restore
from torpor.entry.ports import quiet_port
from torpor.entry.view import Frame, Screen, render
from torpor.settings import Settings
from torpor.webhooks.signing import Scheme, generate_secret

TENANT = "demo"
SOURCE = "oa"
AGENT = "procurement"


@dataclass
class DemoOptions:
    documents: int = 50
    # Pooled: dedicated placement starts a process per activation, and on two cores fifty
    # sessions' timers (reminders, escalations) then come after their 75 s SLA.
    placement: str = "pooled"
    redis_url: str | None = None
    s3_url: str | None = None
    s3_endpoint: str | None = None
    port: int = 0
    seed: int = 7
    sla_s: float = 75.0
    timeout_s: float = 900.0
    state_dir: str | None = None
    keep: bool = False


def _http(method: str, url: str, body: Any = None, headers: dict[str, str] | None = None) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    response = outbound.request(
        method,
        url,
        body=data,
        headers={"Content-Type": "application/json", **(headers or {})},
        timeout_s=30,
        max_body_bytes=16 * 1024 * 1024,
    )
    if not response.ok:
        raise RuntimeError(f"{method} {url} answered {response.status}: {response.body[:300]!r}")
    return response.json()


def _batch_session_ids(base: str, batch: dict[str, Any], auth: dict[str, str]) -> list[str]:
    """Every document's session, in order: the batch's answer lists the first page, and
    its ``next_cursor`` continues in ``GET /v1/batches/{id}/sessions``."""
    ids: list[str] = list(batch["session_ids"])
    cursor: str | None = batch.get("next_cursor")
    while cursor is not None:
        query = urlencode({"cursor": cursor, "limit": SESSIONS_PAGE_MAX})
        page = _http("GET", f"{base}{batch['links']['sessions']}?{query}", headers=auth)
        ids.extend(item["session_id"] for item in page["items"])
        cursor = page["next_cursor"]
    return ids


def build_settings(
    opts: DemoOptions, state: Path, port: int, sim_port: int, api_hash: str, secret: str
) -> Settings:
    storage: dict[str, Any] = {
        "object_store_url": opts.s3_url or f"file://{state / 'objects'}",
        "index_url": opts.redis_url or f"sqlite://{state / 'index.db'}",
        "redis_prefix": f"tpdemo:{secrets.token_hex(3)}:",
    }
    if opts.s3_endpoint:
        storage["s3"] = {"endpoint_url": opts.s3_endpoint}
    config: dict[str, Any] = {
        "storage": storage,
        "namespace": f"torpor-demo-{secrets.token_hex(3)}",
        "public_url": f"http://127.0.0.1:{port}",
        "security": {"capability_keys": [secrets.token_hex(32)], "inline_secrets_in_ray": True},
        "notifications": {"key": secrets.token_hex(32), "allow_private_callbacks": True},
        "tenants": {TENANT: {"api_keys": [api_hash]}},
        "sources": {
            SOURCE: {
                "tenant": TENANT,
                "scheme": "torpor",
                "secrets": [secret],
                "mapping": {
                    "event_id_path": "eventId",
                    "type_path": "eventType",
                    "correlation_id_path": "correlationId",
                    "business_key_path": "businessKey",
                    "status_path": "decision.status",
                    "data_path": "decision",
                },
            }
        },
        "agents": {
            AGENT: {
                "factory": "torpor.agents.plan:PlanAgent",
                "options": {"plan": _plan(), "name": AGENT, "version": "1"},
                "tools": ["torpor.demo.tools:tools"],
                "tool_options": {
                    "torpor.demo.tools:tools": {
                        "simulator_url": f"http://127.0.0.1:{sim_port}",
                        "sla_s": opts.sla_s,
                        "expected_s": opts.sla_s / 2,
                    }
                },
                "placement": opts.placement,
            }
        },
        "reconciler": {"interval_s": 1.0, "wake_grace_s": 5.0},
        "lease": {"heartbeat_s": 2.0, "ttl_s": 6.0},
        "pool": {"size": 2},
    }
    return Settings.build(config)


def _plan() -> dict[str, Any]:
    from torpor.demo.tools import PLAN

    return PLAN


def run_demo(opts: DemoOptions) -> int:
    ingress = choose_ingress()  # before ray.serve is imported: Serve reads its flag once
    try:
        return _run_demo(opts, ingress)
    finally:
        restore(ingress)  # the process may go on (tests): leave its environment as it was


def _run_demo(opts: DemoOptions, ingress: Ingress) -> int:
    from ray import serve
    from ray.util import list_named_actors

    from actors.driver import init_driver, shutdown_driver
    from serve_app import application

    state = Path(opts.state_dir or tempfile.mkdtemp(prefix="torpor-demo-"))
    state.mkdir(parents=True, exist_ok=True)
    docs = documents(opts.documents)
    if len(docs) < opts.documents:
        raise SystemExit(f"torpor: only {len(docs)} sample documents are shipped")
    plans = plan_documents([d["doc_id"] for d in docs], seed=opts.seed)
    port, sim_port = opts.port or quiet_port(), quiet_port()
    api_key, api_hash = new_api_key()
    secret = generate_secret(Scheme.TORPOR)
    settings = build_settings(opts, state, port, sim_port, api_hash, secret)
    base = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {api_key}"}

    sim_config = state / "simulator.json"
    sim_config.write_text(
        json.dumps(
            {
                "port": sim_port,
                "torpor_url": base,
                "source": SOURCE,
                "secret": secret,
                "doc_ids": [d["doc_id"] for d in docs],
                "seed": opts.seed,
            }
        )
    )
    sim_log = (state / "simulator.log").open("w")
    simulator = subprocess.Popen(  # noqa: S603 - our own module, our own interpreter
        [sys.executable, "-m", "torpor.demo.simulator", "--config", str(sim_config)],
        stdout=subprocess.DEVNULL,
        stderr=sim_log,
    )
    ok = False
    screen = Screen(sys.stdout)
    # Ray and Serve print their own chatter (worker start-up warnings, INFO lines) to
    # whatever sys.stdout/sys.stderr are: send it to a log file, keep the terminal for
    # the live view.
    chatter = (state / "driver.log").open("w")
    real_out, real_err = sys.stdout, sys.stderr
    sys.stdout = sys.stderr = chatter
    title = (
        f"torpor demo: {len(docs)} documents, {opts.placement} placement, storage "
        f"{settings.storage.object_store_url} + {_shown(settings.storage.index_url)}, "
        + ingress.label
    )
    print(ingress.message, file=chatter, flush=True)
    try:
        init_driver(  # ray.init; a SIGTERM then exits through the cleanup, not aborts
            address="local",  # the demo's own Ray, with the ingress chosen above
            namespace=settings.namespace,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(application(settings), name="torpor", route_prefix="/")
        _wait_http(f"http://127.0.0.1:{sim_port}/stats")
        batch = _http(
            "POST",
            f"{base}/v1/batches",
            {"agent": AGENT, "documents": docs},
            {**auth, "Idempotency-Key": f"demo-{secrets.token_hex(4)}"},
        )
        ids = _batch_session_ids(base, batch, auth)
        sessions = dict(zip([d["doc_id"] for d in docs], ids, strict=True))
        started = time.monotonic()
        cancelled: set[str] = set()
        waiting_samples: list[int] = []
        finished_at: float | None = None
        while True:
            elapsed = time.monotonic() - started
            progress = _http("GET", f"{base}/v1/batches/{batch['batch_id']}", headers=auth)
            stats = _http("GET", f"http://127.0.0.1:{sim_port}/stats")
            live = sum(
                1
                for a in list_named_actors(all_namespaces=True)
                if a["namespace"] == settings.namespace and a["name"].startswith("session:")
            )
            by_state: dict[str, int] = progress["by_state"]
            busy = sum(by_state.get(s, 0) for s in ("PENDING", "RUNNING", "RESUMING"))
            if not stats["released"] and busy == 0 and by_state.get("SUSPENDED", 0):
                waiting_samples.append(live)
            for doc, plan in plans.items():
                # Cancel once decisions flow, so the quiet phase shows every session asleep.
                if plan.story is Story.CANCEL and doc not in cancelled and stats["released"]:
                    view = _http("GET", f"{base}/v1/sessions/{sessions[doc]}", headers=auth)
                    if view["state"] == "SUSPENDED":
                        _http("POST", f"{base}/v1/sessions/{sessions[doc]}/cancel", headers=auth)
                        cancelled.add(doc)
            screen.draw(
                render(
                    Frame(
                        title=title,
                        elapsed_s=elapsed,
                        total=len(docs),
                        by_state=by_state,
                        live_actors=live,
                        max_actors_all_waiting=min(waiting_samples) if waiting_samples else None,
                        responses=stats["responses"],
                        replans=stats["replans"],
                        released=stats["released"],
                    )
                ),
                elapsed_s=elapsed,
            )
            if progress["finished"] and stats["scheduled"] == 0:
                finished_at = finished_at or time.monotonic()
                if time.monotonic() - finished_at > 3:  # let the last late events land
                    break
            if elapsed > opts.timeout_s:
                screen.out.write(f"\ntorpor demo: gave up after {opts.timeout_s:.0f} s\n")
                break
            time.sleep(0.5)
        final = {
            doc: _http("GET", f"{base}/v1/sessions/{sid}", headers=auth)
            for doc, sid in sessions.items()
        }
        stats = _http("GET", f"http://127.0.0.1:{sim_port}/stats")
        audit = asyncio.run(_verify_audit(settings))
        rows, ok = verdict(plans, final, stats, waiting_samples, audit)
        screen.summary(rows)
        outcome = "passed" if ok else "FAILED"
        kept = f"; state and logs kept in {state}" if opts.keep or opts.state_dir or not ok else ""
        screen.out.write(f"\ntorpor demo {outcome} in {time.monotonic() - started:.0f} s{kept}\n")
        return 0 if ok else 1
    finally:
        simulator.terminate()
        simulator.wait(timeout=10)
        sim_log.close()
        try:
            serve.shutdown()  # type: ignore[no-untyped-call]
        finally:
            shutdown_driver()  # a SIGTERM during the cleanup still exits through it
            sys.stdout, sys.stderr = real_out, real_err
            chatter.close()
        if not opts.keep and not opts.state_dir and ok:
            shutil.rmtree(state, ignore_errors=True)


def _wait_http(url: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            _http("GET", url)
            return
        except (RuntimeError, OSError):
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


async def _verify_audit(settings: Settings) -> tuple[bool, int]:
    from actors.wiring import open_services
    from storage.audit import ObjectAudit

    services = open_services(settings)
    try:
        checks = await ObjectAudit(services.store).verify_all()
    finally:
        await services.close()
    return all(c.ok for c in checks.values()), sum(c.records for c in checks.values())


def verdict(
    plans: dict[str, DocPlan],
    final: dict[str, dict[str, Any]],
    stats: dict[str, Any],
    waiting_samples: list[int],
    audit: tuple[bool, int],
) -> tuple[list[tuple[str, str, Any]], bool]:
    """Compare what happened with what every document's story calls for."""
    wrong = []
    for doc, plan in plans.items():
        got = final[doc]
        decision = (
            (got.get("result") or {}).get("decision")
            if isinstance(got.get("result"), dict)
            else None
        )
        if got["state"] != plan.expected_state or decision != plan.decision:
            wrong.append(f"{doc} ({plan.story}): {got['state']}/{decision}")
    orders, withdrawals = stats["orders"], stats["withdrawals"]
    order_errors = [
        d for d, p in plans.items() if orders.get(d, 0) != (1 if p.expects_order else 0)
    ]
    comp_errors = [d for d, p in plans.items() if withdrawals.get(d, 0) != p.expected_withdrawals]
    reminders, followups = stats.get("reminders", {}), stats.get("followups", {})
    unreminded = [d for d, p in plans.items() if p.story is Story.TIMEOUT and not reminders.get(d)]
    escalated = [d for d, p in plans.items() if p.story is Story.ESCALATE]
    r: dict[str, dict[str, int]] = stats["responses"]

    def only(kind: str, *codes: str) -> tuple[bool, str]:
        seen = r.get(kind, {})
        total = sum(seen.values())
        good = sum(n for c, n in seen.items() if c in codes)
        return good == total, f"{good}/{total} answered {'/'.join(codes)}"

    checks = {
        "terminal states": (
            not wrong,
            f"{len(plans) - len(wrong)}/{len(plans)} as their story"
            + (f"; wrong: {', '.join(wrong[:5])}" if wrong else ""),
        ),
        "purchase orders": (
            not order_errors,
            "exactly one per approved document"
            + (f"; off: {order_errors[:5]}" if order_errors else ""),
        ),
        "compensations": (
            not comp_errors,
            "the open request withdrawn once per cancel, escalation and timeout"
            + (f"; off: {comp_errors[:5]}" if comp_errors else ""),
        ),
        "approval reminders": (
            not unreminded,
            f"{sum(reminders.values())} signed reminders sent to the OA before the SLA"
            + (f"; none for {unreminded[:5]}" if unreminded else ""),
        ),
        "escalation and second stage": (
            all(followups.get(d) for d in escalated),
            f"{len(escalated)} escalated to the CFO; "
            f"{sum(followups.values())} requests reached the CFO (escalations and 2nd stages)",
        ),
        "decisions": only("decision", "202"),
        "capability links": only("capability", "202"),
        "forged webhooks": only("forged", "401"),
        "replayed webhooks": only("replay", "409"),
        "reused capability links": only("capability_reuse", "409"),
        "duplicate deliveries": only("duplicate", "200"),
        "late and out-of-order": only("late", "200", "202") if r.get("late") else (True, "none"),
        "stale after re-plan": only("stale", "200", "202") if r.get("stale") else (True, "none"),
        "drift caught": (
            stats["replans"] == sum(p.story is Story.DRIFT for p in plans.values()),
            f"{stats['replans']} sessions re-planned after the budget moved",
        ),
        "actors while all slept": (
            bool(waiting_samples) and min(waiting_samples) == 0,
            f"{min(waiting_samples) if waiting_samples else '?'} live session actors once every "
            f"session slept ({max(waiting_samples) if waiting_samples else '?'} while the last "
            f"ones were exiting; {len(waiting_samples)} samples)",
        ),
        "audit chain": (audit[0], f"{audit[1]} records, every link verified"),
    }
    rows = [(name, "ok" if good else "FAIL", detail) for name, (good, detail) in checks.items()]
    return rows, all(good for good, _ in checks.values())


def _shown(url: str) -> str:
    """The index's URL without what may be a secret: its user and password, and its query
    (redis-py reads ``?password=``; splitting at ``@`` left that in the demo's title)."""
    parts = urlsplit(url)
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{parts.hostname or ''}{port}{parts.path}"
