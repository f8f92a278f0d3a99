"""Capability callback tokens, for senders that cannot hold a shared secret.

A token is handed out with the callback URL and is the whole credential: whoever presents
it may resolve exactly one wait of one session, once, before it expires. Format::

    v1.<base64url(compact JSON claims)>.<base64url(HMAC-SHA256(key, "v1." + claims part))>

base64url without padding. The MAC covers the version and the *encoded* claims, so they
are authenticated before any JSON is parsed. Several keys may be active (rotation); any of
them opens a token. Claiming ``token_id`` once (``SET NX EX``) is the caller's job,
answered with ``RejectReason.TOKEN_USED``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import math
import re
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Final

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from torpor.errors import RejectReason, WebhookRejected, WebhookSecretInvalid

_VERSION: Final = "v1"
_MIN_KEY_BYTES: Final = 16
_MAX_TOKEN_CHARS: Final = 2048
_MAX_ID_CHARS: Final = 256
_BASE64URL: Final = re.compile(r"[A-Za-z0-9_-]+")
_TAG_BYTES: Final = hashlib.sha256().digest_size


class CapabilityClaims(BaseModel):
    """What an authentic, unexpired token grants.

    ``token_id`` is a hash of the MAC, not the MAC itself: it is safe to log and to use as
    a storage key, whereas the MAC plus the (readable) claims would be the token again.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    tenant: str
    session_id: str
    wait_id: str
    correlation_id: str
    epoch: int
    expires_at: datetime
    token_id: str


class _Wire(BaseModel):
    """The signed claims document; one-letter keys keep tokens short enough for URLs."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    t: str = Field(min_length=1, max_length=_MAX_ID_CHARS)
    s: str = Field(min_length=1, max_length=_MAX_ID_CHARS)
    w: str = Field(min_length=1, max_length=_MAX_ID_CHARS)
    c: str = Field(min_length=1, max_length=_MAX_ID_CHARS)
    e: int = Field(ge=0)
    x: int = Field(ge=0)


def _encode(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def _decode(text: str) -> bytes | None:
    if not _BASE64URL.fullmatch(text):
        return None
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        return None
    # The last character of unpadded base64 carries spare bits, so several strings decode
    # to the same bytes. Only the canonical one is accepted: otherwise a used token could
    # be presented again under a different spelling.
    return raw if _encode(raw) == text else None


def _check_keys(keys: Sequence[bytes]) -> None:
    if isinstance(keys, bytes | bytearray | str):
        raise TypeError("keys must be a sequence of keys, not one key")
    if not keys:
        raise WebhookSecretInvalid("no capability key is configured")
    for index, key in enumerate(keys):
        check_key(key, index)


def check_key(key: bytes, index: int = 0) -> None:
    """Refuse a key too short to sign with; the error names the index only. Settings
    call it when they load (inline keys) and when they resolve ``env:`` ones."""
    if not isinstance(key, bytes) or len(key) < _MIN_KEY_BYTES:
        raise WebhookSecretInvalid(
            f"capability key #{index} must be at least {_MIN_KEY_BYTES} bytes"
        )


def _require_aware(value: datetime, name: str) -> None:
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(f"{name} must be a timezone-aware datetime")


def _mac(key: bytes, signing_input: bytes) -> bytes:
    return hmac.new(key, signing_input, hashlib.sha256).digest()


def mint(
    *,
    key: bytes,
    tenant: str,
    session_id: str,
    wait_id: str,
    correlation_id: str,
    epoch: int,
    expires_at: datetime,
) -> str:
    """Issue a token for one wait. ``expires_at`` is kept to the whole second (floor)."""
    _check_keys([key])
    _require_aware(expires_at, "expires_at")
    wire = _Wire(
        t=tenant,
        s=session_id,
        w=wait_id,
        c=correlation_id,
        e=epoch,
        x=math.floor(expires_at.timestamp()),
    )
    signing_input = f"{_VERSION}.{_encode(wire.model_dump_json().encode())}"
    return f"{signing_input}.{_encode(_mac(key, signing_input.encode()))}"


def open_token(token: str, *, keys: Sequence[bytes], now: datetime) -> CapabilityClaims:
    """Authenticate a token and return its claims.

    Raises ``WebhookRejected`` with ``invalid_token`` for anything not minted by one of
    ``keys`` (garbage, tampering, another key), ``token_expired`` once ``now`` reaches the
    expiry. Expiry is checked after the MAC so that it is reported only for real tokens.
    """
    _check_keys(keys)
    _require_aware(now, "now")
    invalid = WebhookRejected(RejectReason.INVALID_TOKEN)
    if not isinstance(token, str) or len(token) > _MAX_TOKEN_CHARS or not token.isascii():
        raise invalid
    parts = token.strip().split(".")
    if len(parts) != 3 or parts[0] != _VERSION:
        raise invalid
    tag = _decode(parts[2])
    if tag is None or len(tag) != _TAG_BYTES:
        raise invalid
    signing_input = f"{parts[0]}.{parts[1]}".encode()
    if not any(hmac.compare_digest(_mac(key, signing_input), tag) for key in keys):
        raise invalid

    payload = _decode(parts[1])
    if payload is None:
        raise invalid
    try:
        wire = _Wire.model_validate_json(payload)
        expires_at = datetime.fromtimestamp(wire.x, UTC)
    except (ValidationError, ValueError, OverflowError, OSError):
        raise invalid from None
    if now >= expires_at:
        raise WebhookRejected(RejectReason.TOKEN_EXPIRED)
    return CapabilityClaims(
        tenant=wire.t,
        session_id=wire.s,
        wait_id=wire.w,
        correlation_id=wire.c,
        epoch=wire.e,
        expires_at=expires_at,
        token_id=hashlib.sha256(b"torpor-capability-id:" + tag).hexdigest()[:32],
    )
