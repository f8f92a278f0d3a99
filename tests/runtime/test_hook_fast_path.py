"""``POST /v1/hooks/{source}`` answered in front of FastAPI (``torpor.entry.hooks``), as
ASGI, on the local store and a real Redis: a signed webhook is accepted without the app
being called; anything else, and everything before the gateway is bound, goes to the
app; refusals are problem+json and audited, as the FastAPI route's are."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from storage import keys
from storage.codec import SnapshotCodec
from storage.snapshots import ObjectSnapshots
from tests.runtime.test_gateway import JSON, SECRET, SOURCES, body
from tests.support.harness import Env, local_env
from torpor.entry.hooks import ASGIApp, HookFastPath, HookRoute, ServerHookFastPath
from torpor.lifecycle import SessionState
from torpor.models import SCHEMA_VERSION
from torpor.service.gateway import WebhookGateway
from torpor.webhooks.signing import Scheme, sign


class Downstream:
    """The FastAPI app's stand-in: notes what reached it, answers 418."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.paths.append(f"{scope['method']} {scope['path']}")
        await send({"type": "http.response.start", "status": 418, "headers": []})
        await send({"type": "http.response.body", "body": b""})


@pytest.fixture
async def env(tmp_path: Path, redis_url: str, redis_prefix: str) -> AsyncIterator[Env]:
    sources = {"oa": {**SOURCES["oa"], "max_body_bytes": 4096}}
    async with local_env(tmp_path, redis_url, redis_prefix, extra={"sources": sources}) as e:
        yield e


def bound(env: Env) -> tuple[HookFastPath, Downstream, list[str]]:
    route, app, prepared = HookRoute(), Downstream(), []

    async def prepare() -> None:
        prepared.append("checked")

    route.bind(WebhookGateway(env.control), clock=env.clock, prepare=prepare)
    return HookFastPath(app, route=route), app, prepared


async def ready() -> None:
    """A store already checked for conditional writes (``HookRoute.bind``'s ``prepare``)."""


def server_bound(
    env: Env, *, prefix: str = "/", limit: int = 200
) -> tuple[ServerHookFastPath, Downstream, HookRoute]:
    """The server's fast path (before Serve's wrappers), bound as a replica binds it."""
    route, app = HookRoute(limit=limit), Downstream()
    route.bind(WebhookGateway(env.control), clock=env.clock, prepare=ready, prefix=prefix)
    return ServerHookFastPath(app, route=route), app, route


async def call(
    asgi: ASGIApp,
    path: str,
    *,
    chunks: list[bytes],
    headers: dict[str, str] | None = None,
    method: str = "POST",
    root_path: str = "",
) -> tuple[int, dict[str, str], Any]:
    pending = list(chunks)

    async def receive() -> dict[str, Any]:
        chunk = pending.pop(0) if pending else b""
        return {"type": "http.request", "body": chunk, "more_body": bool(pending)}

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "root_path": root_path,
        "query_string": b"",
        "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()],
    }
    await asgi(scope, receive, send)
    start, *rest = sent
    answer = {k.decode(): v.decode() for k, v in start["headers"]}
    data = b"".join(m.get("body", b"") for m in rest)
    return start["status"], answer, json.loads(data) if data else None


async def signed_answer(
    env: Env, event_id: str = "e1", doc: str = "PR-1"
) -> tuple[str, bytes, dict[str, str]]:
    sid = await env.submit(doc)
    wait = (await env.load(sid)).waits[0]
    raw = body(wait.correlation_id, event_id)
    return sid, raw, {**sign(Scheme.TORPOR, raw, SECRET, now=env.clock.now()), "Content-Type": JSON}


async def test_a_signed_webhook_is_accepted_without_the_app(env: Env) -> None:
    asgi, app, prepared = bound(env)
    sid, raw, headers = await signed_answer(env)
    # Sent in two chunks, as a client may: the body is whole before it is verified.
    status, answer, data = await call(
        asgi, "/v1/hooks/oa", chunks=[raw[:10], raw[10:]], headers=headers
    )
    assert (status, data) == (202, {"event_id": "e1", "duplicate": False, "outcome": "accepted"})
    assert answer["content-type"] == "application/json"
    assert int(answer["content-length"]) == len(json.dumps(data, separators=(",", ":")))
    assert app.paths == [] and prepared == ["checked"]
    assert (await env.load(sid)).state is SessionState.COMPLETED


async def test_other_requests_and_an_unbound_route_go_to_the_app(env: Env) -> None:
    asgi, app, _ = bound(env)
    for method, path in [
        ("GET", "/v1/hooks/oa"),
        ("OPTIONS", "/v1/hooks/oa"),
        ("POST", "/v1/hooks/oa/more"),
        ("POST", "/v1/hooks/"),
        ("POST", "/v1/sessions"),
    ]:
        status, _, _ = await call(asgi, path, chunks=[b"{}"], method=method)
        assert status == 418, (method, path)
    unbound = HookFastPath(app, route=HookRoute())
    assert (await call(unbound, "/v1/hooks/oa", chunks=[b"{}"]))[0] == 418
    assert len(app.paths) == 6


async def test_a_prefix_the_app_is_mounted_under_is_routed_as_starlette_routes_it(
    env: Env,
) -> None:
    asgi, app, _ = bound(env)
    _, raw, headers = await signed_answer(env)
    status, _, _ = await call(
        asgi, "/deferred/v1/hooks/oa", chunks=[raw], headers=headers, root_path="/deferred"
    )
    assert status == 202 and app.paths == []


async def test_refusals_are_problem_json_and_audited(env: Env) -> None:
    asgi, app, _ = bound(env)
    _, raw, headers = await signed_answer(env)
    forged = {**headers, "X-Torpor-Signature": "0" * 64}
    status, answer, problem = await call(asgi, "/v1/hooks/oa", chunks=[raw], headers=forged)
    assert status == 401 and answer["content-type"] == "application/problem+json"
    assert problem["status"] == 401 and problem["instance"] == "/v1/hooks/oa"
    status, answer, problem = await call(asgi, "/v1/hooks/nope", chunks=[raw], headers=headers)
    assert status == 404 and answer["content-type"] == "application/problem+json"
    # Refused while streamed (no Content-Length): 413, and on the audit record.
    status, _, problem = await call(
        asgi, "/v1/hooks/oa", chunks=[b"x" * 3000, b"x" * 3000], headers={"Content-Type": JSON}
    )
    assert status == 413 and problem["status"] == 413
    assert app.paths == []
    await env.services.audit.close()
    verdicts = []
    for key in (await env.services.store.list("audit/")).keys:
        lines = (await env.services.store.get(key)).data.splitlines()
        verdicts += [json.loads(line)["verdict"] for line in lines]
    assert "rejected:body_too_large" in verdicts
    assert any(v.startswith("rejected:") and v != "rejected:body_too_large" for v in verdicts)


async def test_a_sender_that_hangs_up_mid_body_gets_no_answer_and_stores_nothing(
    env: Env,
) -> None:
    asgi, _, _ = bound(env)
    sid, raw, headers = await signed_answer(env)
    sent: list[Any] = []
    messages = [
        {"type": "http.request", "body": raw[:5], "more_body": True},
        {"type": "http.disconnect"},
    ]

    async def receive() -> Any:
        return messages.pop(0)

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/hooks/oa",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
    }
    await asgi(scope, receive, send)
    assert sent == []
    assert (await env.load(sid)).state is SessionState.SUSPENDED


async def test_a_session_a_newer_torpor_holds_is_503_and_the_webhook_may_come_again(
    env: Env,
) -> None:
    """Mid rolling upgrade: this node cannot read the session a newer one wrote. Not a 500
    (nothing is wrong, a retry may reach a newer node): 503 with Retry-After, nothing
    stored, and the replay claim given back, so the sender's retry is taken."""
    asgi, _, _ = bound(env)
    sid, raw, headers = await signed_answer(env)
    store, snapshots = env.services.store, ObjectSnapshots(env.services.store)
    stored = (await store.get(keys.snapshot(sid))).data
    newer = (await snapshots.load_stored(sid)).model_copy(
        update={"schema_version": SCHEMA_VERSION + 1}
    )
    await store.put(keys.snapshot(sid), SnapshotCodec().encode(newer))
    status, answer, problem = await call(asgi, "/v1/hooks/oa", chunks=[raw], headers=headers)
    assert (status, answer["content-type"]) == (503, "application/problem+json")
    assert problem["type"].endswith("/snapshot_schema_too_new") and problem["status"] == 503
    assert int(answer["retry-after"]) >= 1
    assert await env.services.inbox.pending(sid, processed=set()) == []
    await store.put(keys.snapshot(sid), stored)  # as if the retry reached a newer node
    status, _, data = await call(asgi, "/v1/hooks/oa", chunks=[raw], headers=headers)
    assert status == 202 and data["duplicate"] is False
    assert (await env.load(sid)).state is SessionState.COMPLETED


async def test_before_serve_routes_it_the_app_prefix_is_in_the_path(env: Env) -> None:
    """Serve's server sees the whole path: the app's route prefix is still in it (Serve
    strips it later, into ``root_path``). Only a webhook under the replica's own prefix is
    taken there; any other goes on, to be routed by Serve as before."""
    asgi, app, _ = server_bound(env, prefix="/deferred")
    _, raw, headers = await signed_answer(env)
    status, _, data = await call(asgi, "/deferred/v1/hooks/oa", chunks=[raw], headers=headers)
    assert (status, data["outcome"]) == (202, "accepted") and app.paths == []
    for path in ["/v1/hooks/oa", "/deferredx/v1/hooks/oa", "/deferred/v1/hooks/oa/x"]:
        assert (await call(asgi, path, chunks=[raw], headers=headers))[0] == 418, path
    at_root, root_app, _ = server_bound(env)
    assert (await call(at_root, "/deferred/v1/hooks/oa", chunks=[raw], headers=headers))[0] == 418
    assert root_app.paths == ["POST /deferred/v1/hooks/oa"]
    # The server's own root path comes first, as uvicorn puts it in both.
    _, raw2, headers2 = await signed_answer(env, "e2", doc="PR-2")
    status, _, _ = await call(
        asgi, "/edge/deferred/v1/hooks/oa", chunks=[raw2], headers=headers2, root_path="/edge"
    )
    assert status == 202


async def test_refusals_before_serve_are_problem_json_too(env: Env) -> None:
    asgi, app, route = server_bound(env)
    _, raw, headers = await signed_answer(env)
    forged = {**headers, "X-Torpor-Signature": "0" * 64, "X-Request-ID": "rid-1"}
    status, answer, problem = await call(asgi, "/v1/hooks/oa", chunks=[raw], headers=forged)
    assert (status, answer["content-type"]) == (401, "application/problem+json")
    assert problem["instance"] == "/v1/hooks/oa" and app.paths == []
    assert route.in_flight == 0
    assert answer["x-request-id"] == "rid-1"


async def test_the_answer_before_serve_carries_the_request_id_serve_would_have_set(
    env: Env,
) -> None:
    """Serve's own middleware (which answers ``X-Request-ID``) runs inside the server's:
    the webhook's answer echoes the id HAProxy set on the request, or a fresh one."""
    asgi, _, _ = server_bound(env)
    _, raw, headers = await signed_answer(env)
    given = {**headers, "X-Request-ID": "from-haproxy"}
    status, answer, _ = await call(asgi, "/v1/hooks/oa", chunks=[raw], headers=given)
    assert (status, answer["x-request-id"]) == (202, "from-haproxy")
    _, raw2, headers2 = await signed_answer(env, "e2", doc="PR-2")
    status, answer, _ = await call(asgi, "/v1/hooks/oa", chunks=[raw2], headers=headers2)
    assert status == 202 and len(answer["x-request-id"]) == 36  # a fresh uuid, as Serve's


async def test_a_server_on_another_loop_than_the_services_hands_webhooks_to_serve(
    env: Env,
) -> None:
    """With Serve's user code on a thread of its own, the replica's server runs another
    loop than the one the services (their connections) were opened on: the middleware
    passes the webhook on, to be handled on the services' loop by Serve's path."""
    asgi, app, route = server_bound(env)
    other = asyncio.new_event_loop()
    try:
        assert route.bound is not None
        route.bound = dataclasses.replace(route.bound, loop=other)  # bound over there
        _, raw, headers = await signed_answer(env)
        assert (await call(asgi, "/v1/hooks/oa", chunks=[raw], headers=headers))[0] == 418
        assert app.paths == ["POST /v1/hooks/oa"]
    finally:
        other.close()


async def test_past_its_own_bound_a_webhook_goes_serves_way(env: Env) -> None:
    """Serve's ``max_ongoing_requests`` does not count what the server's middleware takes,
    so it counts its own: with ``limit`` webhooks in flight there, the next one is handed
    to Serve (its wrappers, its bound); once one ends, the middleware takes them again."""
    asgi, app, route = server_bound(env, limit=1)
    _, raw, headers = await signed_answer(env)
    _, raw2, headers2 = await signed_answer(env, "e2", doc="PR-2")
    held, go_on = asyncio.Event(), asyncio.Event()
    sent: list[dict[str, Any]] = []
    parts = [raw[:5], raw[5:]]

    async def receive() -> dict[str, Any]:
        if len(parts) == 1:  # the body's first part read: hold it there
            held.set()
            await go_on.wait()
        chunk = parts.pop(0)
        return {"type": "http.request", "body": chunk, "more_body": bool(parts)}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/hooks/oa",
        "root_path": "",
        "query_string": b"",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
    }
    first = asyncio.create_task(asgi(scope, receive, send))
    await asyncio.wait_for(held.wait(), 5)
    assert route.in_flight == 1
    assert (await call(asgi, "/v1/hooks/oa", chunks=[raw2], headers=headers2))[0] == 418
    assert app.paths == ["POST /v1/hooks/oa"]
    go_on.set()
    await asyncio.wait_for(first, 10)
    assert sent[0]["status"] == 202 and route.in_flight == 0
    assert (await call(asgi, "/v1/hooks/oa", chunks=[raw2], headers=headers2))[0] == 202
    assert len(app.paths) == 1
    # What /healthz says: the middleware is in this server and its route bound.
    assert route.report() == {"webhooks_before_serve": True, "route_prefix": "/"}
    assert HookRoute().report()["webhooks_before_serve"] is False  # neither


async def test_an_unbound_route_before_serve_passes_everything_on(env: Env) -> None:
    """Serve's proxy, or another app's replica, runs the same middleware with no gateway."""
    app = Downstream()
    asgi = ServerHookFastPath(app, route=HookRoute())
    assert (await call(asgi, "/v1/hooks/oa", chunks=[b"{}"]))[0] == 418
    assert app.paths == ["POST /v1/hooks/oa"]


async def test_the_app_as_serve_ships_it_reads_the_route_the_replica_binds(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Serve pickles the ingress's app to the replica, and the replica's constructor binds
    the route there. A route the app's middleware held would arrive as a copy nobody
    binds (the first version of the server's path: every webhook went Serve's way); the
    middleware reads the module's route instead, as the server's middleware does."""
    from ray import cloudpickle

    import serve_app
    from torpor.entry import hooks

    monkeypatch.setattr(hooks, "ROUTE", HookRoute())  # this test's replica
    shipped = cloudpickle.loads(cloudpickle.dumps(serve_app.api))
    hooks.ROUTE.bind(WebhookGateway(env.control), clock=env.clock, prepare=ready)
    sid, raw, headers = await signed_answer(env)
    status, _, data = await call(shipped, "/v1/hooks/oa", chunks=[raw], headers=headers)
    assert (status, data["outcome"]) == (202, "accepted")
    assert (await env.load(sid)).state is SessionState.COMPLETED


async def test_the_console_of_the_app_as_serve_ships_it_is_the_one_the_replica_binds(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Serve freezes a copy of the ingress's app when the class is decorated, and pickles
    it again to the replica, whose constructor binds ``serve_app.CONSOLE``: the mount the
    app serves is a copy of it. A mount holding its own binding stayed unbound, a console
    at 503 "starting" for good, whenever the copies parted (a driver that had pickled the
    app once before, as the test above does, deployed one). Every copy now reads the
    process's slot, as the webhook route does."""
    import httpx
    from ray import cloudpickle

    import serve_app
    from torpor.entry.console import ConsoleDeps, mount
    from torpor.service.deliveries import DeliveryWorker

    monkeypatch.setattr(mount, "SLOT", mount.ConsoleSlot())  # this test's replica
    shipped = cloudpickle.loads(cloudpickle.dumps(serve_app.api))  # as Serve freezes it
    serve_app.CONSOLE.bind(ConsoleDeps(env.control, DeliveryWorker(env.services)))
    transport = httpx.ASGITransport(app=shipped)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        login = await http.get("/console/login")
    assert login.status_code == 200, login.text
    assert "text/html" in login.headers["content-type"]
