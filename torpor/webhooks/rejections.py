"""Why an inbound webhook was refused, and what to answer.

Every malformed header, body or token at the webhook trust boundary becomes a
``WebhookRejected`` carrying a ``RejectReason``; nothing else escapes. The reason decides
the HTTP status (one map, below) and a fixed public detail that is safe to send back to
whoever made the request, who may be an attacker probing for an oracle.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Final

from torpor.errors import PermanentError


class RejectReason(StrEnum):
    MISSING_SIGNATURE = "missing_signature"
    MALFORMED_SIGNATURE = "malformed_signature"
    BAD_SIGNATURE = "bad_signature"
    MISSING_TIMESTAMP = "missing_timestamp"
    MALFORMED_TIMESTAMP = "malformed_timestamp"
    TIMESTAMP_TOO_OLD = "timestamp_too_old"
    TIMESTAMP_IN_FUTURE = "timestamp_in_future"
    MISSING_NONCE = "missing_nonce"
    MALFORMED_NONCE = "malformed_nonce"
    REPLAYED = "replayed"
    BODY_TOO_LARGE = "body_too_large"
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
    MALFORMED_BODY = "malformed_body"
    INVALID_CLOUDEVENT = "invalid_cloudevent"
    UNKNOWN_SOURCE = "unknown_source"
    # S105: these are reason names, not credentials.
    INVALID_TOKEN = "invalid_token"  # noqa: S105
    TOKEN_EXPIRED = "token_expired"  # noqa: S105
    TOKEN_USED = "token_used"  # noqa: S105


_R = RejectReason

# The only place a rejection becomes an HTTP status. Authentication problems are all 401
# so that a prober learns nothing from the status beyond "not authenticated".
STATUS: Final[dict[RejectReason, int]] = {
    _R.MISSING_SIGNATURE: 401,
    _R.MALFORMED_SIGNATURE: 401,
    _R.BAD_SIGNATURE: 401,
    _R.MISSING_TIMESTAMP: 401,
    _R.MALFORMED_TIMESTAMP: 401,
    _R.TIMESTAMP_TOO_OLD: 401,
    _R.TIMESTAMP_IN_FUTURE: 401,
    _R.MISSING_NONCE: 401,
    _R.MALFORMED_NONCE: 401,
    _R.INVALID_TOKEN: 401,
    _R.REPLAYED: 409,
    _R.TOKEN_USED: 409,
    _R.BODY_TOO_LARGE: 413,
    _R.UNSUPPORTED_MEDIA_TYPE: 415,
    _R.MALFORMED_BODY: 400,
    _R.INVALID_CLOUDEVENT: 400,
    _R.UNKNOWN_SOURCE: 404,
    _R.TOKEN_EXPIRED: 410,
}

# Fixed texts: none of them depends on which secret was tried or on the expected value,
# and "wrong secret" and "tampered body" read the same (both are BAD_SIGNATURE).
_DEFAULT_DETAIL: Final[dict[RejectReason, str]] = {
    _R.MISSING_SIGNATURE: "the signature header is missing",
    _R.MALFORMED_SIGNATURE: "the signature header is malformed",
    _R.BAD_SIGNATURE: "no signature matches",
    _R.MISSING_TIMESTAMP: "the timestamp header is missing",
    _R.MALFORMED_TIMESTAMP: "the timestamp header is malformed",
    _R.TIMESTAMP_TOO_OLD: "the timestamp is outside the accepted window",
    _R.TIMESTAMP_IN_FUTURE: "the timestamp is outside the accepted window",
    _R.MISSING_NONCE: "the delivery id header is missing",
    _R.MALFORMED_NONCE: "the delivery id header is malformed",
    _R.REPLAYED: "this delivery was already received",
    _R.BODY_TOO_LARGE: "the request body is too large",
    _R.UNSUPPORTED_MEDIA_TYPE: "the content type is not supported",
    _R.MALFORMED_BODY: "the request body is malformed",
    _R.INVALID_CLOUDEVENT: "the request is not a valid CloudEvent",
    _R.UNKNOWN_SOURCE: "unknown webhook source",
    _R.INVALID_TOKEN: "the callback token is invalid",
    _R.TOKEN_EXPIRED: "the callback token has expired",
    _R.TOKEN_USED: "the callback token was already used",
}


class WebhookRejected(PermanentError):
    """An inbound webhook, CloudEvent or callback token was refused.

    ``public_detail`` is safe to return to the caller; ``context`` is for the audit log and
    must never hold secrets either.
    """

    code = "webhook_rejected"

    def __init__(
        self, reason: RejectReason, public_detail: str | None = None, **context: Any
    ) -> None:
        self.reason = RejectReason(reason)
        self.status: int = STATUS[self.reason]
        self.public_detail: str = public_detail or _DEFAULT_DETAIL[self.reason]
        super().__init__(f"{self.reason}: {self.public_detail}", **context)

    def __reduce__(self) -> tuple[Any, ...]:
        # The default pickling calls cls(*self.args) with the message string; rejections
        # cross Ray process boundaries, so rebuild from the reason instead.
        return (_rebuild, (self.reason, self.public_detail, self.context))

    def __repr__(self) -> str:
        return f"WebhookRejected({self.reason.value!r}, {self.public_detail!r})"


def _rebuild(reason: RejectReason, public_detail: str, context: dict[str, Any]) -> WebhookRejected:
    return WebhookRejected(reason, public_detail, **context)


def ensure_body_size(length: int, *, limit: int) -> None:
    """Reject a body (or a declared Content-Length) longer than ``limit`` bytes.

    Call it before verifying: HMAC over an unbounded body is a cheap denial of service.
    """
    if length > limit:
        raise WebhookRejected(RejectReason.BODY_TOO_LARGE, length=length, limit=limit)
