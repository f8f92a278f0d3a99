"""Hostile input at the HTTP edge, driven in-process (``tests.runtime.api_app``): every
refusal is a 4xx problem (or the console's error page), says what was wrong, and leaves
nothing stored or changed."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import quote

import pytest

from tests.conftest import eventually
from tests.runtime.api_app import App, api_app
from tests.runtime.test_gateway import SOURCES
from torpor.deliveries import Delivery, DeliveryStatus
from torpor.errors import UnsafeUrl
from torpor.lifecycle import SessionState

FORM = {"Content-Type": "application/x-www-form-urlencoded"}


@pytest.fixture
async def app(
    tmp_path: Path, redis_url: str, redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[App]:
    async with api_app(tmp_path, redis_url, redis_prefix, monkeypatch) as a:
        yield a


async def suspended(app: App, doc: str = "PR-1") -> str:
    """A session of tenant acme waiting on its approval."""
    answer = await app.http.post(
        "/v1/sessions",
        headers={**app.auth(), "Idempotency-Key": doc},
        json={"agent": "purchase", "input": {"doc": doc, "amount": 5}},
    )
    assert answer.status_code == 202, answer.text
    session_id: str = answer.json()["session_id"]

    async def asleep() -> bool:
        return (await app.env.load(session_id)).state is SessionState.SUSPENDED

    await eventually(asleep, timeout_s=2.0, interval_s=0.02, what=f"{session_id} suspends")
    return session_id


@pytest.mark.parametrize("due", ["nan", "inf", "-inf", "1e10", "-1e10", "1e300"])
async def test_a_due_within_filter_out_of_range_is_a_400_page_not_a_500(
    app: App, due: str, caplog: pytest.LogCaptureFixture
) -> None:
    await suspended(app)  # the filter is applied to listed sessions: one is needed
    await app.console_login(app.keys["acme"])
    with caplog.at_level(logging.ERROR):
        answer = await app.http.get("/console/", params={"due": due})
    assert answer.status_code == 400, answer.text[:300]
    assert "due-within" in answer.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    # In range it filters, as before.
    assert (await app.http.get("/console/", params={"due": "-5"})).status_code == 200


@pytest.mark.parametrize("payload", ["NaN", "1e999", '{"status": "approved", "note": -Infinity}'])
async def test_a_force_resolve_with_a_number_json_cannot_hold_is_refused_and_delivers_nothing(
    app: App, payload: str
) -> None:
    # The parser took NaN, Infinity and 1e999; stored, each became null: the session
    # resumed on an answer the operator never gave (decision null, COMPLETED).
    session_id = await suspended(app)
    wait = (await app.env.load(session_id)).waits[0]
    csrf = await app.console_login(app.operator_key)
    form = f"csrf={csrf}&reason=r&correlation_id={wait.correlation_id}&payload={quote(payload)}"
    answer = await app.http.post(
        f"/console/sessions/{session_id}/resolve", content=form, headers=FORM
    )
    assert answer.status_code == 400, answer.text[:300]
    assert "JSON" in answer.text
    snap = await app.env.load(session_id)
    assert snap.state is SessionState.SUSPENDED and snap.waits == [wait]
    assert await app.env.services.inbox.pending(session_id, processed=()) == []


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("PUT", "/v1/sessions", {"GET", "HEAD", "POST"}),
        ("DELETE", "/v1/sessions/s_1", {"GET", "HEAD"}),
        ("GET", "/v1/sessions/s_1/cancel", {"POST"}),
    ],
)
async def test_a_method_not_allowed_names_the_allowed_ones(
    app: App, method: str, path: str, allowed: set[str]
) -> None:
    # RFC 9110 15.5.6: a 405 MUST carry Allow. Starlette sets it on its exception; the
    # problem handler dropped the exception's headers.
    answer = await app.http.request(method, path, headers=app.auth())
    assert answer.status_code == 405
    assert answer.headers["content-type"] == "application/problem+json"
    assert {m.strip() for m in answer.headers["allow"].split(",")} == allowed


@pytest.mark.parametrize(
    "authorization", [None, "Basic YTpi", "Bearer", "Bearer tpk_not-a-key", "operator"]
)
async def test_an_api_401_names_the_bearer_scheme(app: App, authorization: str | None) -> None:
    # RFC 9110 15.5.2 / RFC 6750 3: a 401 MUST carry WWW-Authenticate.
    value = f"Bearer {app.operator_key}" if authorization == "operator" else authorization
    headers = {} if value is None else {"Authorization": value}
    answer = await app.http.get("/v1/sessions", headers=headers)
    assert answer.status_code == 401
    assert answer.headers["content-type"] == "application/problem+json"
    assert answer.headers["www-authenticate"].startswith("Bearer")
    # The operator routes likewise; there a tenant's key is the one that is not valid.
    if authorization == "operator":
        headers = app.auth()
    operator = await app.http.post(
        "/v1/operator/sessions/s_1/waits/c_1/reassign", headers=headers, json={"approvers": ["x"]}
    )
    assert operator.status_code == 401 and operator.headers["www-authenticate"].startswith("Bearer")


async def test_the_notification_secret_without_notifications_set_up_is_a_400_not_a_500(
    tmp_path: Path,
    redis_url: str,
    redis_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # As a submit with a callback_url there is refused: the caller asked for what this
    # deployment does not do; nothing failed inside it.
    unset = {"notifications": {"key": None}}
    async with api_app(tmp_path, redis_url, redis_prefix, monkeypatch, extra=unset) as app:
        with caplog.at_level(logging.ERROR):
            answer = await app.http.get(
                "/v1/notifications/secret",
                params={"url": "https://example.com/"},
                headers=app.auth(),
            )
        assert answer.status_code == 400, answer.text
        assert answer.headers["content-type"] == "application/problem+json"
        assert "notify_key" in answer.json()["detail"]
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize("path", ["/healthz", "/v1/sessions"])
async def test_head_answers_as_get_without_a_body(app: App, path: str) -> None:
    # RFC 9110 9.3.2: a load balancer or uptime probe checking /healthz with HEAD was
    # answered 405 (FastAPI routes take only the methods they name).
    get = await app.http.get(path, headers=app.auth())
    head = await app.http.head(path, headers=app.auth())
    assert head.status_code == get.status_code, head.text
    assert head.content == b""
    assert head.headers["content-type"] == get.headers["content-type"]


async def test_head_on_a_stream_answers_and_stops_it(app: App) -> None:
    # The session's event stream runs until the client leaves: HEAD gets its headers and
    # the stream is stopped, not streamed into nothing while the connection lives.
    session_id = await suspended(app)
    head = await asyncio.wait_for(
        app.http.head(f"/v1/sessions/{session_id}/events", headers=app.auth()), timeout=10
    )
    assert head.status_code == 200 and head.content == b""
    assert head.headers["content-type"].startswith("text/event-stream")


async def test_head_on_a_path_without_get_is_still_405(app: App) -> None:
    answer = await app.http.head("/v1/sessions/s_1/cancel", headers=app.auth())
    assert answer.status_code == 405
    assert {m.strip() for m in answer.headers["allow"].split(",")} == {"POST"}


@pytest.mark.parametrize(
    "body",
    [
        '{"agent": "purchase", "agent": "nope", "input": {"doc": "PR-9"}}',
        '{"agent": "purchase", "input": {"doc": "PR-9", "amount": 5, "amount": 50000}}',
    ],
    ids=["top", "nested"],
)
async def test_a_name_twice_in_one_json_object_is_refused_and_nothing_is_made(
    app: App, body: str
) -> None:
    # The last of two equal names won, where a proxy in front may have checked the first
    # (a smuggling vector the webhooks already refuse).
    answer = await app.http.post(
        "/v1/sessions",
        headers={**app.auth(), "Idempotency-Key": "dup", "Content-Type": "application/json"},
        content=body,
    )
    assert answer.status_code == 400, answer.text
    assert answer.headers["content-type"] == "application/problem+json"
    assert "appears twice" in answer.json()["detail"]
    listed = await app.http.get("/v1/sessions", headers=app.auth())
    assert listed.json()["items"] == []


class StalledClient:
    """An ASGI client that reads the answer's headers, then stops reading (its send
    waits to drain, as uvicorn's does for a full write buffer) and leaves."""

    def __init__(self) -> None:
        self.requested, self.stalled, self.gone = False, asyncio.Event(), False
        self.statuses: list[object] = []

    async def receive(self) -> dict[str, object]:
        if not self.requested:
            self.requested = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await self.stalled.wait()
        self.gone = True
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, object]) -> None:
        if message["type"] == "http.response.start":
            self.statuses.append(message["status"])
        elif message.get("more_body"):
            self.stalled.set()
            await asyncio.Event().wait()  # never drains


@pytest.mark.parametrize("stream", ["events", "console"])
async def test_a_client_gone_while_its_stream_was_being_sent_gives_the_slot_back(
    app: App, stream: str
) -> None:
    # uvicorn (ASGI 2.3) has Starlette stream in a task beside a listener for the
    # disconnect. A client that stopped reading holds a send (uvicorn waits for its
    # write buffer to drain); when it leaves, the listener cancels the task inside that
    # send, outside the stream's own iteration, and nothing closed the stream: its slot
    # was never given back. A few such clients and the tenant (the console's login key)
    # was refused (429) every stream on the replica until it restarted.
    import serve_app

    session_id = await suspended(app)
    if stream == "events":
        path, cap = f"/v1/sessions/{session_id}/events", 4  # api_app's max_per_tenant
        credential = (b"authorization", app.auth()["Authorization"].encode())
    else:
        await app.console_login(app.keys["acme"])
        path = "/console/live"
        cap = app.env.services.settings.security.max_streams_per_tenant
        cookies = "; ".join(f"{k}={v}" for k, v in app.http.cookies.items())
        credential = (b"cookie", cookies.encode())
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"test"), credential],
        "client": ("127.0.0.1", 50000),
        "server": ("test", 80),
    }
    for _ in range(cap + 1):
        client = StalledClient()
        call = serve_app.api(dict(scope), client.receive, client.send)  # a mount changes it
        await asyncio.wait_for(call, timeout=10)
        assert client.statuses == [200] and client.gone


async def test_a_reconnect_to_an_ended_stream_with_nothing_missed_is_a_204(app: App) -> None:
    # An EventSource reconnects whenever its stream closes, for ever, unless answered
    # 204 No Content (WHATWG HTML, server-sent events): a browser following a session
    # that ended reconnected every few seconds, each time an empty 200.
    session_id = await suspended(app)
    cancel = await app.http.post(f"/v1/sessions/{session_id}/cancel", headers=app.auth())
    assert cancel.status_code == 202, cancel.text
    path = f"/v1/sessions/{session_id}/events"
    whole = await asyncio.wait_for(app.http.get(path, headers=app.auth()), timeout=10)
    assert whole.status_code == 200 and '"state": "CANCELLED"' in whole.text
    last = [line for line in whole.text.splitlines() if line.startswith("id: ")][-1][4:]
    again = {**app.auth(), "Last-Event-ID": last}
    answer = await asyncio.wait_for(app.http.get(path, headers=again), timeout=10)
    assert answer.status_code == 204 and answer.content == b""
    # One that missed the end still gets it.
    missed = {**app.auth(), "Last-Event-ID": str(int(last) - 1)}
    answer = await asyncio.wait_for(app.http.get(path, headers=missed), timeout=10)
    assert answer.status_code == 200 and '"state": "CANCELLED"' in answer.text


async def test_a_stream_whose_session_retention_deletes_ends_cleanly_then_404s(app: App) -> None:
    # The route looks the session up before its 200; the stream read it again after,
    # and once retention had deleted it SessionNotFound escaped the app mid-response
    # (a traceback in the server's log, the connection cut without its last chunk).
    from datetime import timedelta

    import ray.serve

    from torpor.service.streams import SessionStreams

    session_id = await suspended(app)
    ingress = ray.serve.get_replica_context().servable_object  # api_app's, in-process

    async def purge(seconds: float) -> None:  # the stream's sleep: no wall time passes
        if (await app.env.load(session_id)).state is SessionState.CANCELLED:
            return
        await ingress.control.cancel(session_id, tenant="acme")

        async def cancelled() -> bool:
            return (await app.env.load(session_id)).state is SessionState.CANCELLED

        await eventually(cancelled, timeout_s=5.0, interval_s=0.02, what="cancelled")
        retention = app.env.services.retention
        assert retention is not None
        now, day = app.env.clock.now() + timedelta(days=31), timedelta(hours=24)
        purged: list[tuple[str, str]] = []

        async def swept() -> bool:
            # The ended marker comes after the terminal snapshot, behind a flush of the
            # disk: a sweep before it finds nothing to purge yet.
            report = await retention.sweep(now=now, keep=30 * day, windows=day, limit=10)
            purged.extend(report.purged)
            return bool(purged)

        await eventually(swept, timeout_s=5.0, interval_s=0.02, what="the session purged")
        assert purged == [("acme", session_id)]

    ingress.streams = SessionStreams(ingress.control, max_per_tenant=4, sleep=purge)
    path = f"/v1/sessions/{session_id}/events"
    sent: list[dict[str, object]] = []
    asked = False

    async def receive() -> dict[str, object]:  # a client that stays for the whole answer
        nonlocal asked
        if not asked:
            asked = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"test"), (b"authorization", app.auth()["Authorization"].encode())],
        "client": ("127.0.0.1", 50000),
        "server": ("test", 80),
    }
    import serve_app

    await asyncio.wait_for(serve_app.api(scope, receive, send), timeout=10)  # nothing raised
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    body = b"".join(m.get("body", b"") for m in sent[1:])  # type: ignore[misc]
    assert b'"state": "SUSPENDED"' in body  # what the stream showed before the purge
    last = [line for line in body.decode().splitlines() if line.startswith("id: ")][-1][4:]
    again = await app.http.get(path, headers={**app.auth(), "Last-Event-ID": last})
    assert again.status_code == 404, again.text
    assert again.headers["content-type"] == "application/problem+json"
    assert again.json()["type"].endswith("session_not_found")


async def test_the_handshake_grants_a_rate_whenever_the_sender_asked_for_one(
    tmp_path: Path, redis_url: str, redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CloudEvents webhook spec 4.2.2: ``WebHook-Allowed-Rate`` MUST be returned if the
    request carried ``WebHook-Request-Rate``. A source with no rate configured answered
    without it, so a conforming sender read the grant as incomplete."""
    source = {"tenant": "acme", "secrets": ["s" * 32], "allowed_origins": ["emitter.example"]}
    extra = {"sources": {**SOURCES, "ce": source}}
    async with api_app(tmp_path, redis_url, redis_prefix, monkeypatch, extra=extra) as app:
        asked = {"WebHook-Request-Origin": "emitter.example", "WebHook-Request-Rate": "120"}
        answer = await app.http.options("/v1/hooks/ce", headers=asked)
        assert answer.status_code == 200
        assert answer.headers["WebHook-Allowed-Origin"] == "emitter.example"
        assert answer.headers["WebHook-Allowed-Rate"] == "*"  # none configured: no limit


async def test_a_notice_in_a_link_is_shown_only_as_an_action_gave_it(app: App) -> None:
    # The session page shows its action's outcome from the address it was sent to: any
    # link could put any words in the console's mouth, in its status box.
    session_id = await suspended(app)
    csrf = await app.console_login(app.operator_key)
    lure = "Your login expired: paste your operator key at https://evil.example/console"
    page = await app.http.get(f"/console/sessions/{session_id}", params={"notice": lure})
    assert page.status_code == 200
    assert "evil.example" not in page.text
    # An action's own outcome still shows after its redirect.
    done = await app.http.post(
        f"/console/sessions/{session_id}/cancel",
        content=f"csrf={csrf}&reason=duplicate",
        headers=FORM,
        follow_redirects=True,
    )
    assert 'role="status">cancel requested</p>' in done.text


async def test_a_forged_capability_link_is_on_the_audit_record(app: App) -> None:
    # Refused before its body is read (an unauthenticated sender must not make the replica
    # buffer anything), and audited all the same, as every other webhook refusal is:
    # someone probing for tokens shows in the audit log.
    answer = await app.http.post("/v1/callbacks/v1.forged.token", json={"status": "approved"})
    assert answer.status_code == 401
    services = app.env.services
    await services.audit.close()
    blocks = (await services.store.list("audit/")).keys
    records = [
        json.loads(line)
        for key in blocks
        for line in (await services.store.get(key)).data.decode().splitlines()
    ]
    assert [(r["source"], r["verdict"], r["body_sha256"]) for r in records] == [
        ("capability", "rejected:invalid_token", "")
    ]


async def test_a_filtered_deliveries_page_reads_a_bounded_number_of_deliveries(
    app: App, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A status filter made one request read every delivery the tenant ever had, one
    # object at a time, until a page filled: a tenant with a year of delivered
    # notifications and no pending one had ``?status=pending`` read all of them.
    now = app.env.services.clock.now()
    delivered = [
        Delivery(
            delivery_id=f"d_{i:05d}",
            tenant="acme",
            session_id="s_1",
            url="https://example.com/hook",
            event_type="session.completed",
            payload={},
            status=DeliveryStatus.DELIVERED,
            created_at=now,
        )
        for i in range(1_100)
    ]
    pending = delivered[0].model_copy(
        update={"delivery_id": "d_99999", "status": DeliveryStatus.PENDING}
    )
    repo = app.env.services.deliveries
    for start in range(0, len(delivered), 100):
        await asyncio.gather(*(repo.create(d) for d in delivered[start : start + 100]))
    await repo.create(pending)
    store = repo.store  # type: ignore[attr-defined]
    reads = 0
    real_get = store.get

    async def counted(key: str, **kw: object) -> object:
        nonlocal reads
        reads += 1
        return await real_get(key, **kw)

    monkeypatch.setattr(store, "get", counted)
    found: list[str] = []
    cursor: str | None = None
    for _ in range(10):
        reads = 0
        params = {"status": "pending", "limit": "10", **({"cursor": cursor} if cursor else {})}
        answer = await app.http.get("/v1/deliveries", params=params, headers=app.auth())
        assert answer.status_code == 200, answer.text
        assert reads <= 1_000, f"one page read {reads} deliveries"
        found += [d["delivery_id"] for d in answer.json()["items"]]
        cursor = answer.json()["next_cursor"]
        if cursor is None:
            break
    assert found == ["d_99999"], "following the cursor still finds every match"


@pytest.mark.parametrize("cap", ["true", '"5"', "5.0"])
async def test_a_batch_cap_that_is_no_whole_number_is_refused_and_nothing_is_made(
    app: App, cap: str
) -> None:
    """``"max_running": true`` was taken as a cap of 1, ``"5"`` as 5: a cap the sender
    never wrote, one running document at a time for a whole batch."""
    body = f'{{"agent": "purchase", "documents": [{{"doc": "a"}}], "max_running": {cap}}}'
    answer = await app.http.post(
        "/v1/batches",
        headers={**app.auth(), "Idempotency-Key": f"cap-{cap}", "Content-Type": "application/json"},
        content=body,
    )
    assert answer.status_code in (400, 422), answer.text
    assert answer.headers["content-type"] == "application/problem+json"
    assert "max_running" in answer.text
    # Nothing was made under the key: the sender's corrected request is a new batch.
    fixed = body.replace(f'"max_running": {cap}', '"max_running": 5')
    again = await app.http.post(
        "/v1/batches",
        headers={**app.auth(), "Idempotency-Key": f"cap-{cap}", "Content-Type": "application/json"},
        content=fixed,
    )
    assert again.status_code == 202, again.text


@pytest.mark.parametrize(
    ("ids", "said"),
    [
        (["a", "b", "a"], "documents[2].id 'a' is also documents[0].id"),
        ([1, "1"], "documents[1].id '1' is also documents[0].id"),
        ([True], "documents[0].id: a string or an integer, not true"),
        ([{"a": 1}], "documents[0].id: a string or an integer, not {"),
        ([1.5], "documents[0].id: a string or an integer, not 1.5"),
    ],
    ids=["repeated", "int-and-its-text", "bool", "object", "float"],
)
async def test_a_batch_whose_document_ids_repeat_or_are_not_strings_is_refused_unstored(
    app: App, ids: list[object], said: str
) -> None:
    """Ids repeated were accepted, and the results then held several lines with one
    document_id; ids neither strings nor integers were written as Python's ``str()``
    (``"True"``, ``"{'a': 1}"``). Both are refused before anything is stored."""
    body = {"agent": "purchase", "documents": [{"id": x, "doc": "a"} for x in ids]}
    headers = {**app.auth(), "Idempotency-Key": "bad-ids"}
    answer = await app.http.post("/v1/batches", headers=headers, json=body)
    assert answer.status_code == 400, answer.text
    assert answer.headers["content-type"] == "application/problem+json"
    assert said in answer.json()["detail"]
    assert (await app.env.services.store.list("batch")).keys == [], "nothing is stored"
    body["documents"] = [{"id": "a", "doc": "a"}, {"id": 2, "doc": "b"}, {"doc": "c"}]
    again = await app.http.post("/v1/batches", headers=headers, json=body)
    assert again.status_code == 202, again.text


async def test_batch_metadata_copied_into_every_session_is_bounded_and_nothing_is_stored(
    app: App,
) -> None:
    """A batch's metadata is copied into each document's session (and rewritten with its
    every commit): 1 MB of it beside 100 empty documents, a 1 MB request, was accepted
    and made 100 MB of sessions, and 10,000 documents 10 GB."""
    body = {"agent": "purchase", "documents": [{}] * 100, "metadata": {"k": "x" * 1_000_000}}
    headers = {**app.auth(), "Idempotency-Key": "big-metadata"}
    answer = await app.http.post("/v1/batches", headers=headers, json=body)
    assert answer.status_code == 400, answer.text
    assert answer.headers["content-type"] == "application/problem+json"
    assert "metadata" in answer.text
    store = app.env.services.store
    assert (await store.list("batch")).keys == [], "nothing of the batch is stored"
    body["metadata"] = {"k": "x" * 100}
    again = await app.http.post("/v1/batches", headers=headers, json=body)
    assert again.status_code == 202, again.text


async def test_a_retried_batch_submit_finds_its_batch_while_its_callback_host_does_not_resolve(
    app: App, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The callback URL was resolved again before the batch was looked for: the retry of
    a request whose answer was lost, sent while the callback host's DNS failed, was
    refused 400 ("does not resolve"), though its batch was accepted and running; a client
    taking the 4xx for final never followed the batch it had."""
    body = {"agent": "purchase", "documents": [{"doc": "a"}], "callback_url": "http://127.0.0.1/cb"}
    headers = {**app.auth(), "Idempotency-Key": "retried-with-callback"}
    first = await app.http.post("/v1/batches", headers=headers, json=body)
    assert first.status_code == 202, first.text

    async def unresolvable(url: str, **kwargs: object) -> None:
        raise UnsafeUrl("callback_url host '127.0.0.1' does not resolve")

    monkeypatch.setattr("torpor.service.batches.check_callback", unresolvable)
    again = await app.http.post("/v1/batches", headers=headers, json=body)
    assert again.status_code == 202, again.text
    assert again.json()["batch_id"] == first.json()["batch_id"]
    # A new batch is still checked.
    other = await app.http.post(
        "/v1/batches", headers={**app.auth(), "Idempotency-Key": "another"}, json=body
    )
    assert other.status_code == 400, other.text


async def test_a_retried_batch_submit_finds_its_batch_under_limits_tightened_since(
    app: App, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The request was checked (its agent configured, its metadata's size) before its
    batch was looked for: a retry of an accepted request whose answer was lost, sent after
    a limit was tightened, was refused 400 though its batch was accepted and running."""
    body = {"agent": "purchase", "documents": [{"doc": "a"}], "metadata": {"k": "x" * 1000}}
    headers = {**app.auth(), "Idempotency-Key": "retried-under-a-new-limit"}
    first = await app.http.post("/v1/batches", headers=headers, json=body)
    assert first.status_code == 202, first.text
    monkeypatch.setattr("torpor.service.batches.METADATA_MAX_BYTES", 100)
    again = await app.http.post("/v1/batches", headers=headers, json=body)
    assert again.status_code == 202, again.text
    assert again.json()["batch_id"] == first.json()["batch_id"]
    other = await app.http.post(
        "/v1/batches", headers={**app.auth(), "Idempotency-Key": "under-the-new-limit"}, json=body
    )
    assert other.status_code == 400, other.text


async def test_a_reassignment_of_a_wait_that_is_no_approval_is_a_422_and_delivers_nothing(
    app: App,
) -> None:
    """The purchase agent's wait is no approval: its tool takes no reassignment. Before,
    the operator was answered 202 and the instruction was stored in the session's inbox,
    where the session only observed it: the operator never learned it did nothing."""
    sid = await suspended(app, "PR-RA")
    [wait] = (await app.env.load(sid)).waits
    answer = await app.http.post(
        f"/v1/operator/sessions/{sid}/waits/{wait.correlation_id}/reassign",
        headers={"Authorization": f"Bearer {app.operator_key}"},
        json={"approvers": ["bob"], "reason": "fd on leave"},
    )
    assert answer.status_code == 422, answer.text
    assert answer.headers["content-type"] == "application/problem+json"
    problem = answer.json()
    assert problem["type"].endswith("/reassignment_refused")
    assert "no reassignment" in problem["detail"]
    assert await app.env.services.inbox.pending(sid, processed=()) == []
    after = await app.env.load(sid)
    assert after.state is SessionState.SUSPENDED and after.waits == [wait]
