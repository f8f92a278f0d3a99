"""The first check at the webhook trust boundary: the body's size.

Refusals are ``torpor.errors.WebhookRejected`` with a ``RejectReason``.
"""

from __future__ import annotations

from torpor.errors import RejectReason, WebhookRejected


def ensure_body_size(length: int, *, limit: int) -> None:
    """Reject a body (or a declared Content-Length) longer than ``limit`` bytes.

    Call it before verifying: HMAC over an unbounded body is a cheap denial of service.
    """
    if length > limit:
        raise WebhookRejected(RejectReason.BODY_TOO_LARGE, length=length, limit=limit)
