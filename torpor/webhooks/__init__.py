"""The webhook trust layer: pure signature checks, CloudEvents parsing, callback tokens.

No I/O here. The ingress reads the raw body, calls ``verify`` (or ``open_token``), claims
the returned delivery/token id once in Redis, then calls ``parse_http``; every refusal is
a ``WebhookRejected`` whose ``status`` and ``public_detail`` become the problem+json reply.
"""

from torpor.errors import RejectReason, WebhookRejected
from torpor.webhooks.capability import CapabilityClaims, mint, open_token
from torpor.webhooks.cloudevents import InboundEvent, PayloadMapping, handshake, parse_http
from torpor.webhooks.rejections import ensure_body_size
from torpor.webhooks.signing import Scheme, Verified, generate_secret, sign, verify

__all__ = [
    "CapabilityClaims",
    "InboundEvent",
    "PayloadMapping",
    "RejectReason",
    "Scheme",
    "Verified",
    "WebhookRejected",
    "ensure_body_size",
    "generate_secret",
    "handshake",
    "mint",
    "open_token",
    "parse_http",
    "sign",
    "verify",
]
