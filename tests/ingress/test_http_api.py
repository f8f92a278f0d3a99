"""The Serve ingress over real HTTP: task API, webhook gateway, capability callbacks."""

from __future__ import annotations

import asyncio
import hashlib
import json
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
import redis
import standardwebhooks
from cloudevents.core.bindings.http import to_binary_event, to_structured_event
from cloudevents.core.v1.event import CloudEvent

from tests.conftest import eventually
from tests.ingress.conftest import Deployment, unique
from tests.support.harness import CAPABILITY_KEY
from tests.support.tools import World
from torpor.webhooks.capability import mint
from torpor.webhooks.signing import Scheme, sign

PROBLEM = "application/problem+json"


def now() -> datetime:
    return datetime.now(UTC)


async def submit(http: httpx.AsyncClient, dep: Deployment, doc: str, **extra: Any) -> str:
    response = await http.post(
        "/v1/sessions",
        headers={**dep.auth(), "Idempotency-Key": unique("k")},
        json={"agent": "purchase", "input": {"doc": doc, "amount": 10.0}, **extra},
    )
    assert response.status_code == 202, response.text
    return str(response.json()["session_id"])


async def session(http: httpx.AsyncClient, dep: Deployment, sid: str) -> dict[str, Any]:
    response = await http.get(f"/v1/sessions/{sid}", headers=dep.auth())
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


async def waiting(http: httpx.AsyncClient, dep: Deployment, world: World, doc: str) -> str:
    """Submit and return once the approval request went out (the wait is bound)."""
    sid = await submit(http, dep, doc)

    async def dispatched() -> bool:
        return f"acme:approve:{doc}:1" in await world.entries("dispatch")

    await eventually(dispatched, what=f"{doc} waits for approval")
    return sid


async def reaches(http: httpx.AsyncClient, dep: Deployment, sid: str, state: str) -> None:
    async def check() -> bool:
        return (await session(http, dep, sid))["state"] == state

    await eventually(check, what=f"{sid} reaches {state}")


def oa_body(cid: str, *, event_id: str | None = None, status: str = "approved") -> bytes:
    return json.dumps(
        {
            "eventId": event_id or unique("evt"),
            "eventType": "oa.approval.decided",
            "correlationId": cid,
            "decision": {"status": status, "approver": "u-17"},
        }
    ).encode()


def signed(
    dep: Deployment,
    source: str,
    body: bytes,
    *,
    secret: int = -1,
    at: datetime | None = None,
    scheme: Scheme = Scheme.TORPOR,
    **kw: Any,
) -> dict[str, str]:
    headers = sign(scheme, body, dep.secrets[source][secret], now=at or now(), **kw)
    return {**headers, "Content-Type": "application/json"}


def assert_problem(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith(PROBLEM)
    body: dict[str, Any] = response.json()
    assert body["status"] == status and body["type"].startswith("https://")
    assert "Traceback" not in response.text
    return body


# -- task API ---------------------------------------------------------------------------


async def test_openapi_is_served(http: httpx.AsyncClient) -> None:
    response = await http.get("/openapi.json")
    assert response.status_code == 200, response.text
    spec = response.json()
    assert "/v1/sessions" in spec["paths"] and "/v1/hooks/{source}" in spec["paths"]


async def test_api_needs_a_valid_key(http: httpx.AsyncClient) -> None:
    assert_problem(await http.get("/v1/sessions"), 401)
    assert_problem(await http.get("/v1/sessions", headers={"Authorization": "Bearer nope"}), 401)
    assert_problem(await http.get("/v1/sessions", headers={"Authorization": "Basic x"}), 401)


async def test_submit_answers_202_with_a_status_monitor(
    http: httpx.AsyncClient, deployment: Deployment, world: World
) -> None:
    response = await http.post(
        "/v1/sessions",
        headers={**deployment.auth(), "Idempotency-Key": unique("k")},
        json={"agent": "purchase", "input": {"doc": unique("PR")}},
    )
    assert response.status_code == 202
    assert response.headers["location"] == f"/v1/sessions/{response.json()['session_id']}"
    assert int(response.headers["retry-after"]) >= 1
    assert_problem(await http.post("/v1/sessions", headers=deployment.auth(), json={}), 400)
    bad = await http.post(
        "/v1/sessions",
        headers={**deployment.auth(), "Idempotency-Key": "x"},
        content=b"{not json",
    )
    assert_problem(bad, 400)
    unknown = await http.post(
        "/v1/sessions",
        headers={**deployment.auth(), "Idempotency-Key": unique("k")},
        json={"agent": "nobody", "input": {}},
    )
    assert_problem(unknown, 422)


async def test_idempotency_key_semantics(http: httpx.AsyncClient, deployment: Deployment) -> None:
    key = unique("idem")
    body = {"agent": "purchase", "input": {"doc": unique("PR")}}
    headers = {**deployment.auth(), "Idempotency-Key": key}
    first = await http.post("/v1/sessions", headers=headers, json=body)
    again = await http.post("/v1/sessions", headers=headers, json=body)
    assert first.status_code == again.status_code == 202
    assert first.json()["session_id"] == again.json()["session_id"]
    assert first.json()["created"] and not again.json()["created"]
    other = await http.post("/v1/sessions", headers=headers, json={**body, "input": {"doc": "Z"}})
    assert_problem(other, 422)
    # the same key from another tenant is another request altogether
    beta = await http.post(
        "/v1/sessions", headers={**deployment.auth("beta"), "Idempotency-Key": key}, json=body
    )
    assert beta.status_code == 202 and beta.json()["session_id"] != first.json()["session_id"]


async def test_concurrent_identical_submissions_make_one_session(
    http: httpx.AsyncClient, deployment: Deployment
) -> None:
    headers = {**deployment.auth(), "Idempotency-Key": unique("race")}
    body = {"agent": "purchase", "input": {"doc": unique("PR")}}
    responses = await asyncio.gather(
        *(http.post("/v1/sessions", headers=headers, json=body) for _ in range(20))
    )
    assert {r.status_code for r in responses} <= {202, 409}
    sids = {r.json()["session_id"] for r in responses if r.status_code == 202}
    assert len(sids) == 1


async def test_tenants_never_see_each_other(
    http: httpx.AsyncClient, deployment: Deployment
) -> None:
    sid = await submit(http, deployment, unique("PR"))
    assert_problem(await http.get(f"/v1/sessions/{sid}", headers=deployment.auth("beta")), 404)
    assert_problem(
        await http.post(f"/v1/sessions/{sid}/cancel", headers=deployment.auth("beta")), 404
    )
    listed = (await http.get("/v1/sessions?limit=200", headers=deployment.auth("beta"))).json()
    assert sid not in {item["session_id"] for item in listed["items"]}
    mine = (await http.get("/v1/sessions?limit=200", headers=deployment.auth())).json()
    assert sid in {item["session_id"] for item in mine["items"]}


async def test_cancel_is_idempotent(
    http: httpx.AsyncClient, deployment: Deployment, world: World
) -> None:
    doc = unique("PR")
    sid = await waiting(http, deployment, world, doc)
    first = await http.post(f"/v1/sessions/{sid}/cancel", headers=deployment.auth())
    assert first.status_code == 202
    await reaches(http, deployment, sid, "CANCELLED")
    again = await http.post(f"/v1/sessions/{sid}/cancel", headers=deployment.auth())
    assert again.status_code == 200 and again.json()["state"] == "CANCELLED"
    # Cancelled twice, compensated once: one key, one call, nothing for this doc besides.
    mine = {k: n for k, n in (await world.counts("compensate")).items() if f":{doc}:" in k}
    assert mine == {f"acme:approve:{doc}:1:compensate": 1}


async def test_batches(http: httpx.AsyncClient, deployment: Deployment, world: World) -> None:
    docs = [unique("BATCH") for _ in range(3)]
    headers = {**deployment.auth(), "Idempotency-Key": unique("batch")}
    body = {"agent": "purchase", "documents": [{"doc": d} for d in docs]}
    created = await http.post("/v1/batches", headers=headers, json=body)
    assert created.status_code == 202, created.text
    again = await http.post("/v1/batches", headers=headers, json=body)
    assert again.json()["batch_id"] == created.json()["batch_id"]
    location = created.headers["location"]

    async def all_waiting() -> bool:
        got = (await http.get(location, headers=deployment.auth())).json()
        return bool(got["by_state"] == {"SUSPENDED": 3})

    await eventually(all_waiting, what="batch sessions wait")
    assert_problem(await http.get(location, headers=deployment.auth("beta")), 404)


async def test_batch_admission_cancel_and_results_over_http(
    http: httpx.AsyncClient, deployment: Deployment
) -> None:
    auth = deployment.auth()
    body = {
        "agent": "purchase",
        "documents": [{"doc": unique("BR"), "id": f"d{i}"} for i in range(3)],
    }
    created = await http.post(
        "/v1/batches", headers={**auth, "Idempotency-Key": unique("batch")}, json=body
    )
    assert created.status_code == 202, created.text
    location = created.headers["location"]
    out = created.json()
    assert out["links"]["results"] == f"{location}/results"
    caps = deployment.settings.batches
    assert out["admission"]["max_running"] == caps.max_running_per_batch
    assert out["admission"]["max_running_per_tenant"] == caps.max_running_per_tenant
    # Not finished: no results yet, as problem+json.
    assert_problem(await http.get(f"{location}/results", headers=auth), 409)

    async def created_all() -> bool:
        return bool((await http.get(location, headers=auth)).json()["created"] == 3)

    await eventually(created_all, what="fan-out done")
    cancelled = await http.post(f"{location}/cancel", headers=auth)
    assert cancelled.status_code == 202 and cancelled.json()["cancelled"]

    async def finished() -> bool:
        got = (await http.get(location, headers=auth)).json()
        return bool(got["finished"] and got["by_state"] == {"CANCELLED": 3})

    await eventually(finished, what="batch cancelled")
    assert (await http.post(f"{location}/cancel", headers=auth)).status_code == 202
    assert_problem(await http.post(f"{location}/retry", headers=auth), 409)
    jsonl = await http.get(f"{location}/results", headers=auth)
    assert jsonl.status_code == 200 and jsonl.headers["content-type"] == "application/x-ndjson"
    rows = [json.loads(line) for line in jsonl.text.splitlines()]
    assert [(r["document_id"], r["state"]) for r in rows] == [
        (f"d{i}", "CANCELLED") for i in range(3)
    ]
    parquet = await http.get(f"{location}/results", params={"format": "parquet"}, headers=auth)
    assert parquet.status_code == 200 and parquet.content.startswith(b"PAR1")
    assert_problem(await http.get(f"{location}/results", headers=deployment.auth("beta")), 404)
    assert_problem(
        await http.get(f"{location}/results", params={"format": "xml"}, headers=auth), 400
    )
    assert_problem(await http.post("/v1/batches/b_nope/cancel", headers=auth), 404)


async def test_server_sent_events_push_live_and_replay_from_last_event_id(
    http: httpx.AsyncClient, deployment: Deployment, world: World
) -> None:
    doc = unique("PR")
    sid = await waiting(http, deployment, world, doc)
    cid = (await session(http, deployment, sid))["waits"][0]["correlation_id"]

    async def read(last: str | None, *, then: Any = None) -> list[tuple[int, str]]:
        """Read the stream to its end; ``then`` runs once the first event came in."""
        headers = {**deployment.auth(), **({"Last-Event-ID": last} if last else {})}
        events: list[tuple[int, str]] = []
        async with http.stream("GET", f"/v1/sessions/{sid}/events", headers=headers) as stream:
            assert stream.headers["content-type"].startswith("text/event-stream")
            event_id = None
            async for line in stream.aiter_lines():
                if line.startswith("id: "):
                    event_id = int(line[4:])
                elif line.startswith("data: "):
                    assert event_id is not None
                    events.append((event_id, json.loads(line[6:])["state"]))
                    if then is not None and len(events) == 1:
                        await then()
        return events

    async def answer() -> None:
        # Sent only once the stream is open: the rest must be pushed as it happens.
        body = oa_body(cid)
        response = await http.post(
            "/v1/hooks/oa", content=body, headers=signed(deployment, "oa", body)
        )
        assert response.status_code == 202

    everything = await asyncio.wait_for(read(None, then=answer), timeout=60)
    assert [state for _, state in everything] == [
        "RUNNING",
        "SUSPENDED",
        "RESUMING",
        "RUNNING",
        "COMPLETED",
    ]
    rest = await read(str(everything[1][0]))
    assert rest == everything[2:]


# -- webhooks -----------------------------------------------------------------------


async def test_signed_webhook_resumes_once(
    http: httpx.AsyncClient, deployment: Deployment, world: World
) -> None:
    doc = unique("PR")
    sid = await waiting(http, deployment, world, doc)
    cid = (await session(http, deployment, sid))["waits"][0]["correlation_id"]
    body = oa_body(cid, event_id="evt-once")
    headers = signed(deployment, "oa", body, secret=0)  # the older secret still works
    accepted = await http.post("/v1/hooks/oa", content=body, headers=headers)
    assert accepted.status_code == 202 and accepted.json()["duplicate"] is False
    await reaches(http, deployment, sid, "COMPLETED")
    # The sender retries the same event a little later, freshly signed: absorbed, and the
    # sender is told the original outcome.
    later = now() + timedelta(seconds=2)
    retry = await http.post(
        "/v1/hooks/oa", content=body, headers=signed(deployment, "oa", body, at=later)
    )
    assert retry.status_code == 200 and retry.json()["duplicate"] is True
    assert retry.json()["session"]["state"] == "COMPLETED"
    # The exact same request again is a replay.
    assert_problem(await http.post("/v1/hooks/oa", content=body, headers=headers), 409)
    final = await session(http, deployment, sid)
    assert final["result"] == {"decision": "approved", "doc": doc}


@pytest.mark.parametrize(
    "case",
    [
        "forged",
        "wrong_secret",
        "expired",
        "future",
        "replayed_nonce",
        "oversized",
        "malformed_json",
        "content_type",
        "unknown_source",
        "cross_tenant",
        "no_signature",
    ],
)
async def test_rejections_change_nothing(
    http: httpx.AsyncClient, deployment: Deployment, world: World, case: str
) -> None:
    doc = unique("PR")
    sid = await waiting(http, deployment, world, doc)
    before = await session(http, deployment, sid)
    cid = before["waits"][0]["correlation_id"]
    body = oa_body(cid, status="approved")
    source, headers, expected = "oa", signed(deployment, "oa", body), 401
    if case == "forged":
        headers["X-Torpor-Signature"] = "0" * 64
    elif case == "wrong_secret":
        headers = {
            **sign(Scheme.TORPOR, body, "f" * 64, now=now()),
            "Content-Type": "application/json",
        }
    elif case == "expired":
        headers = signed(deployment, "oa", body, at=now() - timedelta(seconds=301))
    elif case == "future":
        # A minute past the 300 s window, not a second: the server reads its clock when
        # the request arrives, and every second the request spends on its way (a loaded
        # machine: over one in a CI run) brings a future stamp back inside the window.
        headers = signed(deployment, "oa", body, at=now() + timedelta(seconds=360))
    elif case == "replayed_nonce":
        # A nonce already used by an accepted request (for another session) is a replay.
        nonce = unique("nonce-0123456789")
        other_sid = await waiting(http, deployment, world, unique("PR"))
        other_cid = (await session(http, deployment, other_sid))["waits"][0]["correlation_id"]
        other = oa_body(other_cid)
        first = await http.post(
            "/v1/hooks/oa", content=other, headers=signed(deployment, "oa", other, nonce=nonce)
        )
        assert first.status_code == 202
        headers, expected = signed(deployment, "oa", body, nonce=nonce), 409
    elif case == "oversized":
        body = b'{"pad": "' + b"x" * 300_000 + b'"}'
        headers, expected = signed(deployment, "oa", body), 413
    elif case == "malformed_json":
        body = b'{"eventId": "x", "correlationId": '
        headers, expected = signed(deployment, "oa", body), 400
    elif case == "content_type":
        headers = {**signed(deployment, "oa", body), "Content-Type": "text/plain"}
        expected = 415
    elif case == "unknown_source":
        source, expected = "nope", 404
    elif case == "cross_tenant":
        source, headers, expected = "beta-erp", signed(deployment, "beta-erp", body), 404
    elif case == "no_signature":
        headers = {"Content-Type": "application/json"}
    response = await http.post(f"/v1/hooks/{source}", content=body, headers=headers)
    assert_problem(response, expected)
    for secret in (s for values in deployment.secrets.values() for s in values):
        assert secret not in response.text
    after = await session(http, deployment, sid)
    assert after["generation"] == before["generation"] and after["state"] == "SUSPENDED"


async def test_standard_webhooks_library_as_sender(
    http: httpx.AsyncClient, deployment: Deployment, world: World
) -> None:
    doc = unique("PR")
    sid = await waiting(http, deployment, world, doc)
    cid = (await session(http, deployment, sid))["waits"][0]["correlation_id"]
    body = oa_body(cid).decode()
    wh = standardwebhooks.Webhook(deployment.secrets["std"][0])
    msg_id = unique("msg")
    stamp = now()
    headers = {
        "webhook-id": msg_id,
        "webhook-timestamp": str(int(stamp.timestamp())),
        "webhook-signature": wh.sign(msg_id, stamp, body),
        "Content-Type": "application/json",
    }
    assert (await http.post("/v1/hooks/std", content=body, headers=headers)).status_code == 202
    await reaches(http, deployment, sid, "COMPLETED")
    tampered = {**headers, "webhook-id": unique("msg")}
    assert_problem(await http.post("/v1/hooks/std", content=body, headers=tampered), 401)


async def test_cloudevents_library_as_sender(
    http: httpx.AsyncClient, deployment: Deployment, world: World
) -> None:
    docs = [unique("PR") for _ in range(3)]
    sids = [await waiting(http, deployment, world, d) for d in docs]
    cids = [(await session(http, deployment, s))["waits"][0]["correlation_id"] for s in sids]

    def event(cid: str) -> CloudEvent:
        return CloudEvent(
            attributes={
                "id": unique("ce"),
                "source": "https://erp.example.com/po",
                "type": "oa.approval.decided",
                "specversion": "1.0",
                "datacontenttype": "application/json",
                "correlationid": cid,
            },
            data={"status": "approved", "approver": "u-42"},
        )

    def post(message_headers: dict[str, str], body: bytes) -> Any:
        headers = {
            **message_headers,
            **sign(Scheme.STANDARD, body, deployment.secrets["ce"][0], now=now()),
        }
        return http.post("/v1/hooks/ce", content=body, headers=headers)

    structured = to_structured_event(event(cids[0]))
    assert (await post(dict(structured.headers), structured.body)).status_code == 202
    binary = to_binary_event(event(cids[1]))  # ce- headers are unsigned: refused (issue 10)
    assert_problem(await post(dict(binary.headers), binary.body), 415)
    structured = to_structured_event(event(cids[1]))
    assert (await post(dict(structured.headers), structured.body)).status_code == 202
    batch_body = json.dumps(
        [
            {
                "specversion": "1.0",
                "id": unique("b"),
                "source": "/erp",
                "type": "oa.approval.decided",
                "correlationid": cids[2],
                "data": {"status": "approved"},
            },
            {
                "specversion": "1.0",
                "id": unique("b"),
                "source": "/erp",
                "type": "oa.approval.decided",
                "correlationid": "A" * 22,
                "data": {"status": "approved"},
            },
        ]
    ).encode()
    batch = await post({"Content-Type": "application/cloudevents-batch+json"}, batch_body)
    assert batch.status_code == 202
    assert [e["status"] for e in batch.json()["events"]] == [202, 404]
    for sid in sids:
        await reaches(http, deployment, sid, "COMPLETED")
    broken = json.dumps({"specversion": "1.0", "source": "/erp", "type": "x"}).encode()
    assert_problem(await post({"Content-Type": "application/cloudevents+json"}, broken), 400)


async def test_github_and_stripe_styles(
    http: httpx.AsyncClient, deployment: Deployment, world: World
) -> None:
    for source, scheme in (("gh", Scheme.GITHUB), ("stripe", Scheme.STRIPE)):
        doc = unique("PR")
        sid = await waiting(http, deployment, world, doc)
        cid = (await session(http, deployment, sid))["waits"][0]["correlation_id"]
        body = oa_body(cid)
        headers = signed(deployment, source, body, scheme=scheme)
        assert (
            await http.post(f"/v1/hooks/{source}", content=body, headers=headers)
        ).status_code == 202
        await reaches(http, deployment, sid, "COMPLETED")


async def test_capability_callback_works_once_and_expires(
    http: httpx.AsyncClient, deployment: Deployment, world: World
) -> None:
    doc = unique("PR")
    sid = await waiting(http, deployment, world, doc)
    token = (await world.entries("dispatch"))[f"acme:approve:{doc}:1"]["token"]
    assert_problem(await http.post("/v1/callbacks/not-a-token", json={}), 401)
    assert_problem(
        await http.post(
            f"/v1/callbacks/{token}", content=b"x", headers={"Content-Type": "text/plain"}
        ),
        415,
    )
    snap = await session(http, deployment, sid)
    wait = snap["waits"][0]
    expired = mint(
        key=CAPABILITY_KEY.encode(),
        tenant="acme",
        session_id=sid,
        wait_id=wait["wait_id"],
        correlation_id=wait["correlation_id"],
        epoch=wait["epoch"],
        expires_at=now() - timedelta(seconds=5),
    )
    assert_problem(await http.post(f"/v1/callbacks/{expired}", json={"status": "approved"}), 410)
    assert (await session(http, deployment, sid))["generation"] == snap["generation"]
    ok = await http.post(f"/v1/callbacks/{token}", json={"status": "approved", "by": "mail"})
    assert ok.status_code == 202, ok.text
    await reaches(http, deployment, sid, "COMPLETED")
    assert_problem(await http.post(f"/v1/callbacks/{token}", json={"status": "rejected"}), 409)
    assert (await session(http, deployment, sid))["result"]["decision"] == "approved"


async def test_cloudevents_handshake_only_for_registered_origins(
    http: httpx.AsyncClient,
) -> None:
    ok = await http.options("/v1/hooks/ce", headers={"WebHook-Request-Origin": "erp.example.com"})
    assert ok.status_code == 200
    assert ok.headers["webhook-allowed-origin"] == "erp.example.com"
    assert ok.headers["webhook-allowed-rate"] == "120"
    denied = await http.options("/v1/hooks/ce", headers={"WebHook-Request-Origin": "evil.example"})
    assert denied.status_code == 405
    assert (
        await http.options("/v1/hooks/nope", headers={"WebHook-Request-Origin": "x"})
    ).status_code == 405


async def test_a_flushed_index_does_not_turn_a_valid_callback_away(
    http: httpx.AsyncClient, deployment: Deployment, world: World
) -> None:
    doc = unique("PR")
    sid = await waiting(http, deployment, world, doc)
    cid = (await session(http, deployment, sid))["waits"][0]["correlation_id"]
    client = redis.Redis.from_url(deployment.redis_url)
    for key in client.scan_iter(match=deployment.prefix + "c:*"):
        client.delete(key)
    client.close()
    body = oa_body(cid)
    response = await http.post("/v1/hooks/oa", content=body, headers=signed(deployment, "oa", body))
    assert response.status_code == 202, response.text
    await reaches(http, deployment, sid, "COMPLETED")


async def test_unknown_correlation_is_404_and_audited(
    http: httpx.AsyncClient, deployment: Deployment, services: Any
) -> None:
    from storage.audit import ObjectAudit

    body = oa_body("Q" * 22)
    response = await http.post("/v1/hooks/oa", content=body, headers=signed(deployment, "oa", body))
    assert_problem(response, 404)
    checks = await ObjectAudit(services.store).verify_all()
    assert checks and all(check.ok for check in checks.values())
    # This request's own record, found by its body digest (earlier tests wrote others).
    digest = hashlib.sha256(body).hexdigest()
    mine = [r for r in await audit_records(services.store) if r.body_sha256 == digest]
    assert [(r.verdict, r.source) for r in mine] == [("unknown", "oa")]


async def audit_records(store: Any) -> list[Any]:
    from storage import keys
    from storage.audit import AuditRecord

    records, token = [], None
    while True:
        page = await store.list(keys.AUDIT, start_after=token)
        for key in page.keys:
            for line in (await store.get(key)).data.decode().splitlines():
                records.append(AuditRecord.model_validate_json(line))
        if page.next_token is None:
            return records
        token = page.next_token


async def test_console_is_served_by_the_serve_app(http: httpx.AsyncClient) -> None:
    login = await http.get("/console/login")
    assert login.status_code == 200
    assert login.headers["content-type"].startswith("text/html")
    assert 'name="key"' in login.text
    # Every other page needs a login first.
    page = await http.get("/console/", follow_redirects=False)
    assert page.status_code == 303
    assert page.headers["location"] == "/console/login"
    assert (await http.get("/console/static/console.js")).status_code == 200


# -- operator: approval reassignment ------------------------------------------------------


def reassign_path(sid: str, cid: str) -> str:
    return f"/v1/operator/sessions/{sid}/waits/{cid}/reassign"


def operator_auth(dep: Deployment) -> dict[str, str]:
    return {"Authorization": f"Bearer {dep.operator_key}"}


async def approval_waiting(http: httpx.AsyncClient, dep: Deployment) -> tuple[str, dict[str, Any]]:
    """An approval session waiting on its ApprovalTool; its session body."""
    response = await http.post(
        "/v1/sessions",
        headers={**dep.auth(), "Idempotency-Key": unique("k")},
        json={"agent": "approval", "input": {"doc": unique("PR"), "amount": 500, "cc": "CC-7"}},
    )
    assert response.status_code == 202, response.text
    sid = str(response.json()["session_id"])

    async def suspended() -> bool:
        body = await session(http, dep, sid)
        return body["state"] == "SUSPENDED" and len(body["waits"]) == 1

    await eventually(suspended, what=f"{sid} waits for its approval")
    return sid, await session(http, dep, sid)


def vote_body(cid: str, approver: str) -> bytes:
    return json.dumps(
        {
            "eventId": unique("evt"),
            "eventType": "oa.approval.decided",
            "correlationId": cid,
            "decision": {"status": "approved", "approver": approver},
        }
    ).encode()


async def test_reassign_needs_an_operator_key(
    http: httpx.AsyncClient, deployment: Deployment
) -> None:
    sid, before = await approval_waiting(http, deployment)
    path = reassign_path(sid, before["waits"][0]["correlation_id"])
    body = {"approvers": ["bob"], "reason": "fd on leave"}
    assert_problem(await http.post(path, json=body), 401)
    wrong = {"Authorization": "Bearer " + "x" * 40}
    assert_problem(await http.post(path, json=body, headers=wrong), 401)
    # A tenant's API key is not an operator's, even for the tenant's own session.
    refused = await http.post(path, json=body, headers=deployment.auth())
    assert refused.status_code in (401, 403)
    assert_problem(refused, refused.status_code)
    after = await session(http, deployment, sid)
    # The same open request. Not the generation: it was seen to move on once after the
    # wait was already visible (bookkeeping, not this request).
    assert after["state"] == "SUSPENDED" and after["waits"] == before["waits"]


async def test_reassign_of_an_unknown_session_or_wait_is_a_problem(
    http: httpx.AsyncClient, deployment: Deployment
) -> None:
    sid, before = await approval_waiting(http, deployment)
    cid = before["waits"][0]["correlation_id"]
    body = {"approvers": ["bob"], "reason": "fd on leave"}
    auth = operator_auth(deployment)
    assert_problem(
        await http.post(reassign_path("s_" + "0" * 24, cid), json=body, headers=auth), 404
    )
    assert_problem(await http.post(reassign_path(sid, "Q" * 22), json=body, headers=auth), 404)
    no_one = await http.post(reassign_path(sid, cid), json={"approvers": []}, headers=auth)
    assert no_one.status_code in (400, 422)
    assert_problem(no_one, no_one.status_code)
    after = await session(http, deployment, sid)
    # The same open request. Not the generation: it was seen to move on once after the
    # wait was already visible (bookkeeping, not this request).
    assert after["state"] == "SUSPENDED" and after["waits"] == before["waits"]


async def test_an_operator_reassigns_an_approval_over_http(
    http: httpx.AsyncClient, deployment: Deployment, services: Any
) -> None:
    sid, before = await approval_waiting(http, deployment)
    [old] = before["waits"]
    response = await http.post(
        reassign_path(sid, old["correlation_id"]),
        json={"approvers": ["bob"], "reason": "fd on leave"},
        headers=operator_auth(deployment),
    )
    assert response.status_code == 202, response.text
    assert response.json()["session_id"] == sid
    assert response.json()["event_id"].startswith("reassign:")

    async def reissued() -> bool:
        waits = (await session(http, deployment, sid))["waits"]
        return len(waits) == 1 and waits[0]["epoch"] > old["epoch"]

    await eventually(reissued, what="the reassigned approval opens in a new epoch")
    mid = await session(http, deployment, sid)
    [new] = mid["waits"]
    assert new["correlation_id"] != old["correlation_id"] and mid["state"] == "SUSPENDED"

    # fd answers the withdrawn request: observed, never applied.
    late = vote_body(old["correlation_id"], "fd")
    stale = await http.post("/v1/hooks/oa", content=late, headers=signed(deployment, "oa", late))
    # The index still names the old request (its record), but its wait is gone: closed.
    assert stale.status_code == 200, stale.text
    assert stale.json()["outcome"] == "closed"

    async def observed() -> bool:
        return (await session(http, deployment, sid))["observations"] > mid["observations"]

    await eventually(observed, what="the old request's answer is observed")
    after = await session(http, deployment, sid)
    assert after["state"] == "SUSPENDED" and after["waits"] == mid["waits"]
    snap = await services.snapshots.load(sid)
    # The runtime's epoch gate saw an answer to the withdrawn request: stale.
    assert [o.reason.value for o in snap.observations] == ["reassigned", "stale"]

    # bob, the new approver, answers the new request: the session completes.
    vote = vote_body(new["correlation_id"], "bob")
    accepted = await http.post("/v1/hooks/oa", content=vote, headers=signed(deployment, "oa", vote))
    assert accepted.status_code == 202, accepted.text
    await reaches(http, deployment, sid, "COMPLETED")
    assert (await session(http, deployment, sid))["result"]["decision"] == "approved"
