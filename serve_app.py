"""torpor's HTTP edge on Ray Serve: ``serve run serve_app:build_app config=torpor.toml``.

Importing it builds nothing and reads no configuration: Serve calls :func:`build_app`;
programs holding :class:`Settings` call :func:`application`. Deployment options live in
the Serve config; the decorator below carries their defaults.

Routes only. Submitting work answers in milliseconds with 202 and a status URL; webhooks
are verified on the raw bytes, accepted durably, and answered before the agent runs.
Every failure is ``application/problem+json`` from one handler.
"""

# No ``from __future__ import annotations`` here: FastAPI reads these annotations at
# runtime inside the Serve replica, where string annotations cannot be resolved.
from typing import Annotated, Any

from fastapi import FastAPI, Header, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.serve import Application
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from actors.config_ref import ConfigRef
from actors.heap import settle_heap
from actors.observer import RayObserver
from actors.ray_activator import RayActivator
from actors.reconciler import ReconcilerStarter, reconciler_status
from actors.wiring import (
    ensure_conditional_writes,
    open_services,
    opened_in_thread,
    warm_services,
)
from storage.audit import ObjectAudit
from torpor import __version__
from torpor.api import (
    Accepted,
    ApprovalReassign,
    BatchCreate,
    BatchOut,
    BatchSessionList,
    SessionCreate,
    SessionItem,
    SessionList,
    SessionOut,
)
from torpor.auth import operator_for, tenant_for
from torpor.batches import SESSIONS_PAGE, SESSIONS_PAGE_MAX
from torpor.deliveries import DeliveryStatus
from torpor.entry import hooks
from torpor.entry.batches import ResultFormat, batch_out, batch_sessions
from torpor.entry.console import ConsoleDeps, ConsoleMount
from torpor.entry.head import HeadAsGet
from torpor.entry.hooks import HookFastPath
from torpor.entry.http import (
    PROBLEM,
    HeldStreamingResponse,
    install_problem_handlers,
    json_body,
    parse_json_body,
    parse_last_event_id,
    read_audited_body,
    read_body,
    redact_path,
    require_idempotency_key,
)
from torpor.errors import ConfigError, InvalidRequest, RejectReason, WebhookRejected
from torpor.ids import digest
from torpor.lifecycle import SessionState
from torpor.problems import problem
from torpor.service.batches import BatchService
from torpor.service.deliveries import DeliveryWorker, secret_for, tenant_view
from torpor.service.gateway import CAPABILITY_SOURCE, WebhookGateway
from torpor.service.health import health_answer
from torpor.service.sessions import SessionService
from torpor.service.streams import SessionStreams
from torpor.settings import Settings
from torpor.webhooks.capability import open_token
from torpor.webhooks.cloudevents import handshake

# A capability answer is a small JSON decision; the token is checked before it is read.
CAPABILITY_MAX_BYTES = 64 * 1024

api = FastAPI(
    title="torpor",
    version=__version__,
    description="Agent sessions that sleep while they wait and wake once on a signed webhook.",
)
install_problem_handlers(api)
# The operator console (server-rendered pages); bound to the services in the replica.
CONSOLE = ConsoleMount()
api.mount("/console", CONSOLE)
# HEAD on every GET route (a load balancer's health check); inside the webhook fast path,
# which is added last and so runs first: a webhook passes nothing more.
api.add_middleware(HeadAsGet)
# POST /v1/hooks/{source} answered in front of FastAPI's routing (``torpor.entry.hooks``):
# by the replica's ``hooks.ROUTE``, bound to its gateway in its constructor; the route
# below until then. Under HAProxy, Serve's server in the replica takes it sooner
# (``ServerHookFastPath``, the same route).
api.add_middleware(HookFastPath)
# The replica's bound (a Serve config may set another); the webhooks taken before
# Serve's wrappers have one of their own, bound to the same figure (``HookRoute.limit``).
MAX_ONGOING_REQUESTS = 200


@serve.deployment(
    num_replicas=1,
    max_ongoing_requests=MAX_ONGOING_REQUESTS,
    logging_config={"enable_access_log": False},
)
@serve.ingress(api)
class Ingress:
    # Async: Serve awaits the constructor (``serve.ingress`` wraps it) and routes to the
    # replica once it returns, so the store is readied before the first request.
    async def __init__(  # type: ignore[misc]
        self,
        config: ConfigRef,
        reconciler: DeploymentHandle[Any] | None = None,
        route_prefix: str = "/",
    ) -> None:
        # Read here, in the replica: Serve persists constructor arguments (config_ref).
        self.settings = settings = config.load()
        # In a thread: it blocks (files, sockets, the store's first reads), and the
        # replica's loop is the one every request and Serve's own calls run on.
        self.services = await opened_in_thread(open_services, settings, observer=RayObserver())
        # ``made``: embedded storage's check counts the cluster's nodes, a GCS call made
        # off this loop with the lookups' deadline (Ray's own is 60 s), as for every
        # other activator made on a loop.
        try:
            self.activator = activator = await RayActivator.made(self.services, config)
        except BaseException:
            # Refused (embedded storage on several nodes), the GCS silent
            # (``ClusterUnavailable``) or cancelled: nothing else holds the services, and
            # their files and sockets stayed open as long as the replica's process.
            await self.services.close()
            raise
        try:
            self._start(activator, reconciler)
            # Serve routes to a replica once this returns: its first webhook finds the
            # store ready (its files made ahead, its conditional writes checked).
            await warm_services(self.services)
            # Last: the route the server's middleware reads and the console take nothing
            # before the replica is whole (a failure above leaves neither bound to it).
            self._bind(route_prefix)
        except BaseException:
            # A replica that fails to start is made again by Serve: the standbys it
            # started (detached processes) and its services' files and sockets went on
            # for their idle time or the process's life, one set per failed start.
            try:
                await self.activator.close()
            finally:
                await self.services.close()
            raise
        settle_heap()  # started: what lives for the replica's life leaves the collector

    def _start(
        self,
        activator: RayActivator,
        reconciler: DeploymentHandle[Any] | None,
    ) -> None:
        activator.start_standbys()
        self.control = SessionService(self.services, activator, background=True)
        self.batches = BatchService(self.control)
        self.gateway = WebhookGateway(self.control)
        self.streams = SessionStreams(
            self.control, max_per_tenant=self.settings.security.max_streams_per_tenant
        )
        self.deliveries = DeliveryWorker(self.services)
        # Held only so Serve deploys the starter with the app.
        self.reconciler = reconciler

    def _bind(self, route_prefix: str) -> None:
        services = self.services
        # Through the module, as imported in this process: Serve unpickled this class,
        # and a route it captured by name would be a copy the middlewares do not read.
        hooks.ROUTE.bind(
            self.gateway,
            clock=services.clock,
            prepare=lambda: ensure_conditional_writes(services),
            prefix=route_prefix,
            limit=MAX_ONGOING_REQUESTS,
        )
        namespace, reconciler = self.settings.namespace, self.reconciler
        CONSOLE.bind(
            ConsoleDeps(
                self.control,
                self.deliveries,
                audit=services.audit if isinstance(services.audit, ObjectAudit) else None,
                reconciler_status=(lambda: reconciler_status(namespace))
                if reconciler is not None
                else None,
            )
        )

    async def __del__(self) -> None:
        """Serve's graceful shutdown of this replica (a redeploy, a scale-down, a
        delete): the activation requests still running behind answers finish, and the
        standby session actors nobody adopted go now, not after their idle time (each is
        a process, detached so that an adopted one outlives its activator). Serve calls
        it after a failed constructor too, which closed what it had made already."""
        if not hasattr(self, "control"):
            return
        await self.control.drain()
        await self.activator.close()

    def _tenant(self, authorization: str | None) -> str:
        return tenant_for(authorization, self.settings.tenants)

    # -- health and baseline -------------------------------------------------------

    @api.get("/healthz", tags=["ops"])  # 503 problem+json if the index, store or sweeps fail
    async def healthz(self) -> JSONResponse:
        answer = await health_answer(
            self.services, self.reconciler, api.version, ingress=hooks.ROUTE.report()
        )
        return JSONResponse(**answer)

    @api.post("/v1/noop", status_code=202, tags=["ops"])
    async def noop(self, request: Request) -> dict[str, Any]:
        """A trivial webhook-shaped endpoint (it receives the body and ignores it): the
        baseline the webhook benchmark compares against. Unauthenticated, so it exists
        only with ``security.benchmark_noop`` (404 otherwise)."""
        if not self.settings.security.benchmark_noop:
            raise StarletteHTTPException(404, "Not Found")
        await read_body(request, self.settings.security.max_request_bytes)
        return {}

    # -- sessions ------------------------------------------------------------------

    @api.post(
        "/v1/sessions",
        status_code=202,
        response_model=Accepted,
        tags=["sessions"],
        openapi_extra=json_body(SessionCreate),
    )
    async def create_session(
        self,
        request: Request,
        authorization: Annotated[str | None, Header()] = None,
        idempotency_key: Annotated[str | None, Header()] = None,
    ) -> JSONResponse:
        tenant = self._tenant(authorization)
        key = require_idempotency_key(idempotency_key)
        body: SessionCreate = parse_json_body(
            await read_body(request, self.settings.security.max_request_bytes), SessionCreate
        )
        await ensure_conditional_writes(self.services)
        submitted = await self.control.submit(
            tenant=tenant,
            agent=body.agent,
            input=body.input,
            metadata=body.metadata,
            callback_url=body.callback_url,
            idempotency_key=key,
        )
        location = f"/v1/sessions/{submitted.session_id}"
        state = await self._state(submitted.session_id)
        accepted = Accepted(
            session_id=submitted.session_id,
            state=state,
            created=submitted.created,
            links={"self": location, "events": f"{location}/events"},
            callback_secret=(
                secret_for(self.settings, tenant, body.callback_url) if body.callback_url else None
            ),
        )
        return JSONResponse(
            accepted.model_dump(mode="json"),
            status_code=202,
            headers={"Location": location, "Retry-After": "1"},
        )

    async def _state(self, session_id: str) -> SessionState:
        states = await self.services.index.session_states([session_id])
        return states.get(session_id, SessionState.PENDING)

    @api.get("/v1/sessions/{session_id}", response_model=SessionOut, tags=["sessions"])
    async def get_session(
        self, session_id: str, authorization: Annotated[str | None, Header()] = None
    ) -> SessionOut:
        tenant = self._tenant(authorization)
        snapshot = await self.control.get(session_id, tenant=tenant)
        out = SessionOut.of(snapshot)
        if snapshot.waits:  # only a waiting session has work that reports progress
            reports = await self.control.progress(session_id)
            out.progress = [p.model_dump(mode="json") for p in reports]
        return out

    @api.get("/v1/sessions", response_model=SessionList, tags=["sessions"])
    async def list_sessions(
        self,
        authorization: Annotated[str | None, Header()] = None,
        state: SessionState | None = None,
        cursor: Annotated[str | None, Query(max_length=128)] = None,
        limit: Annotated[int, Query(ge=1, le=200)] = 50,
    ) -> SessionList:
        tenant = self._tenant(authorization)
        page = await self.services.index.list_sessions(
            tenant=tenant, state=state, cursor=cursor, limit=limit
        )
        states = await self.services.index.session_states(page.session_ids)
        return SessionList(
            items=[SessionItem(session_id=s, state=states.get(s)) for s in page.session_ids],
            next_cursor=page.next_cursor,
        )

    @api.post("/v1/sessions/{session_id}/cancel", status_code=202, tags=["sessions"])
    async def cancel_session(
        self, session_id: str, authorization: Annotated[str | None, Header()] = None
    ) -> JSONResponse:
        tenant = self._tenant(authorization)
        snapshot = await self.control.cancel(session_id, tenant=tenant)
        body = {"session_id": session_id, "state": snapshot.state.value}
        return JSONResponse(body, status_code=200 if snapshot.terminal else 202)

    @api.post("/v1/sessions/{session_id}/retry", status_code=202, tags=["sessions"])
    async def retry_session(
        self, session_id: str, authorization: Annotated[str | None, Header()] = None
    ) -> JSONResponse:
        """Operator action: take a QUARANTINED session back, with a fresh retry quota."""
        tenant = self._tenant(authorization)
        snapshot = await self.control.retry(session_id, tenant=tenant)
        return JSONResponse({"session_id": session_id, "state": snapshot.state.value}, 202)

    @api.post(
        "/v1/operator/sessions/{session_id}/waits/{correlation_id}/reassign",
        status_code=202,
        tags=["operator"],
        openapi_extra=json_body(ApprovalReassign),
    )
    async def reassign_approval(
        self,
        session_id: str,
        correlation_id: str,
        request: Request,
        authorization: Annotated[str | None, Header()] = None,
    ) -> JSONResponse:
        """Operator action (operator key): give an open approval to other approvers; the
        old request is withdrawn and a new epoch opens."""
        operator = operator_for(authorization, self.settings.security.operator_keys)
        body = parse_json_body(
            await read_body(request, self.settings.security.max_request_bytes), ApprovalReassign
        )
        event_id = await self.control.reassign_approval(
            session_id, correlation_id, approvers=body.approvers, by=operator, why=body.reason
        )
        return JSONResponse({"session_id": session_id, "event_id": event_id}, 202)

    @api.get("/v1/sessions/{session_id}/events", tags=["sessions"])
    async def session_events(
        self,
        session_id: str,
        authorization: Annotated[str | None, Header()] = None,
        last_event_id: Annotated[str | None, Header()] = None,
    ) -> Response:
        tenant = self._tenant(authorization)
        snapshot = await self.control.get(session_id, tenant=tenant)  # 404 before it opens
        after = parse_last_event_id(last_event_id)
        if snapshot.terminal and all(entry.seq <= after for entry in snapshot.history):
            # Ended, and the client has seen the end: 204 is what stops an EventSource
            # reconnecting (WHATWG HTML); an empty 200 had it reconnect for ever.
            return Response(status_code=204)
        return HeldStreamingResponse(  # closed however it ends: the slot goes back
            self.streams.open(session_id, tenant, after),  # 429 past the tenant's cap
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    # -- batches ---------------------------------------------------------------------

    @api.post(
        "/v1/batches",
        status_code=202,
        response_model=BatchOut,
        tags=["batches"],
        openapi_extra=json_body(BatchCreate),
    )
    async def create_batch(
        self,
        request: Request,
        authorization: Annotated[str | None, Header()] = None,
        idempotency_key: Annotated[str | None, Header()] = None,
    ) -> JSONResponse:
        tenant = self._tenant(authorization)
        key = require_idempotency_key(idempotency_key)
        body: BatchCreate = parse_json_body(
            await read_body(request, self.settings.security.max_request_bytes * 16), BatchCreate
        )
        # The batch id is a function of tenant and key: a retried request is the same batch.
        batch_id = "b_" + digest(tenant, key, length=24)
        await ensure_conditional_writes(self.services)
        # The manifest only, then the answer: the sessions are made behind it, in this
        # replica's event loop (and by the reconciler if this replica dies meanwhile).
        manifest = await self.batches.accept(
            tenant=tenant,
            agent=body.agent,
            documents=body.documents,
            metadata=body.metadata,
            callback_url=body.callback_url,
            batch_id=batch_id,
            max_running=body.max_running,
        )
        self.batches.start_fan_out(manifest.batch_id)
        out = await self._batch(manifest.batch_id, tenant)
        return JSONResponse(
            out.model_dump(mode="json"),
            status_code=202,
            headers={"Location": out.links["self"], "Retry-After": "5"},
        )

    @api.get("/v1/batches/{batch_id}", response_model=BatchOut, tags=["batches"])
    async def get_batch(
        self, batch_id: str, authorization: Annotated[str | None, Header()] = None
    ) -> BatchOut:
        return await self._batch(batch_id, self._tenant(authorization))

    async def _batch(self, batch_id: str, tenant: str) -> BatchOut:
        return await batch_out(self.batches, batch_id, tenant)

    @api.get("/v1/batches/{batch_id}/sessions", response_model=BatchSessionList, tags=["batches"])
    async def list_batch_sessions(
        self,
        batch_id: str,
        authorization: Annotated[str | None, Header()] = None,
        cursor: Annotated[str | None, Query(max_length=128)] = None,
        limit: Annotated[int, Query(ge=1, le=SESSIONS_PAGE_MAX)] = SESSIONS_PAGE,
    ) -> BatchSessionList:
        """Each document's current session (its latest retry's), in document order, a
        page at a time: pass ``next_cursor`` back as ``cursor`` until it is null."""
        tenant = self._tenant(authorization)
        return await batch_sessions(self.batches, batch_id, tenant, cursor=cursor, limit=limit)

    @api.post("/v1/batches/{batch_id}/cancel", status_code=202, tags=["batches"])
    async def cancel_batch(
        self, batch_id: str, authorization: Annotated[str | None, Header()] = None
    ) -> BatchOut:
        """Cancel every session of the batch not ended yet; idempotent."""
        tenant = self._tenant(authorization)
        await ensure_conditional_writes(self.services)
        await self.batches.cancel(batch_id, tenant=tenant)
        return await self._batch(batch_id, tenant)

    @api.post("/v1/batches/{batch_id}/retry", status_code=202, tags=["batches"])
    async def retry_batch(
        self, batch_id: str, authorization: Annotated[str | None, Header()] = None
    ) -> dict[str, Any]:
        """New sessions for the documents whose session FAILED or TIMED_OUT; idempotent."""
        tenant = self._tenant(authorization)
        await ensure_conditional_writes(self.services)
        retried = await self.batches.retry(batch_id, tenant=tenant)
        return {"batch_id": batch_id, "retried": retried}

    @api.get("/v1/batches/{batch_id}/results", tags=["batches"])
    async def batch_results(
        self,
        batch_id: str,
        authorization: Annotated[str | None, Header()] = None,
        format: ResultFormat = ResultFormat.JSONL,
    ) -> StreamingResponse:
        """One line (row) per document: index, id, session, state, result or error. 409
        until the batch finished."""
        # Read and encoded a page at a time as it is sent: the batch's results are never
        # held whole here (its checks and its export are done before the first byte).
        stream = await self.batches.result_stream(
            batch_id, format.value, tenant=self._tenant(authorization)
        )
        return StreamingResponse(
            stream,
            media_type=format.media_type,
            headers={"Content-Disposition": f'attachment; filename="{batch_id}.{format.value}"'},
        )

    # -- webhooks ----------------------------------------------------------------------

    @api.post("/v1/hooks/{source}", tags=["webhooks"], openapi_extra=json_body())
    async def hook(self, source: str, request: Request) -> JSONResponse:
        """Signed webhooks. Answered by ``HookFastPath`` once the replica is up; this
        route is the OpenAPI document's, and the answer before that."""
        config = self.gateway.source(source)
        now = self.services.clock.now()
        body = await read_audited_body(
            request, config.max_body_bytes, gateway=self.gateway, source=source, now=now
        )
        await ensure_conditional_writes(self.services)
        # request.headers, not a dict of it: its items() keeps every duplicate, so the
        # verifier can refuse two conflicting signature headers instead of seeing one.
        result = await self.gateway.receive(source, body, request.headers, now=now)
        return JSONResponse(result.body, status_code=result.status)

    @api.options("/v1/hooks/{source}", tags=["webhooks"])
    async def hook_handshake(self, source: str, request: Request) -> Response:
        """CloudEvents webhook abuse protection: only registered origins may send."""
        config = self.settings.sources.get(source)
        headers = (
            handshake(
                request.headers,
                allowed_origins=config.allowed_origins,
                allowed_rate=config.allowed_rate,
            )
            if config
            else None
        )
        if headers is None:
            spec = problem(405, "origin_not_allowed", "Origin not allowed to send here")
            return JSONResponse(
                spec.body(redact_path(request.url.path)),
                status_code=405,
                media_type=PROBLEM,
                headers={"Allow": "POST"},
            )
        return Response(status_code=200, headers=headers)

    @api.post("/v1/callbacks/{token}", tags=["webhooks"], openapi_extra=json_body())
    async def capability_callback(self, token: str, request: Request) -> JSONResponse:
        now = self.services.clock.now()
        # The token (signature, expiry) before the body: an unauthenticated sender must
        # not make the replica read and buffer anything. The gateway checks it again.
        keys = self.settings.capability_key_bytes()
        try:
            if not keys:
                raise WebhookRejected(RejectReason.INVALID_TOKEN)
            open_token(token, keys=keys, now=now)
        except WebhookRejected as exc:
            # On the record like every refusal the gateway makes (without a body digest:
            # none was read), or probing for tokens would leave no trace in the audit log.
            await self.gateway.refused_unread(
                CAPABILITY_SOURCE, exc.reason, request.headers, now=now
            )
            raise
        body = await read_audited_body(
            request, CAPABILITY_MAX_BYTES, gateway=self.gateway, source=CAPABILITY_SOURCE, now=now
        )
        await ensure_conditional_writes(self.services)
        result = await self.gateway.capability(token, body, request.headers, now=now)
        return JSONResponse(result.body, status_code=result.status)

    # -- outbound notifications ------------------------------------------------------

    @api.get("/v1/deliveries", tags=["notifications"])
    async def list_deliveries(
        self,
        authorization: Annotated[str | None, Header()] = None,
        status: DeliveryStatus | None = None,
        cursor: Annotated[str | None, Query(max_length=128)] = None,
        limit: Annotated[int, Query(ge=1, le=200)] = 50,
    ) -> dict[str, Any]:
        tenant = self._tenant(authorization)
        items, next_cursor = await self.services.deliveries.list(
            tenant, status=status, cursor=cursor, limit=limit
        )
        return {
            "items": [tenant_view(d) for d in items],
            "next_cursor": next_cursor,
        }

    @api.post("/v1/deliveries/{delivery_id}/resend", status_code=202, tags=["notifications"])
    async def resend_delivery(
        self, delivery_id: str, authorization: Annotated[str | None, Header()] = None
    ) -> dict[str, Any]:
        tenant = self._tenant(authorization)
        delivery = await self.deliveries.resend(tenant, delivery_id, now=self.services.clock.now())
        return tenant_view(delivery)

    @api.get("/v1/notifications/secret", tags=["notifications"])
    async def notification_secret(
        self,
        url: Annotated[str, Query(max_length=2048)],
        authorization: Annotated[str | None, Header()] = None,
    ) -> dict[str, str]:
        """The secret our notifications to ``url`` are signed with (Standard Webhooks)."""
        tenant = self._tenant(authorization)
        if self.settings.notifications.key is None:
            # As a submit with a callback_url is refused here: not a failure (it was a 500).
            raise InvalidRequest("notifications are not set up here (notify_key)")
        return {"url": url, "secret": secret_for(self.settings, tenant, url)}


class AppArgs(BaseModel):
    """Arguments of :func:`build_app` (``args:`` in the Serve config)."""

    model_config = ConfigDict(extra="forbid")
    config: str | None = Field(None, description="TOML configuration; else $TORPOR_CONFIG")
    route_prefix: str = Field(
        "/", description="the application's route_prefix in the same Serve config"
    )


def application(
    settings: Settings | ConfigRef,
    *,
    start_reconciler: bool = True,
    replicas: int | None = None,
    route_prefix: str = "/",
) -> Application:
    """The app for ``settings``; ``start_reconciler=False`` when a test drives sweeps;
    ``replicas`` ingress replicas instead of one (a Serve config file can say it too).
    ``route_prefix`` is where ``serve.run`` mounts it: the replica's server takes
    webhooks before Serve routes them (``torpor.entry.hooks``), and one named under
    another prefix goes Serve's way, as before.

    Replicas get a :class:`ConfigRef`, never secrets: ConfigError for inline ones."""
    if replicas is not None and replicas < 1:
        raise ConfigError(f"ingress replicas must be at least 1, not {replicas}")
    if not route_prefix.startswith("/"):
        raise ConfigError(f"a route prefix starts with '/', not {route_prefix!r}")
    config = ConfigRef.of(settings)
    starter = ReconcilerStarter.bind(config) if start_reconciler else None  # type: ignore[attr-defined]
    ingress: Any = Ingress if replicas is None else Ingress.options(num_replicas=replicas)  # type: ignore[attr-defined]
    app: Application = ingress.bind(config, starter, route_prefix)
    return app


def build_app(args: AppArgs) -> Application:
    """Serve's application builder: ``serve run serve_app:build_app config=torpor.toml``."""
    Settings.from_env(config_path=args.config)  # fail here on a bad file, not in a replica
    return application(ConfigRef.from_file(args.config), route_prefix=args.route_prefix)
