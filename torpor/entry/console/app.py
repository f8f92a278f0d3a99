"""The operator console's routes: an ASGI app mounted at ``/console`` by the Serve app
(or by any FastAPI app holding the services, as the browser tests do).

Login sets an HttpOnly, SameSite=Strict cookie (Secure over https) naming the principal;
every page needs it. Every POST other than the login carries the login's CSRF token,
checked in constant time, on top of SameSite. Tenant logins read only their tenant;
actions need an operator login (403 otherwise).
"""

# No ``from __future__ import annotations``: FastAPI reads annotations at run time.
import asyncio
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import parse_qs, quote

from fastapi import FastAPI, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from pydantic import JsonValue, TypeAdapter, ValidationError

from torpor.entry.console import pages, reads
from torpor.entry.console.actions import ACTIVATED, TAKEN_BACK, OperatorActions
from torpor.entry.console.live import LiveCounts
from torpor.entry.console.login import (
    COOKIE,
    LIFETIME,
    LOGIN_COOKIE,
    LOGIN_FORM_LIFETIME,
    LOGOUT_SCOPE,
    CookieSigner,
    Principal,
    authenticate,
)
from torpor.entry.http import (
    HeldStreamingResponse,
    ensure_strict_json,
    install_problem_handlers,
    read_body,
)
from torpor.errors import InvalidRequest, TorporError, Unauthenticated
from torpor.lifecycle import SessionState
from torpor.problems import problem_for
from torpor.service.deliveries import DeliveryWorker
from torpor.service.health import check_health
from torpor.service.sessions import SessionService

STATIC = Path(__file__).parent / "static"
FORM_MAX_BYTES = 64 * 1024
LIVE_TICK_S = 2.0
SOON = timedelta(hours=1)
# The "deadline due within" filter, in minutes either way: ten years covers every wait,
# and keeps ``now + due`` a datetime (1e10 minutes, inf or nan was a 500).
MAX_DUE_MINUTES = 10 * 366 * 24 * 60
_JSON = TypeAdapter(JsonValue)
# The outcomes an action's redirect names to the session page. The page shows these and
# nothing else from its address: a link could put any words in the console's status box
# ("your login expired: paste your key at ...").
NOTICES = frozenset(
    {
        "cancel requested",
        TAKEN_BACK,
        ACTIVATED,
        "answer delivered",
        "already delivered",
        "approval reassigned",
        "outbox entry resent",
    }
)


@dataclass
class ConsoleDeps:
    control: SessionService
    deliveries: DeliveryWorker
    audit: reads.AuditBrowser | None = None
    # The reconciler's last report ({"last": {"errors": [...]}}), where this app has one.
    reconciler_status: Callable[[], Awaitable[dict[str, Any] | None]] | None = None
    base: str = "/console"
    live_tick_s: float = LIVE_TICK_S


class _Console:
    def __init__(self, deps: ConsoleDeps) -> None:
        self.deps = deps
        self.services = deps.control.services
        self.settings = self.services.settings
        self.signer = CookieSigner(self.settings)
        self.actions = OperatorActions(deps.control, deps.deliveries)
        self.base = deps.base
        self.live = LiveCounts(
            self.services,
            max_per_key=self.settings.security.max_streams_per_tenant,
            tick_s=deps.live_tick_s,
        )

    async def principal(self, request: Request) -> Principal | None:
        now = self.services.clock.now()
        principal = self.signer.open(request.cookies.get(COOKIE), now=now)
        if principal is None or await self.ended(principal):
            return None
        return principal

    async def ended(self, principal: Principal) -> bool:
        return await self.services.index.holds_nonce(
            scope=LOGOUT_SCOPE, nonce=principal.nonce, now=self.services.clock.now()
        )

    async def signed_in(self, principal: Principal) -> bool:
        """Whether ``principal``'s login still holds: unexpired, its key still configured,
        not logged out."""
        now = self.services.clock.now()
        return self.signer.holds(principal, now=now) and not await self.ended(principal)

    async def end(self, principal: Principal) -> None:
        """Log ``principal`` out: its cookie, copied anywhere, opens nothing from now on."""
        await self.services.index.admit(
            claims=[(LOGOUT_SCOPE, principal.nonce)],
            ttl=LIFETIME,
            now=self.services.clock.now(),
            tenant=principal.tenant or "",
            correlation_id=None,
            business_key=None,
        )

    async def form(self, request: Request, principal: Principal | None) -> dict[str, str]:
        """The urlencoded form, bounded; with a principal, its CSRF token is required."""
        raw = await read_body(request, FORM_MAX_BYTES)
        try:
            fields = {k: v[0] for k, v in parse_qs(raw.decode(), max_num_fields=32).items()}
        except (UnicodeDecodeError, ValueError):
            raise InvalidRequest("the form is not valid urlencoded text") from None
        if principal is not None and not self.signer.csrf_ok(principal, fields.get("csrf")):
            raise InvalidRequest("the form's CSRF token is missing or wrong: reload the page")
        return fields

    def html(self, body: str, status: int = 200) -> HTMLResponse:
        return HTMLResponse(
            body,
            status_code=status,
            headers={
                "Cache-Control": "no-store",
                "X-Frame-Options": "DENY",
                "Referrer-Policy": "same-origin",
                "Content-Security-Policy": (
                    "default-src 'self'; style-src 'self'; script-src 'self'; "
                    "form-action 'self'; frame-ancestors 'none'"
                ),
            },
        )

    def to_login(self) -> RedirectResponse:
        return RedirectResponse(f"{self.base}/login", status_code=303)

    async def health(self) -> dict[str, Any]:
        now = self.services.clock.now()
        checked = await check_health(self.services, now=now, sweeps=True)
        steps: dict[str, str] = {}
        if self.deps.reconciler_status is not None:
            try:
                status = await asyncio.wait_for(self.deps.reconciler_status(), timeout=2.0)
            except Exception as exc:  # the console still renders; the health line says why
                status, steps["reconciler"] = None, f"status unavailable: {type(exc).__name__}"
            for step, last in ((status or {}).get("step_errors") or {}).items():
                steps[str(step)] = f"{last.get('at', '?')}: {last.get('error', '')}"
        return {
            "problems": checked.problems + checked.warnings,
            "last_sweep_age_s": checked.last_sweep_age_s,
            "steps": steps,
        }

    def error_page(self, principal: Principal | None, exc: TorporError) -> HTMLResponse:
        spec = problem_for(exc)
        detail = spec.detail or spec.title
        body = f'<h1>{pages.e(spec.title)}</h1><p class="error" role="alert">{pages.e(detail)}</p>'
        csrf = self.signer.csrf(principal) if principal else ""
        return self.html(pages.layout(self.base, principal, spec.title, body, csrf), spec.status)


def _filters(
    tenant: str | None, agent: str | None, batch: str | None, state: str | None, due: str | None
) -> reads.Filters:
    try:
        chosen = SessionState(state) if state else None
        minutes = float(due) if due not in (None, "") else None
    except ValueError:
        raise InvalidRequest("unknown state or due-within value") from None
    if minutes is not None and not abs(minutes) <= MAX_DUE_MINUTES:  # nan fails it too
        raise InvalidRequest(f"due-within is at most {MAX_DUE_MINUTES} minutes either way")
    due_s = None if minutes is None else minutes * 60
    return reads.Filters(tenant or None, agent or None, batch or None, chosen, due_s)


def console_app(deps: ConsoleDeps) -> FastAPI:
    """The console as an ASGI app; mount it at ``deps.base``."""
    c = _Console(deps)
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    install_problem_handlers(app)
    base = deps.base

    async def guarded(
        request: Request, page: Callable[[Principal], Awaitable[Response]]
    ) -> Response:
        principal = await c.principal(request)
        if principal is None:
            if request.method == "GET":
                return c.to_login()
            raise Unauthenticated("sign in to the console first")
        try:
            return await page(principal)
        except TorporError as exc:
            return c.error_page(principal, exc)

    def secure(request: Request) -> bool:
        return request.url.scheme == "https" or (
            request.headers.get("x-forwarded-proto", "").lower() == "https"
        )

    def login_page(request: Request, error: str | None = None, status: int = 200) -> Response:
        """The sign-in form, with a fresh nonce in its own cookie and its token in the form."""
        nonce = secrets.token_urlsafe(16)
        answer = c.html(pages.login(base, c.signer.login_csrf(nonce), error), status)
        answer.set_cookie(
            LOGIN_COOKIE,
            nonce,
            max_age=int(LOGIN_FORM_LIFETIME.total_seconds()),
            path=f"{base}/login",
            httponly=True,
            samesite="strict",
            secure=secure(request),
        )
        return answer

    @app.get("/login", response_class=HTMLResponse)
    async def login_form(request: Request) -> Response:
        return login_page(request)

    @app.post("/login")
    async def login(request: Request) -> Response:
        fields = await c.form(request, None)
        # Checked before the key: a forged sign-in learns nothing about it either.
        if not c.signer.login_csrf_ok(request.cookies.get(LOGIN_COOKIE), fields.get("csrf")):
            return login_page(request, "The sign-in form expired or came from elsewhere.", 403)
        principal = authenticate(c.settings, fields.get("key", ""), now=c.services.clock.now())
        if principal is None:
            return login_page(request, "That key is not valid here.", 401)
        answer = RedirectResponse(f"{base}/", status_code=303)
        answer.set_cookie(
            COOKIE,
            c.signer.issue(principal),
            max_age=int(LIFETIME.total_seconds()),
            path=base,
            httponly=True,
            samesite="strict",
            secure=secure(request),
        )
        answer.delete_cookie(LOGIN_COOKIE, path=f"{base}/login")
        return answer

    @app.post("/logout")
    async def logout(request: Request) -> Response:
        principal = await c.principal(request)
        if principal is not None:
            await c.form(request, principal)
            # Deleting the cookie ends it in this browser only.
            await c.end(principal)
        answer = c.to_login()
        answer.delete_cookie(COOKIE, path=base)
        return answer

    @app.get("/static/{name}")
    async def static(name: str) -> Response:
        files = {"console.js": "text/javascript", "console.css": "text/css"}
        if name not in files:
            return Response(status_code=404)
        return Response(
            (STATIC / name).read_bytes(),
            media_type=files[name],
            headers={"Cache-Control": "no-cache"},
        )

    @app.get("/", response_class=HTMLResponse)
    async def index(
        request: Request,
        tenant: Annotated[str | None, Query(max_length=128)] = None,
        agent: Annotated[str | None, Query(max_length=128)] = None,
        batch: Annotated[str | None, Query(max_length=128)] = None,
        state: Annotated[str | None, Query(max_length=32)] = None,
        due: Annotated[str | None, Query(max_length=16)] = None,
        cursor: Annotated[str | None, Query(max_length=128)] = None,
        verify: Annotated[str | None, Query(max_length=4)] = None,
        limit: Annotated[int, Query(ge=1, le=200)] = 50,
    ) -> Response:
        async def page(p: Principal) -> Response:
            filters = _filters(tenant, agent, batch, state, due)
            return await _index(request, p, filters, cursor, verify, limit=limit)

        return await guarded(request, page)

    async def _index(
        request: Request,
        p: Principal,
        filters: reads.Filters,
        cursor: str | None,
        verify: str | None,
        *,
        search: str = "",
        missed: bool = False,
        limit: int = 50,
    ) -> Response:
        tenants = p.tenants(c.settings)
        now = c.services.clock.now()
        listed, counts, soon, dead, health = await asyncio.gather(
            reads.list_sessions(
                c.services, tenants=tenants, filters=filters, cursor=cursor, limit=limit, now=now
            ),
            reads.counts(c.services, tenants),
            reads.waits_due_soon(c.services, tenants, now=now, within=SOON),
            reads.dead_letters(c.services, tenants),
            c.health(),
        )
        records = await c.deps.audit.recent(blocks=reads.AUDIT_BLOCKS) if c.deps.audit else []
        own_sources = (
            None
            if p.operator
            else {n for n, s in c.settings.sources.items() if s.tenant == p.tenant}
        )
        audit = None
        if verify and p.operator and c.deps.audit is not None:
            audit = await c.deps.audit.verify_all()
        csrf = c.signer.csrf(p)
        overview = pages.overview(
            base,
            p,
            csrf,
            soon=soon,
            outcomes=reads.webhook_outcomes(records, own_sources),
            dead=dead,
            health=health if p.operator else {"last_sweep_age_s": health["last_sweep_age_s"]},
            audit=audit,
        )
        query = {k: v for k, v in request.query_params.items() if k not in ("cursor", "verify")}
        return c.html(
            pages.session_list(
                base,
                p,
                csrf,
                tenants=tenants,
                agents=sorted(c.settings.agents),
                filters=filters,
                page=listed,
                counts=counts,
                query=query,
                search=search,
                search_missed=missed,
                overview=overview,
            )
        )

    @app.get("/search", response_class=HTMLResponse)
    async def search(request: Request, q: Annotated[str, Query(max_length=256)] = "") -> Response:
        async def page(p: Principal) -> Response:
            found = await reads.find(
                c.services, q, tenants=p.tenants(c.settings), now=c.services.clock.now()
            )
            if found is not None:
                return RedirectResponse(f"{base}/sessions/{quote(found)}", status_code=303)
            return await _index(request, p, reads.Filters(), None, None, search=q, missed=True)

        return await guarded(request, page)

    async def _session(p: Principal, session_id: str, notice: str | None = None) -> Response:
        snapshot = await reads.get_snapshot(c.services, session_id, tenants=p.tenants(c.settings))
        timeline = await reads.timeline(c.services, snapshot, c.deps.audit)
        return c.html(
            pages.session_page(
                base,
                p,
                c.signer.csrf(p),
                timeline,
                can_reassign=c.actions.can_reassign(),
                notice=notice,
            )
        )

    @app.get("/sessions/{session_id}", response_class=HTMLResponse)
    async def session(
        request: Request,
        session_id: str,
        notice: Annotated[str | None, Query(max_length=200)] = None,
    ) -> Response:
        shown = notice if notice in NOTICES else None
        return await guarded(request, lambda p: _session(p, session_id, shown))

    def _after(session_id: str, notice: str) -> Response:
        # Post/redirect/get: a reload never repeats the action. The notice is one of
        # NOTICES, or the page would not show it.
        return RedirectResponse(
            f"{base}/sessions/{quote(session_id)}?notice={quote(notice)}", status_code=303
        )

    @app.get("/sessions/{session_id}/", include_in_schema=False)
    async def session_slash(session_id: str) -> Response:
        return RedirectResponse(f"{base}/sessions/{quote(session_id)}", status_code=308)

    async def _act(
        request: Request, act: Callable[[Principal, dict[str, str]], Awaitable[Response]]
    ) -> Response:
        async def page(p: Principal) -> Response:
            return await act(p, await c.form(request, p))

        return await guarded(request, page)

    @app.post("/sessions/{session_id}/cancel")
    async def cancel(request: Request, session_id: str) -> Response:
        async def act(p: Principal, f: dict[str, str]) -> Response:
            await c.actions.cancel(p, session_id, f.get("reason", ""))
            return _after(session_id, "cancel requested")

        return await _act(request, act)

    @app.post("/sessions/{session_id}/retry")
    async def retry(request: Request, session_id: str) -> Response:
        async def act(p: Principal, f: dict[str, str]) -> Response:
            done = await c.actions.retry_now(p, session_id, f.get("reason", ""))
            return _after(session_id, done)

        return await _act(request, act)

    @app.post("/sessions/{session_id}/resolve")
    async def resolve(request: Request, session_id: str) -> Response:
        async def act(p: Principal, f: dict[str, str]) -> Response:
            raw = f.get("payload", "")
            try:
                payload = _JSON.validate_json(raw)
            except ValidationError:
                raise InvalidRequest("the payload must be a JSON document") from None
            # As the API refuses them: NaN or 1e999 was stored as null, and the wait was
            # answered with a value the operator never gave.
            ensure_strict_json(raw, "payload")
            new = await c.actions.force_resolve(
                p,
                session_id,
                f.get("correlation_id", ""),
                payload,
                f.get("reason", ""),
                event_type=f.get("type") or None,
            )
            return _after(session_id, "answer delivered" if new else "already delivered")

        return await _act(request, act)

    @app.post("/sessions/{session_id}/reassign")
    async def reassign(request: Request, session_id: str) -> Response:
        async def act(p: Principal, f: dict[str, str]) -> Response:
            await c.actions.reassign(
                p,
                session_id,
                f.get("correlation_id", ""),
                f.get("approver", ""),
                f.get("reason", ""),
            )
            return _after(session_id, "approval reassigned")

        return await _act(request, act)

    @app.post("/sessions/{session_id}/outbox/{entry_id}/resend")
    async def resend_outbox(request: Request, session_id: str, entry_id: str) -> Response:
        async def act(p: Principal, f: dict[str, str]) -> Response:
            await c.actions.resend_outbox(p, session_id, entry_id, f.get("reason", ""))
            return _after(session_id, "outbox entry resent")

        return await _act(request, act)

    @app.post("/deliveries/{tenant}/{delivery_id}/resend")
    async def resend_delivery(request: Request, tenant: str, delivery_id: str) -> Response:
        async def act(p: Principal, f: dict[str, str]) -> Response:
            await reads.get_delivery(c.services, tenant, delivery_id, tenants=p.tenants(c.settings))
            await c.actions.resend_delivery(p, tenant, delivery_id, f.get("reason", ""))
            return RedirectResponse(f"{base}/?resent={quote(delivery_id)}#dead", status_code=303)

        return await _act(request, act)

    @app.get("/live")
    async def live(
        request: Request, session: Annotated[str | None, Query(max_length=128)] = None
    ) -> Response:
        p = await c.principal(request)
        if p is None:
            raise Unauthenticated("sign in to the console first")
        tenants = p.tenants(c.settings)
        if session is not None:
            await reads.get_snapshot(c.services, session, tenants=tenants)  # 404 first
        return HeldStreamingResponse(  # closed however it ends: the share goes back
            # 429 past the key's share; ends once the login does
            c.live.open(p.key_id, tenants, session, signed_in=lambda: c.signed_in(p)),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    return app
