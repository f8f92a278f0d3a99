"""The one map from torpor errors to HTTP problem details (RFC 9457).

Everything the HTTP edge answers with on failure goes through ``problem_for``: the status
comes from the error's stable code, the detail is the error's own message only for
errors whose message is written for the caller, and never a traceback.
"""

from __future__ import annotations

from dataclasses import dataclass

from torpor.errors import TorporError
from torpor.webhooks.rejections import WebhookRejected

TYPE_BASE = "https://torpor.dev/problems/"

# code → (status, title). Codes not listed are internal: 500 with a generic detail.
KNOWN: dict[str, tuple[int, str]] = {
    "unauthenticated": (401, "Unauthenticated"),
    "session_not_found": (404, "Not found"),
    "not_found": (404, "Not found"),
    "unknown_correlation": (404, "No matching wait"),
    "unknown_agent": (422, "Unknown agent"),
    "invalid_request": (400, "Invalid request"),
    "invalid_object_key": (400, "Invalid identifier"),
    "unsafe_callback_url": (400, "Callback URL refused"),
    "idempotency_key_reused": (422, "Idempotency-Key reused with a different request"),
    "idempotency_key_in_progress": (409, "Request with this Idempotency-Key in progress"),
    "commit_conflict": (409, "Conflict"),
    "storage_unavailable": (503, "Storage unavailable"),
    "index_unavailable": (503, "Index unavailable"),
    "activation_unavailable": (503, "Activation unavailable"),
}

# Errors whose message is phrased for the caller and reveals nothing internal.
PUBLIC_MESSAGES = {
    "unauthenticated",
    "session_not_found",
    "not_found",
    "unknown_agent",
    "invalid_request",
    "unsafe_callback_url",
    "idempotency_key_reused",
    "idempotency_key_in_progress",
    "unknown_correlation",
}


@dataclass(frozen=True)
class ProblemSpec:
    status: int
    code: str
    title: str
    detail: str | None
    retry_after: int | None = None

    def body(self, instance: str | None) -> dict[str, object]:
        return {
            "type": TYPE_BASE + self.code,
            "title": self.title,
            "status": self.status,
            "detail": self.detail,
            "instance": instance,
        }


def problem_for(exc: BaseException) -> ProblemSpec:
    if isinstance(exc, WebhookRejected):
        title = exc.reason.value.replace("_", " ").capitalize()
        return ProblemSpec(exc.status, exc.reason.value, title, exc.public_detail)
    if isinstance(exc, TorporError):
        status, title = KNOWN.get(exc.code, (500, "Internal error"))
        detail = exc.message if exc.code in PUBLIC_MESSAGES else None
        if status == 503:
            return ProblemSpec(status, exc.code, title, "try again shortly", retry_after=5)
        if status == 500:
            return ProblemSpec(500, "internal", "Internal error", None)
        return ProblemSpec(status, exc.code, title, detail)
    return ProblemSpec(500, "internal", "Internal error", None)


def problem(status: int, code: str, title: str, detail: str | None = None) -> ProblemSpec:
    return ProblemSpec(status, code, title, detail)
