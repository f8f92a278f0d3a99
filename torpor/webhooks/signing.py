"""HMAC webhook signatures: sign and verify over raw bytes, with time as a parameter.

Four schemes (see REFERENCES.md, "Inbound webhook schemes"):

* ``torpor``: ``X-Torpor-Signature`` = hex HMAC-SHA256 of ``timestamp + "." + body``,
  ``X-Torpor-Timestamp`` (unix seconds), ``X-Torpor-Nonce`` (16-128 of ``[A-Za-z0-9_-]``).
* ``standard`` (Standard Webhooks v1): ``webhook-id``, ``webhook-timestamp``,
  ``webhook-signature`` = space-separated ``v1,<base64>`` over ``{id}.{timestamp}.{body}``;
  secrets are ``whsec_`` + base64 of the key.
* ``github``: ``X-Hub-Signature-256: sha256=<hex>`` over the body; no timestamp;
  ``X-GitHub-Delivery`` is the delivery id.
* ``stripe``: ``Stripe-Signature: t=<ts>,v1=<hex>[,v1=<hex>...]`` over ``{t}.{body}``.

``verify`` succeeds if any configured secret (rotation) matches any presented signature,
checks the timestamp window in both directions, and turns every malformed input into a
``WebhookRejected``. It does not claim the delivery id: that is the caller's
``SET key 1 NX EX ttl`` (ttl at least the window), answered with ``RejectReason.REPLAYED``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import math
import re
import secrets as _random
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Final, NamedTuple

from torpor.errors import RejectReason, WebhookRejected, WebhookSecretInvalid
from torpor.webhooks.headers import RequestHeaders

_R = RejectReason


class Scheme(StrEnum):
    TORPOR = "torpor"
    STANDARD = "standard"
    GITHUB = "github"
    STRIPE = "stripe"


@dataclass(frozen=True, slots=True)
class Verified:
    """What a successful verification established.

    ``delivery_id`` is what the caller claims once (``SET NX EX``) to refuse replays: the
    torpor nonce, the Standard Webhooks ``webhook-id``, ``X-GitHub-Delivery``, or for
    Stripe a digest of the signed content (see ``_parse_stripe``). ``content_digest`` is
    the SHA-256 of exactly the bytes the MAC covers. The torpor nonce and the GitHub
    delivery header are *not* covered by the MAC, so a captured request replayed with a
    fresh nonce passes ``verify``; callers that need replay safety against an active
    attacker should claim ``content_digest`` as well.
    """

    scheme: Scheme
    delivery_id: str | None
    timestamp: datetime | None
    signature: str
    content_digest: str


# Header values past this length are refused before any work is done on them.
_MAX_HEADER_CHARS: Final = 4096
_HEX_SHA256: Final = re.compile(r"[0-9a-fA-F]{64}")
# Explicit [0-9]: ``\d`` and str.isdigit() accept non-ASCII digits such as "٣".
_UNIX_SECONDS: Final = re.compile(r"[0-9]{1,15}")
_TORPOR_NONCE: Final = re.compile(r"[A-Za-z0-9_-]{16,128}")
# Printable ASCII without whitespace: the id is spliced into the signed content and
# used as a storage key.
_DELIVERY_ID: Final = re.compile(r"[\x21-\x7e]{1,256}")
_WHSEC_PREFIX: Final = "whsec_"


class _Parsed(NamedTuple):
    content: bytes  # exactly what the MAC covers
    signatures: list[bytes]
    timestamp: int | None
    delivery_id: str | None
    signature_header: str


class _Headers:
    """Case-insensitive view of request headers that refuses ambiguous duplicates."""

    def __init__(self, raw: Mapping[str, str]) -> None:
        read = RequestHeaders.of(raw)
        self._values, self._conflicts = read.by_name, read.conflicts

    def get(
        self,
        name: str,
        *,
        missing: RejectReason,
        malformed: RejectReason,
        pattern: re.Pattern[str] | None = None,
    ) -> str:
        if name in self._conflicts:
            raise WebhookRejected(malformed, header=name, problem="conflicting duplicates")
        value = self._values.get(name, "").strip()
        if not value:
            raise WebhookRejected(missing, header=name)
        if len(value) > _MAX_HEADER_CHARS or not value.isascii():
            raise WebhookRejected(malformed, header=name)
        if pattern is not None and not pattern.fullmatch(value):
            raise WebhookRejected(malformed, header=name)
        return value


def _require_aware(now: datetime) -> None:
    if now.tzinfo is None or now.utcoffset() is None:
        raise ValueError("now must be a timezone-aware datetime")


def decode_key(scheme: Scheme, secret: str, index: int = 0) -> bytes:
    """Turn a configured secret into HMAC key bytes; the error names the index only.

    Settings call it when they load (inline secrets) and when they resolve ``env:``
    ones, so a secret no delivery could use is refused before a request meets it.
    """
    if not isinstance(secret, str):
        raise WebhookSecretInvalid(f"webhook secret #{index} is not a string")
    if scheme is Scheme.STANDARD:
        # Like the reference library: ``whsec_`` optional, padding optional.
        raw = secret.strip().removeprefix(_WHSEC_PREFIX).rstrip("=")
        try:
            key = base64.b64decode(raw + "=" * (-len(raw) % 4), validate=True)
        except (binascii.Error, ValueError):
            raise WebhookSecretInvalid(f"webhook secret #{index} is not valid base64") from None
    else:
        # Stripe and GitHub use the secret text itself (Stripe's ``whsec_`` included).
        try:
            key = secret.encode("utf-8")
        except UnicodeEncodeError:
            raise WebhookSecretInvalid(f"webhook secret #{index} is not valid text") from None
    if not key:
        # An empty HMAC key would let anyone sign.
        raise WebhookSecretInvalid(f"webhook secret #{index} is empty")
    return key


def _hmac(key: bytes, content: bytes) -> bytes:
    return hmac.new(key, content, hashlib.sha256).digest()


def _parse_torpor(headers: _Headers, body: bytes) -> _Parsed:
    signature = headers.get(
        "x-torpor-signature", missing=_R.MISSING_SIGNATURE, malformed=_R.MALFORMED_SIGNATURE
    )
    timestamp = headers.get(
        "x-torpor-timestamp", missing=_R.MISSING_TIMESTAMP, malformed=_R.MALFORMED_TIMESTAMP
    )
    nonce = headers.get(
        "x-torpor-nonce",
        missing=_R.MISSING_NONCE,
        malformed=_R.MALFORMED_NONCE,
        pattern=_TORPOR_NONCE,
    )
    if not _UNIX_SECONDS.fullmatch(timestamp):
        raise WebhookRejected(_R.MALFORMED_TIMESTAMP)
    if not _HEX_SHA256.fullmatch(signature):
        raise WebhookRejected(_R.MALFORMED_SIGNATURE)
    return _Parsed(
        content=timestamp.encode() + b"." + body,
        signatures=[bytes.fromhex(signature)],
        timestamp=int(timestamp),
        delivery_id=nonce,
        signature_header=signature,
    )


def _parse_standard(headers: _Headers, body: bytes) -> _Parsed:
    header = headers.get(
        "webhook-signature", missing=_R.MISSING_SIGNATURE, malformed=_R.MALFORMED_SIGNATURE
    )
    timestamp = headers.get(
        "webhook-timestamp", missing=_R.MISSING_TIMESTAMP, malformed=_R.MALFORMED_TIMESTAMP
    )
    msg_id = headers.get(
        "webhook-id", missing=_R.MISSING_NONCE, malformed=_R.MALFORMED_NONCE, pattern=_DELIVERY_ID
    )
    if not _UNIX_SECONDS.fullmatch(timestamp):
        raise WebhookRejected(_R.MALFORMED_TIMESTAMP)
    signatures: list[bytes] = []
    malformed = False
    for entry in header.split():
        version, comma, encoded = entry.partition(",")
        if not comma:
            raise WebhookRejected(_R.MALFORMED_SIGNATURE)
        # Other versions (v1a: ed25519) are legal but not ours to check; skip them.
        if version != "v1":
            continue
        stripped = encoded.rstrip("=")
        try:
            raw = base64.b64decode(stripped + "=" * (-len(stripped) % 4), validate=True)
        except (binascii.Error, ValueError):
            raw = b""
        if len(raw) != hashlib.sha256().digest_size:
            # One that cannot match, beside others that may: skipped, as the reference
            # verifiers do (they compare the encoded text and never decode it). Alone it
            # is refused for what it is.
            malformed = True
            continue
        signatures.append(raw)
    if malformed and not signatures:
        raise WebhookRejected(_R.MALFORMED_SIGNATURE)
    return _Parsed(
        content=f"{msg_id}.{timestamp}.".encode() + body,
        signatures=signatures,
        timestamp=int(timestamp),
        delivery_id=msg_id,
        signature_header=header,
    )


def _parse_github(headers: _Headers, body: bytes) -> _Parsed:
    header = headers.get(
        "x-hub-signature-256", missing=_R.MISSING_SIGNATURE, malformed=_R.MALFORMED_SIGNATURE
    )
    delivery = headers.get(
        "x-github-delivery",
        missing=_R.MISSING_NONCE,
        malformed=_R.MALFORMED_NONCE,
        pattern=_DELIVERY_ID,
    )
    algorithm, equals, hex_digest = header.partition("=")
    if not equals or algorithm.lower() != "sha256" or not _HEX_SHA256.fullmatch(hex_digest):
        raise WebhookRejected(_R.MALFORMED_SIGNATURE)
    return _Parsed(
        content=body,
        signatures=[bytes.fromhex(hex_digest)],
        timestamp=None,
        delivery_id=delivery,
        signature_header=header,
    )


def _parse_stripe(headers: _Headers, body: bytes) -> _Parsed:
    header = headers.get(
        "stripe-signature", missing=_R.MISSING_SIGNATURE, malformed=_R.MALFORMED_SIGNATURE
    )
    timestamp: str | None = None
    signatures: list[bytes] = []
    for item in header.split(","):
        key, equals, value = item.strip().partition("=")
        if not equals:
            raise WebhookRejected(_R.MALFORMED_SIGNATURE)
        if key == "t":
            if timestamp is not None:
                raise WebhookRejected(_R.MALFORMED_TIMESTAMP)
            timestamp = value
        elif key == "v1":
            if not _HEX_SHA256.fullmatch(value):
                raise WebhookRejected(_R.MALFORMED_SIGNATURE)
            signatures.append(bytes.fromhex(value))
        # v0 (test-mode) and unknown schemes are ignored, as Stripe's own library does.
    if timestamp is None:
        raise WebhookRejected(_R.MISSING_TIMESTAMP)
    if not _UNIX_SECONDS.fullmatch(timestamp):
        raise WebhookRejected(_R.MALFORMED_TIMESTAMP)
    content = f"{timestamp}.".encode() + body
    # Stripe sends no delivery id before the body is parsed, so the replay key must come
    # from the signature. Not the raw header value, though: it is malleable (reorder the
    # v1 entries, drop one during rotation, add a v0) while still verifying. The digest of
    # the signed content is what every valid signature for this delivery commits to.
    return _Parsed(
        content=content,
        signatures=signatures,
        timestamp=int(timestamp),
        delivery_id=hashlib.sha256(content).hexdigest(),
        signature_header=header,
    )


# What each scheme's MAC covers. Two schemes of one shape with one key verify each
# other's signatures: torpor and Stripe both sign hex HMAC-SHA256 of ``timestamp.body``.
_SIGNED_SHAPE: Final = {
    Scheme.TORPOR: "timestamp.body",
    Scheme.STANDARD: "id.timestamp.body",
    Scheme.GITHUB: "body",
    Scheme.STRIPE: "timestamp.body",
}


def signed_shape(scheme: Scheme) -> str:
    """What the scheme's MAC covers; schemes of one shape sharing a key accept each
    other's deliveries (settings refuse such a configuration)."""
    return _SIGNED_SHAPE[Scheme(scheme)]


_PARSERS: Final = {
    Scheme.TORPOR: _parse_torpor,
    Scheme.STANDARD: _parse_standard,
    Scheme.GITHUB: _parse_github,
    Scheme.STRIPE: _parse_stripe,
}


def _check_window(timestamp: int, now: datetime, tolerance_s: float) -> datetime:
    age = now.timestamp() - timestamp
    if age > tolerance_s:
        raise WebhookRejected(_R.TIMESTAMP_TOO_OLD, age_s=age)
    if -age > tolerance_s:
        raise WebhookRejected(_R.TIMESTAMP_IN_FUTURE, age_s=age)
    try:
        return datetime.fromtimestamp(timestamp, UTC)
    except (OverflowError, OSError, ValueError):
        raise WebhookRejected(_R.MALFORMED_TIMESTAMP) from None


def verify(
    scheme: Scheme,
    body: bytes,
    headers: Mapping[str, str],
    secrets: Sequence[str],
    *,
    now: datetime,
    tolerance_s: float = 300,
) -> Verified:
    """Check a delivery's signature and timestamp over the raw body bytes.

    Raises ``WebhookRejected`` for anything the sender controls, ``WebhookSecretInvalid``
    for a bad configured secret (never showing its value) and ``ValueError`` for a naive
    ``now`` or a ``tolerance_s`` that is not a finite, non-negative number.
    """
    scheme = Scheme(scheme)
    _require_aware(now)
    if not (math.isfinite(tolerance_s) and tolerance_s >= 0):
        # NaN compares false both ways: every timestamp would pass the window.
        raise ValueError("tolerance_s must be a finite number of seconds, not negative")
    if isinstance(secrets, str):
        # A bare string is a Sequence[str]: each character would become a one-byte key.
        raise TypeError("secrets must be a sequence of secrets, not one string")
    if not secrets:
        raise WebhookSecretInvalid("no webhook secret is configured for this source")
    keys = [decode_key(scheme, secret, index) for index, secret in enumerate(secrets)]

    parsed = _PARSERS[scheme](_Headers(headers), body)

    # Signature before window: a stale timestamp is then reported only for authentic
    # deliveries (a skewed sender clock or a replay), never for forgeries.
    matched = any(
        hmac.compare_digest(_hmac(key, parsed.content), presented)
        for key in keys
        for presented in parsed.signatures
    )
    if not matched:
        raise WebhookRejected(_R.BAD_SIGNATURE, scheme=scheme.value)

    timestamp = None
    if parsed.timestamp is not None:
        timestamp = _check_window(parsed.timestamp, now, tolerance_s)
    return Verified(
        scheme=scheme,
        delivery_id=parsed.delivery_id,
        timestamp=timestamp,
        signature=parsed.signature_header,
        content_digest=hashlib.sha256(parsed.content).hexdigest(),
    )


def sign(
    scheme: Scheme,
    body: bytes,
    secret: str,
    *,
    now: datetime,
    nonce: str | None = None,
    msg_id: str | None = None,
) -> dict[str, str]:
    """Headers a sender attaches to ``body`` (for tests, the CLI and the demo simulator).

    ``nonce`` and ``msg_id`` both name the delivery id (torpor nonce, ``webhook-id``,
    ``X-GitHub-Delivery``); a random one is generated when neither is given. Stripe has
    no delivery id header, so both are ignored there.
    """
    scheme = Scheme(scheme)
    _require_aware(now)
    if nonce is not None and msg_id is not None and nonce != msg_id:
        raise ValueError("nonce and msg_id name the same header; give one")
    delivery = nonce if nonce is not None else msg_id
    key = decode_key(scheme, secret, 0)
    timestamp = str(math.floor(now.timestamp()))

    if scheme is Scheme.TORPOR:
        delivery = delivery if delivery is not None else _random.token_urlsafe(24)
        if not _TORPOR_NONCE.fullmatch(delivery):
            raise ValueError("a torpor nonce is 16-128 characters of [A-Za-z0-9_-]")
        mac = _hmac(key, timestamp.encode() + b"." + body)
        return {
            "X-Torpor-Signature": mac.hex(),
            "X-Torpor-Timestamp": timestamp,
            "X-Torpor-Nonce": delivery,
        }
    if scheme is Scheme.STANDARD:
        delivery = delivery if delivery is not None else f"msg_{uuid.uuid4().hex}"
        if not _DELIVERY_ID.fullmatch(delivery):
            raise ValueError("a webhook-id is 1-256 printable ASCII characters")
        mac = _hmac(key, f"{delivery}.{timestamp}.".encode() + body)
        return {
            "webhook-id": delivery,
            "webhook-timestamp": timestamp,
            "webhook-signature": "v1," + base64.b64encode(mac).decode("ascii"),
        }
    if scheme is Scheme.GITHUB:
        delivery = delivery if delivery is not None else str(uuid.uuid4())
        if not _DELIVERY_ID.fullmatch(delivery):
            raise ValueError("a delivery id is 1-256 printable ASCII characters")
        return {
            "X-Hub-Signature-256": "sha256=" + _hmac(key, body).hex(),
            "X-GitHub-Delivery": delivery,
        }
    mac = _hmac(key, f"{timestamp}.".encode() + body)
    return {"Stripe-Signature": f"t={timestamp},v1={mac.hex()}"}


def generate_secret(scheme: Scheme) -> str:
    """A fresh random secret in the scheme's usual shape.

    Standard Webhooks: ``whsec_`` + base64 of 32 random bytes; the others: 64 hex chars.
    """
    if Scheme(scheme) is Scheme.STANDARD:
        return _WHSEC_PREFIX + base64.b64encode(_random.token_bytes(32)).decode("ascii")
    return _random.token_hex(32)
