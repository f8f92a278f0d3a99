"""The HTTP edge's plumbing: problem+json answers, bounded body reads, request parsing.

FastAPI-specific, so it lives at the edge (beside the CLI and the client), not in the
services; ``serve_app`` registers :func:`install_problem_handlers` on its app and keeps
only routes.
"""

# No ``from __future__ import annotations``: FastAPI reads annotations at run time.
import json
import logging
import math
import re
from collections.abc import AsyncIterator, Mapping
from datetime import datetime
from typing import Any, Final

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import Receive, Scope, Send

from torpor.errors import (
    InvalidRequest,
    RejectReason,
    TorporError,
    Unauthenticated,
    WebhookRejected,
)
from torpor.problems import ProblemSpec, problem, problem_for
from torpor.service.gateway import WebhookGateway
from torpor.webhooks.payloads import DuplicateName, unique_names

log = logging.getLogger("torpor.ingress")
PROBLEM = "application/problem+json"
# A capability token is the whole credential and travels in the path: never log it.
_CAPABILITY_PATH: Final = re.compile(r"(/v1/callbacks/)[^/]*")
# Explicit [0-9]: str.isdigit() accepts "²", which int() then refuses.
_EVENT_ID: Final = re.compile(r"[0-9]{1,18}")


def redact_path(path: str) -> str:
    """``path`` safe to log or echo: ``/v1/callbacks/<token>`` → ``/v1/callbacks/[redacted]``."""
    return _CAPABILITY_PATH.sub(r"\1[redacted]", path)


def parse_last_event_id(value: str | None) -> int:
    """The history sequence a reconnecting SSE client names (0 if none); 400 if malformed."""
    if value is None or value == "":
        return 0
    if not _EVENT_ID.fullmatch(value):
        raise InvalidRequest("Last-Event-ID is 1-18 ASCII digits")
    return int(value)


def json_body(model: type[Any] | None = None) -> dict[str, Any]:
    """Declare a request body in OpenAPI for routes that read (and limit) the raw bytes."""
    schema = model.model_json_schema() if model is not None else {"type": "object"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def problem_response(
    spec: ProblemSpec, request: Request, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    answer = dict(headers or {})
    if spec.retry_after:
        answer["Retry-After"] = str(spec.retry_after)
    return JSONResponse(
        spec.body(redact_path(request.url.path)),
        status_code=spec.status,
        media_type=PROBLEM,
        headers=answer or None,
    )


async def _torpor_error(request: Request, exc: TorporError) -> JSONResponse:
    spec = problem_for(exc)
    if spec.status >= 500:
        log.error("request failed: %s", exc, exc_info=exc)
    # A 401 MUST say which scheme it wants (RFC 9110 15.5.2): the API key's, Bearer.
    challenge = exc.context.get("challenge") if isinstance(exc, Unauthenticated) else None
    return problem_response(spec, request, {"WWW-Authenticate": challenge} if challenge else None)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {}
    where = ".".join(str(p) for p in first.get("loc", ()))
    detail = f"{where}: {first.get('msg', 'invalid')}" if where else "the request is invalid"
    return problem_response(
        problem(400, "invalid_request", "Invalid request", detail[:300]), request
    )


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    # Its headers too: a 405's Allow is one the RFC requires (9110 15.5.6).
    headers = dict(exc.headers or {})
    if exc.status_code == 405 and "Allow" in headers:
        headers["Allow"] = ", ".join(_allowed(request)) or headers["Allow"]
    spec = problem(exc.status_code, code, str(exc.detail))
    return problem_response(spec, request, headers)


def _allowed(request: Request) -> list[str]:
    """Every method some route of this path takes: Starlette's 405 names only the first
    route's (``POST`` for /v1/sessions, which ``GET`` lists too). Asked of each route's
    own ``matches``, as the router asks it (FastAPI nests included routes)."""
    routes = request.app.router.routes
    allowed = [
        method
        for method in _METHODS
        if any(r.matches({**request.scope, "method": method})[0] is Match.FULL for r in routes)
    ]
    if "GET" in allowed and "HEAD" not in allowed:  # served as a GET (``entry.head``)
        allowed.insert(allowed.index("GET") + 1, "HEAD")
    return allowed


_METHODS: Final = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s", redact_path(request.url.path))
    return problem_response(problem(500, "internal", "Internal error"), request)


def install_problem_handlers(app: FastAPI) -> None:
    """Every failure of every route becomes problem+json here, and nowhere else."""
    app.add_exception_handler(TorporError, _torpor_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _unexpected)


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, refused as soon as it passes ``limit`` (413), declared or not."""
    return await read_limited(request.stream(), request.headers.get("content-length"), limit)


async def read_limited(chunks: AsyncIterator[bytes], declared: str | None, limit: int) -> bytes:
    """A body from its ``chunks``, refused (413) once it passes ``limit`` or if its
    ``declared`` Content-Length already does."""
    if (
        declared is not None
        and declared.isascii()
        and declared.isdigit()
        and (len(declared) > 18 or int(declared) > limit)
    ):
        raise WebhookRejected(RejectReason.BODY_TOO_LARGE)
    parts: list[bytes] = []
    size = 0
    async for chunk in chunks:
        size += len(chunk)
        if size > limit:
            raise WebhookRejected(RejectReason.BODY_TOO_LARGE)
        parts.append(chunk)
    return b"".join(parts)


async def read_audited_body(
    request: Request, limit: int, *, gateway: WebhookGateway, source: str, now: datetime
) -> bytes:
    """``read_body`` for the webhook routes: a body refused while it is read (413) is on
    the audit record like every other rejection, by source and reason, without a body
    digest (it was never read in full)."""
    try:
        return await read_body(request, limit)
    except WebhookRejected as exc:
        await gateway.refused_unread(source, exc.reason, request.headers, now=now)
        raise


def parse_json_body(raw: bytes, model: type[Any]) -> Any:
    try:
        value = model.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise InvalidRequest(f"{where}: {first['msg']}"[:300]) from None
    ensure_strict_json(raw, "body")
    return value


def ensure_strict_json(raw: bytes | str, where: str) -> None:
    """InvalidRequest if the JSON document ``raw``, which Pydantic parsed, holds NaN, an
    infinity or a number past a float's range, or an object with a name twice.

    Pydantic's parser takes NaN and Infinity, and a number past a float's range (1e400,
    or 300 digits and e11) as infinity; stored, each became null: the agent would run
    on a value the client never sent. It takes the last of two equal names, where a
    proxy or gateway in front may have checked the first (``{"agent": "a", "agent":
    "b"}``): two parsers disagreeing is a smuggling vector, refused as the webhooks
    refuse it. The standard parser shows every float literal and object to a hook (in C
    but for the hooks: 10 ms more for a 3 MB batch of 10,000 documents; the names' hook
    added nothing measurable, 88-90 ms either way for 4.3 MB and 110,000 objects)."""
    try:
        json.loads(
            raw, parse_float=_finite, parse_constant=_not_a_number, object_pairs_hook=unique_names
        )
    except _NonFinite:
        raise InvalidRequest(
            f"{where}: a number is NaN, infinite or out of range (JSON has none)"
        ) from None
    except DuplicateName as exc:
        raise InvalidRequest(f"{where}: the name {exc} appears twice in one object") from None


class _NonFinite(ValueError):
    pass


def _finite(literal: str) -> float:
    number = float(literal)
    if not math.isfinite(number):
        raise _NonFinite(literal[:40])
    return number


def _not_a_number(literal: str) -> float:
    raise _NonFinite(literal)


def require_idempotency_key(value: str | None) -> str:
    if not value:
        raise InvalidRequest("the Idempotency-Key header is required")
    if len(value) > 255:
        raise InvalidRequest("the Idempotency-Key header is longer than 255 characters")
    return value


class HeldStreamingResponse(StreamingResponse):
    """A ``StreamingResponse`` of a stream that holds a slot (``HeldStream``): the stream
    is closed once the response is over, however it ended, and so gives its slot back.

    Starlette only iterates the stream. Under ASGI 2.3 (uvicorn) it streams in a task
    that a client's disconnect cancels wherever that task is: inside a ``send`` waiting
    for a client that reads no more to drain, the stream was neither read again nor
    closed, and its slot was held until the replica restarted."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()
