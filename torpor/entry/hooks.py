"""``POST /v1/hooks/{source}`` answered by a bare ASGI handler in front of the FastAPI app.

A webhook is the request the edge takes most of, and FastAPI's routing, dependency
solving and response classes cost more than what is left of the rest of it: a trivial
route measured 0.21-0.24 ms of CPU per request on this machine under uvicorn, the same
answered by a bare ASGI handler 0.065 ms. So :class:`HookFastPath` takes exactly that
route (the method and a one-segment source) and does what the FastAPI route does, in the
same order: the source, the clock, the body read within the source's limit (a refusal
while it is read is audited), the store's conditional-write check, the gateway, the
answer. Failures are the same problem+json the app's handlers write
(``torpor.entry.http``), never a traceback.

Anything else, and every request before the replica has bound its gateway
(:meth:`HookRoute.bind`), goes to the app unchanged; the FastAPI route stays, for the
OpenAPI document and as that fallback.

Under Serve's HAProxy ingress the replica runs its own HTTP server, and Serve wraps every
request it hands the app: a request id, its metadata and tracing context, a task that
watches for the client's disconnect, the ongoing-request accounting and the request
metrics. With uvicorn they took a quarter of the GIL's time on a webhook (0.12 of 0.49 ms,
performance history, thirty-second pass). :class:`ServerHookFastPath` takes
the webhook route *before* them: Serve applies the ASGI middlewares that
``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` names (:func:`serve_middlewares`, set by
``torpor.entry.ingress`` with HAProxy) around its replica's server. What a webhook there
does without, and why that is safe:

- Disconnects do not cancel it: a webhook's writes are all-or-retried (a cancelled one
  is retried by its sender), and it runs to its answer in milliseconds.
- Serve's ``max_ongoing_requests`` does not count it: this module bounds its own
  (``HookRoute.limit``), and past the bound a webhook goes Serve's way, counted there.
- The drain on shutdown still waits for it: Serve stops its server with uvicorn's
  graceful shutdown, which finishes the requests in flight.
- Serve's request metrics, access log, request context (the request id on its log
  lines) and tracing span do not see it, nor does the running-request count its
  autoscaler reads (torpor's deployment does not autoscale); torpor's own metrics, audit
  record and spans do. Serve's own middleware, which sets ``X-Request-ID`` on answers,
  runs inside this one, so the answer echoes the id HAProxy set on the request.
- It runs on the loop the replica's constructor bound it on, or not at all: with Serve's
  user code on a thread of its own (``RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD`` not
  0) the server's loop is another one, and webhooks go Serve's way.

Serve imports the middleware in every process where it starts an HTTP server (its proxy,
every app's ingress replicas), so torpor must be importable there; where no route is
bound it passes every request on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from starlette.datastructures import URL, Headers
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect

from torpor.entry.http import PROBLEM, read_limited, redact_path
from torpor.errors import TorporError, WebhookRejected
from torpor.ports.clock import Clock
from torpor.problems import ProblemSpec, problem, problem_for
from torpor.service.gateway import WebhookGateway

log = logging.getLogger("torpor.ingress")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

PREFIX = "/v1/hooks/"
# Serve's deployment default in serve_app (MAX_ONGOING_REQUESTS), which binds its own.
DEFAULT_LIMIT = 200
REQUEST_ID = b"x-request-id"  # Serve's header (RequestIdMiddleware), set by its HAProxy


@dataclass(frozen=True)
class _Bound:
    gateway: WebhookGateway
    clock: Clock
    # Before the first write that relies on them: the store honours conditional writes.
    prepare: Callable[[], Awaitable[None]]
    # The loop the services were opened on: their connections belong to it.
    loop: asyncio.AbstractEventLoop | None = None


class HookRoute:
    """The replica's gateway, bound after the app was built (Serve builds the app at
    import, the services in the replica's constructor)."""

    def __init__(self, *, limit: int = DEFAULT_LIMIT) -> None:
        self.bound: _Bound | None = None
        # Where Serve mounted the app ("/" or "/name"): the server's middleware sees the
        # whole path, before Serve routes it by this prefix.
        self.prefix = "/"
        # Webhooks in flight before Serve's wrappers (Serve does not count them); past
        # this, they go Serve's way and its own ``max_ongoing_requests`` applies: the
        # replica holds at most the two bounds together.
        self.limit = limit
        self.in_flight = 0
        # Whether Serve put the server's middleware in this process (the cluster was
        # started with its variable): /healthz says so once the route is bound too.
        self.before_serve = False

    def bind(
        self,
        gateway: WebhookGateway,
        *,
        clock: Clock,
        prepare: Callable[[], Awaitable[None]],
        prefix: str = "/",
        limit: int | None = None,
    ) -> None:
        """Called on the loop the services run on (the replica's constructor)."""
        if not prefix.startswith("/"):
            raise ValueError(f"a route prefix starts with '/', not {prefix!r}")
        self.prefix = prefix
        if limit is not None:
            self.limit = limit
        self.bound = _Bound(gateway, clock, prepare, asyncio.get_running_loop())

    def report(self) -> dict[str, Any]:
        """What ``/healthz`` says of the webhook path in this replica: whether its server
        takes webhooks before Serve's wrappers (the middleware is there and this route,
        the one it reads, is bound), and where. No counts: /healthz is unauthenticated,
        and a count of webhooks is the senders' traffic."""
        return {
            "webhooks_before_serve": self.before_serve and self.bound is not None,
            "route_prefix": self.prefix,
        }


# The replica's one webhook route: a Serve replica is a process of its own, and the
# server's middleware (made by Serve from an import path) finds it here. Looked up when a
# request comes, never held: Serve ships the app to the replica pickled, and a route the
# app held would arrive there as a copy, bound by nobody.
ROUTE = HookRoute()


def source_of(scope: Scope, prefix: str = "/") -> str | None:
    """The source a ``POST /v1/hooks/{source}`` names, or None for any other request.
    ``prefix``: the app's route prefix while it is still in the path (a request Serve has
    not routed yet, in its server's middleware); once routed, Serve moved it into
    ``root_path``, which is stripped as Starlette routes it."""
    if scope["type"] != "http" or scope["method"] != "POST":
        return None
    path: str = scope["path"]
    root = scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root) :]
    mount = prefix.rstrip("/")
    if mount:
        if not path.startswith(mount):
            return None
        path = path[len(mount) :]
    if not path.startswith(PREFIX):
        return None
    source = path[len(PREFIX) :]
    return source if source and "/" not in source else None


class HookFastPath:
    """ASGI middleware: the webhook route, bare; everything else to ``app``."""

    def __init__(self, app: ASGIApp, *, route: HookRoute | None = None) -> None:
        self.app = app
        self.route = route  # None: the process's ROUTE, looked up at each request

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        bound = (ROUTE if self.route is None else self.route).bound
        source = source_of(scope) if bound is not None else None
        if bound is None or source is None:
            await self.app(scope, receive, send)
            return
        await _serve(bound, source, scope, receive, send, ())


class ServerHookFastPath:
    """ASGI middleware around the replica's HTTP server: the webhook route before Serve's
    per-request wrappers (the module's docstring says what it does without)."""

    def __init__(self, app: ASGIApp, *, route: HookRoute | None = None) -> None:
        self.app = app
        self.route = route  # None: the process's ROUTE, looked up at each request
        (ROUTE if route is None else route).before_serve = True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = ROUTE if self.route is None else self.route
        bound = route.bound
        source = source_of(scope, route.prefix) if bound is not None else None
        if (
            bound is None
            or source is None
            or route.in_flight >= route.limit
            or bound.loop is not asyncio.get_running_loop()
        ):
            await self.app(scope, receive, send)
            return
        route.in_flight += 1
        try:
            await _serve(bound, source, scope, receive, send, ((REQUEST_ID, _request_id(scope)),))
        finally:
            route.in_flight -= 1


def _request_id(scope: Scope) -> bytes:
    """The request's id, as Serve's middleware (inside this one) would answer it: the
    one HAProxy set, else a fresh one."""
    for name, value in scope["headers"]:
        if name == REQUEST_ID:
            return bytes(value)
    return str(uuid.uuid4()).encode()


def serve_middlewares() -> list[Middleware]:
    """What ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` names: the middlewares Serve puts
    around the HTTP servers it starts (its proxy's and, under HAProxy, each ingress
    replica's). In a process with no bound route (the proxy, another app's replica) the
    middleware passes every request on."""
    return [Middleware(ServerHookFastPath)]


async def _serve(
    bound: _Bound,
    source: str,
    scope: Scope,
    receive: Receive,
    send: Send,
    extra: tuple[tuple[bytes, bytes], ...],
) -> None:
    try:
        status, body = await _answer(bound, source, scope, receive)
        data = _render(body)  # in here: a body that does not render is a 500 problem
    except ClientDisconnect:
        return  # the sender is gone: nobody to answer, nothing was stored
    except TorporError as exc:
        spec = problem_for(exc)
        if spec.status >= 500:
            log.error("request failed: %s", exc, exc_info=exc)
        await _send_problem(spec, scope, send, extra)
        return
    except Exception:
        log.exception("unhandled error on %s", redact_path(URL(scope=scope).path))
        await _send_problem(problem(500, "internal", "Internal error"), scope, send, extra)
        return
    await _send(send, status, data, extra=extra)


async def _answer(
    bound: _Bound, source: str, scope: Scope, receive: Receive
) -> tuple[int, dict[str, Any]]:
    gateway = bound.gateway
    config = gateway.source(source)
    now = bound.clock.now()
    # Starlette's Headers: its items() keeps every duplicate, so the verifier can
    # refuse two conflicting signature headers instead of seeing one.
    headers = Headers(scope=scope)
    body = await _read_audited(
        receive, headers, config.max_body_bytes, gateway=gateway, source=source, now=now
    )
    await bound.prepare()
    result = await gateway.receive(source, body, headers, now=now)
    return result.status, result.body


async def _read_audited(
    receive: Receive,
    headers: Headers,
    limit: int,
    *,
    gateway: WebhookGateway,
    source: str,
    now: datetime,
) -> bytes:
    async def chunks() -> Any:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientDisconnect()  # as Starlette's request.stream() does
            yield message.get("body", b"")
            if not message.get("more_body", False):
                return

    try:
        return await read_limited(chunks(), headers.get("content-length"), limit)
    except WebhookRejected as exc:
        await gateway.refused_unread(source, exc.reason, headers, now=now)
        raise


def _render(content: Any) -> bytes:
    # As Starlette's JSONResponse renders it.
    return json.dumps(
        content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")
    ).encode("utf-8")


async def _send(
    send: Send,
    status: int,
    data: bytes,
    *,
    media_type: str = "application/json",
    extra: tuple[tuple[bytes, bytes], ...] = (),
) -> None:
    headers = [
        (b"content-length", str(len(data)).encode()),
        (b"content-type", media_type.encode()),
        *extra,
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


async def _send_problem(
    spec: ProblemSpec, scope: Scope, send: Send, extra: tuple[tuple[bytes, bytes], ...]
) -> None:
    if spec.retry_after:
        extra = ((b"retry-after", str(spec.retry_after).encode()), *extra)
    body = _render(spec.body(redact_path(URL(scope=scope).path)))
    await _send(send, spec.status, body, media_type=PROBLEM, extra=extra)
