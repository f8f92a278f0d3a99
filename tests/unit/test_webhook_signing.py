"""Signature schemes: round trips, rotation, windows, malformed input, interop."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import math
import pickle
import re
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta

import pytest
import standardwebhooks
from hypothesis import given, settings
from hypothesis import strategies as st

from torpor.errors import REJECTION_STATUS as STATUS
from torpor.errors import PermanentError, WebhookSecretInvalid
from torpor.webhooks import (
    RejectReason,
    Scheme,
    WebhookRejected,
    ensure_body_size,
    generate_secret,
    sign,
    verify,
)
from torpor.webhooks.headers import RequestHeaders
from torpor.webhooks.signing import signed_shape

R = RejectReason
NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
BODY = b'{"id":"evt_1","status":"approved","correlationId":"c-42"}'
STANDARD_KEY = bytes(range(32))
SECRETS: dict[Scheme, str] = {
    Scheme.TORPOR: "torpor-secret-0123456789abcdef",
    Scheme.STANDARD: "whsec_" + base64.b64encode(STANDARD_KEY).decode(),
    Scheme.GITHUB: "It's a Secret to Everybody",
    Scheme.STRIPE: "whsec_stripe_test_secret",
}
OTHER_SECRETS: dict[Scheme, str] = {
    Scheme.TORPOR: "another-torpor-secret-000000000",
    Scheme.STANDARD: "whsec_" + base64.b64encode(bytes(range(32, 64))).decode(),
    Scheme.GITHUB: "another GitHub secret",
    Scheme.STRIPE: "whsec_stripe_rotated_secret",
}
TIMED = [Scheme.TORPOR, Scheme.STANDARD, Scheme.STRIPE]
NONCE = "n0nce_value-1234567890"


def rejected(
    scheme: Scheme,
    headers: Mapping[str, str],
    *,
    body: bytes = BODY,
    secrets: list[str] | None = None,
    now: datetime = NOW,
) -> WebhookRejected:
    with pytest.raises(WebhookRejected) as info:
        verify(scheme, body, headers, secrets or [SECRETS[scheme]], now=now)
    return info.value


def signed(scheme: Scheme, *, now: datetime = NOW, body: bytes = BODY) -> dict[str, str]:
    return sign(scheme, body, SECRETS[scheme], now=now, nonce=NONCE)


# --- round trips -----------------------------------------------------------------------


@pytest.mark.parametrize("scheme", list(Scheme))
def test_round_trip(scheme: Scheme) -> None:
    headers = signed(scheme)
    result = verify(scheme, BODY, headers, [SECRETS[scheme]], now=NOW)
    assert result.scheme is scheme
    assert result.timestamp == (None if scheme is Scheme.GITHUB else NOW)
    assert result.signature in headers.values()
    if scheme is Scheme.STRIPE:
        # Stripe has no delivery header: the replay key is the signed-content digest.
        assert result.delivery_id == result.content_digest
        assert re.fullmatch(r"[0-9a-f]{64}", result.delivery_id)
    else:
        assert result.delivery_id == NONCE


@pytest.mark.parametrize("scheme", list(Scheme))
def test_generated_delivery_ids_are_unique(scheme: Scheme) -> None:
    first = sign(scheme, BODY, SECRETS[scheme], now=NOW)
    second = sign(scheme, BODY, SECRETS[scheme], now=NOW)
    ids = [verify(scheme, BODY, h, [SECRETS[scheme]], now=NOW).delivery_id for h in (first, second)]
    if scheme is Scheme.STRIPE:
        assert ids[0] == ids[1]  # same content, same second: the same delivery
    else:
        assert ids[0] != ids[1]


def test_sign_accepts_msg_id_as_delivery_id() -> None:
    headers = sign(Scheme.STANDARD, BODY, SECRETS[Scheme.STANDARD], now=NOW, msg_id="msg_abc")
    assert headers["webhook-id"] == "msg_abc"
    assert verify(Scheme.STANDARD, BODY, headers, [SECRETS[Scheme.STANDARD]], now=NOW).delivery_id
    with pytest.raises(ValueError, match="same header"):
        sign(Scheme.TORPOR, BODY, "s", now=NOW, nonce="a" * 16, msg_id="b" * 16)


@pytest.mark.parametrize("nonce", ["short", "has space in it!!", "x" * 129])
def test_sign_refuses_an_invalid_torpor_nonce(nonce: str) -> None:
    with pytest.raises(ValueError, match="nonce"):
        sign(Scheme.TORPOR, BODY, "secret", now=NOW, nonce=nonce)


def test_github_test_vector() -> None:
    expected = "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17"
    headers = sign(Scheme.GITHUB, b"Hello, World!", "It's a Secret to Everybody", now=NOW)
    assert headers["X-Hub-Signature-256"] == expected
    inbound = {"X-Hub-Signature-256": expected, "X-GitHub-Delivery": "72d3162e-cc78-11e3"}
    result = verify(Scheme.GITHUB, b"Hello, World!", inbound, [SECRETS[Scheme.GITHUB]], now=NOW)
    assert result.delivery_id == "72d3162e-cc78-11e3"
    assert result.signature == expected


def test_torpor_signs_timestamp_dot_body_in_lowercase_hex() -> None:
    headers = signed(Scheme.TORPOR)
    timestamp = str(int(NOW.timestamp()))
    mac = hmac.new(SECRETS[Scheme.TORPOR].encode(), f"{timestamp}.".encode() + BODY, "sha256")
    assert headers == {
        "X-Torpor-Signature": mac.hexdigest(),
        "X-Torpor-Timestamp": timestamp,
        "X-Torpor-Nonce": NONCE,
    }
    result = verify(Scheme.TORPOR, BODY, headers, [SECRETS[Scheme.TORPOR]], now=NOW)
    assert result.content_digest == hashlib.sha256(f"{timestamp}.".encode() + BODY).hexdigest()


def test_uppercase_hex_signature_is_accepted() -> None:
    headers = signed(Scheme.TORPOR)
    headers["X-Torpor-Signature"] = headers["X-Torpor-Signature"].upper()
    verify(Scheme.TORPOR, BODY, headers, [SECRETS[Scheme.TORPOR]], now=NOW)


# --- rotation, wrong secrets, tampering ------------------------------------------------


@pytest.mark.parametrize("scheme", list(Scheme))
def test_rotation_accepts_old_and_new_secret(scheme: Scheme) -> None:
    old, new = SECRETS[scheme], OTHER_SECRETS[scheme]
    for signer in (old, new):
        headers = sign(scheme, BODY, signer, now=NOW, nonce=NONCE)
        verify(scheme, BODY, headers, [new, old], now=NOW)
        verify(scheme, BODY, headers, [old, new], now=NOW)


@pytest.mark.parametrize("scheme", list(Scheme))
def test_wrong_secret_and_tampered_body_look_the_same(scheme: Scheme) -> None:
    headers = signed(scheme)
    wrong = rejected(scheme, headers, secrets=[OTHER_SECRETS[scheme]])
    tampered = rejected(scheme, headers, body=BODY[:-1] + b"!")
    assert wrong.reason is tampered.reason is R.BAD_SIGNATURE
    assert wrong.status == tampered.status == 401
    assert wrong.public_detail == tampered.public_detail


@pytest.mark.parametrize("scheme", list(Scheme))
@pytest.mark.parametrize("index", [0, len(BODY) // 2, len(BODY) - 1])
def test_one_flipped_bit_is_rejected(scheme: Scheme, index: int) -> None:
    body = bytearray(BODY)
    body[index] ^= 0x01
    assert rejected(scheme, signed(scheme), body=bytes(body)).reason is R.BAD_SIGNATURE


def test_empty_body_is_signed_too() -> None:
    for scheme in Scheme:
        headers = signed(scheme, body=b"")
        verify(scheme, b"", headers, [SECRETS[scheme]], now=NOW)
        assert rejected(scheme, headers, body=b" ").reason is R.BAD_SIGNATURE


@pytest.mark.parametrize(
    ("scheme", "header"),
    [
        (Scheme.TORPOR, "X-Torpor-Timestamp"),
        (Scheme.STANDARD, "webhook-timestamp"),
        (Scheme.STANDARD, "webhook-id"),
    ],
)
def test_signed_headers_cannot_be_swapped(scheme: Scheme, header: str) -> None:
    headers = signed(scheme)
    headers[header] = (
        str(int(headers[header]) - 1) if header.lower().endswith("timestamp") else "msg_other"
    )
    assert rejected(scheme, headers).reason is R.BAD_SIGNATURE


def test_stripe_delivery_id_survives_header_malleation() -> None:
    old, new = SECRETS[Scheme.STRIPE], OTHER_SECRETS[Scheme.STRIPE]
    timestamp = int(NOW.timestamp())
    sig_old = hmac.new(old.encode(), f"{timestamp}.".encode() + BODY, "sha256").hexdigest()
    sig_new = hmac.new(new.encode(), f"{timestamp}.".encode() + BODY, "sha256").hexdigest()
    variants = [
        f"t={timestamp},v1={sig_old},v1={sig_new}",
        f"t={timestamp},v1={sig_new},v1={sig_old}",
        f"v1={sig_new}, t={timestamp}",
        f"t={timestamp},v0={'0' * 64},v1={sig_old},scheme=ignored",
    ]
    ids = {
        verify(Scheme.STRIPE, BODY, {"Stripe-Signature": v}, [old, new], now=NOW).delivery_id
        for v in variants
    }
    assert len(ids) == 1


# --- timestamp window ------------------------------------------------------------------


@pytest.mark.parametrize("scheme", TIMED)
@pytest.mark.parametrize(
    ("offset_s", "reason"),
    [
        (-300, None),
        (300, None),
        (-301, R.TIMESTAMP_TOO_OLD),
        (301, R.TIMESTAMP_IN_FUTURE),
        (-86_400, R.TIMESTAMP_TOO_OLD),
        (86_400, R.TIMESTAMP_IN_FUTURE),
    ],
)
def test_window_in_both_directions(scheme: Scheme, offset_s: int, reason: RejectReason) -> None:
    headers = signed(scheme, now=NOW + timedelta(seconds=offset_s))
    if reason is None:
        result = verify(scheme, BODY, headers, [SECRETS[scheme]], now=NOW)
        assert result.timestamp == NOW + timedelta(seconds=offset_s)
    else:
        assert rejected(scheme, headers).reason is reason


def test_custom_tolerance() -> None:
    headers = signed(Scheme.TORPOR, now=NOW - timedelta(seconds=30))
    verify(Scheme.TORPOR, BODY, headers, [SECRETS[Scheme.TORPOR]], now=NOW, tolerance_s=30)
    with pytest.raises(WebhookRejected) as info:
        verify(Scheme.TORPOR, BODY, headers, [SECRETS[Scheme.TORPOR]], now=NOW, tolerance_s=29)
    assert info.value.reason is R.TIMESTAMP_TOO_OLD


def test_github_has_no_window() -> None:
    headers = signed(Scheme.GITHUB, now=NOW - timedelta(days=365))
    assert verify(Scheme.GITHUB, BODY, headers, [SECRETS[Scheme.GITHUB]], now=NOW).timestamp is None


def test_stale_forgery_reports_bad_signature_not_age() -> None:
    headers = signed(Scheme.TORPOR, now=NOW - timedelta(hours=1))
    assert rejected(Scheme.TORPOR, headers, secrets=["nope"]).reason is R.BAD_SIGNATURE


def test_huge_timestamp_is_just_in_the_future() -> None:
    ts = "9" * 15
    mac = hmac.new(SECRETS[Scheme.TORPOR].encode(), f"{ts}.".encode() + BODY, "sha256")
    headers = {
        "X-Torpor-Signature": mac.hexdigest(),
        "X-Torpor-Timestamp": ts,
        "X-Torpor-Nonce": NONCE,
    }
    assert rejected(Scheme.TORPOR, headers).reason is R.TIMESTAMP_IN_FUTURE


# --- missing and malformed headers -----------------------------------------------------


@pytest.mark.parametrize(
    ("scheme", "header", "reason"),
    [
        (Scheme.TORPOR, "X-Torpor-Signature", R.MISSING_SIGNATURE),
        (Scheme.TORPOR, "X-Torpor-Timestamp", R.MISSING_TIMESTAMP),
        (Scheme.TORPOR, "X-Torpor-Nonce", R.MISSING_NONCE),
        (Scheme.STANDARD, "webhook-signature", R.MISSING_SIGNATURE),
        (Scheme.STANDARD, "webhook-timestamp", R.MISSING_TIMESTAMP),
        (Scheme.STANDARD, "webhook-id", R.MISSING_NONCE),
        (Scheme.GITHUB, "X-Hub-Signature-256", R.MISSING_SIGNATURE),
        (Scheme.GITHUB, "X-GitHub-Delivery", R.MISSING_NONCE),
        (Scheme.STRIPE, "Stripe-Signature", R.MISSING_SIGNATURE),
    ],
)
def test_missing_header(scheme: Scheme, header: str, reason: RejectReason) -> None:
    headers = signed(scheme)
    del headers[header]
    assert rejected(scheme, headers).reason is reason
    headers[header] = "   "
    assert rejected(scheme, headers).reason is reason


@pytest.mark.parametrize("scheme", list(Scheme))
def test_no_headers_at_all(scheme: Scheme) -> None:
    assert rejected(scheme, {}).reason is R.MISSING_SIGNATURE


HEX = "ab" * 32

MALFORMED = [
    # torpor
    (Scheme.TORPOR, "X-Torpor-Signature", "zz" * 32, R.MALFORMED_SIGNATURE),
    (Scheme.TORPOR, "X-Torpor-Signature", HEX[:-1], R.MALFORMED_SIGNATURE),
    (Scheme.TORPOR, "X-Torpor-Signature", HEX + "00", R.MALFORMED_SIGNATURE),
    (Scheme.TORPOR, "X-Torpor-Signature", "v1=" + HEX, R.MALFORMED_SIGNATURE),
    (Scheme.TORPOR, "X-Torpor-Signature", "ab " * 32, R.MALFORMED_SIGNATURE),
    (Scheme.TORPOR, "X-Torpor-Signature", "é" * 64, R.MALFORMED_SIGNATURE),
    (Scheme.TORPOR, "X-Torpor-Signature", "a" * 5000, R.MALFORMED_SIGNATURE),
    (Scheme.TORPOR, "X-Torpor-Timestamp", "abc", R.MALFORMED_TIMESTAMP),
    (Scheme.TORPOR, "X-Torpor-Timestamp", "-5", R.MALFORMED_TIMESTAMP),
    (Scheme.TORPOR, "X-Torpor-Timestamp", "1767268800.5", R.MALFORMED_TIMESTAMP),
    (Scheme.TORPOR, "X-Torpor-Timestamp", "١٧٦٧٢٦٨٨٠٠", R.MALFORMED_TIMESTAMP),
    (Scheme.TORPOR, "X-Torpor-Timestamp", "1e9", R.MALFORMED_TIMESTAMP),
    (Scheme.TORPOR, "X-Torpor-Timestamp", "1" * 16, R.MALFORMED_TIMESTAMP),
    (Scheme.TORPOR, "X-Torpor-Nonce", "short", R.MALFORMED_NONCE),
    (Scheme.TORPOR, "X-Torpor-Nonce", "x" * 129, R.MALFORMED_NONCE),
    (Scheme.TORPOR, "X-Torpor-Nonce", "nonce-with-a-dot.1234", R.MALFORMED_NONCE),
    (Scheme.TORPOR, "X-Torpor-Nonce", "ñonce-ñonce-ñonce-ñ", R.MALFORMED_NONCE),
    # Standard Webhooks
    (Scheme.STANDARD, "webhook-signature", "v1", R.MALFORMED_SIGNATURE),
    (Scheme.STANDARD, "webhook-signature", "v1,not*base64", R.MALFORMED_SIGNATURE),
    (Scheme.STANDARD, "webhook-signature", "v1," + "A" * 5, R.MALFORMED_SIGNATURE),
    (
        Scheme.STANDARD,
        "webhook-signature",
        "v1," + base64.b64encode(b"x" * 16).decode(),
        R.MALFORMED_SIGNATURE,
    ),
    (Scheme.STANDARD, "webhook-signature", "v1a,whatever", R.BAD_SIGNATURE),
    (Scheme.STANDARD, "webhook-timestamp", "12abc", R.MALFORMED_TIMESTAMP),
    (Scheme.STANDARD, "webhook-timestamp", "1767268800.0", R.MALFORMED_TIMESTAMP),
    (Scheme.STANDARD, "webhook-id", "msg id", R.MALFORMED_NONCE),
    (Scheme.STANDARD, "webhook-id", "m" * 257, R.MALFORMED_NONCE),
    (Scheme.STANDARD, "webhook-id", "msg_\u00e9", R.MALFORMED_NONCE),
    # GitHub
    (Scheme.GITHUB, "X-Hub-Signature-256", "sha1=" + "ab" * 20, R.MALFORMED_SIGNATURE),
    (Scheme.GITHUB, "X-Hub-Signature-256", HEX, R.MALFORMED_SIGNATURE),
    (Scheme.GITHUB, "X-Hub-Signature-256", "sha256=" + HEX[:40], R.MALFORMED_SIGNATURE),
    (Scheme.GITHUB, "X-Hub-Signature-256", "sha256=" + "g" * 64, R.MALFORMED_SIGNATURE),
    (Scheme.GITHUB, "X-GitHub-Delivery", "a b", R.MALFORMED_NONCE),
    # Stripe
    (Scheme.STRIPE, "Stripe-Signature", "garbage", R.MALFORMED_SIGNATURE),
    (Scheme.STRIPE, "Stripe-Signature", f"v1={HEX}", R.MISSING_TIMESTAMP),
    (Scheme.STRIPE, "Stripe-Signature", f"t=abc,v1={HEX}", R.MALFORMED_TIMESTAMP),
    (Scheme.STRIPE, "Stripe-Signature", f"t=,v1={HEX}", R.MALFORMED_TIMESTAMP),
    (Scheme.STRIPE, "Stripe-Signature", f"t=1,t=2,v1={HEX}", R.MALFORMED_TIMESTAMP),
    (Scheme.STRIPE, "Stripe-Signature", "t=1767268800,v1=xyz", R.MALFORMED_SIGNATURE),
    (Scheme.STRIPE, "Stripe-Signature", "t=1767268800", R.BAD_SIGNATURE),
    (Scheme.STRIPE, "Stripe-Signature", f"t=1767268800,,v1={HEX}", R.MALFORMED_SIGNATURE),
]


@pytest.mark.parametrize(("scheme", "header", "value", "reason"), MALFORMED)
def test_malformed_header(scheme: Scheme, header: str, value: str, reason: RejectReason) -> None:
    headers = signed(scheme)
    headers[header] = value
    error = rejected(scheme, headers)
    assert error.reason is reason
    assert error.status == 401


@pytest.mark.parametrize("scheme", list(Scheme))
@pytest.mark.parametrize("case", [str.lower, str.upper, str.title])
def test_header_names_are_case_insensitive(scheme: Scheme, case: Callable[[str], str]) -> None:
    headers = {case(name): f"  {value} " for name, value in signed(scheme).items()}
    verify(scheme, BODY, headers, [SECRETS[scheme]], now=NOW)


def test_conflicting_duplicate_headers_are_refused() -> None:
    headers = signed(Scheme.TORPOR)
    headers["x-torpor-signature"] = "cd" * 32
    assert rejected(Scheme.TORPOR, headers).reason is R.MALFORMED_SIGNATURE
    headers["x-torpor-signature"] = headers["X-Torpor-Signature"]
    verify(Scheme.TORPOR, BODY, headers, [SECRETS[Scheme.TORPOR]], now=NOW)


def test_duplicate_signature_headers_differing_only_in_padding_are_refused_read_once_or_not() -> (
    None
):
    """Two spellings of the signature header whose values differ at all are refused, as
    they always were, also when the gateway hands the verifier its one reading of the
    request's headers (``RequestHeaders``), which compares stripped values for the
    CloudEvents parser."""
    headers = signed(Scheme.TORPOR)
    headers["x-torpor-signature"] = headers["X-Torpor-Signature"] + " "
    assert rejected(Scheme.TORPOR, headers).reason is R.MALFORMED_SIGNATURE
    read = RequestHeaders(headers)
    assert read.conflicts == {"x-torpor-signature"} and not read.differing
    with pytest.raises(WebhookRejected) as refused:
        verify(Scheme.TORPOR, BODY, read, [SECRETS[Scheme.TORPOR]], now=NOW)
    assert refused.value.reason is R.MALFORMED_SIGNATURE


def test_standard_accepts_several_signatures_and_unknown_versions() -> None:
    headers = signed(Scheme.STANDARD)
    bogus = base64.b64encode(b"\0" * 32).decode()
    headers["webhook-signature"] = f"v1a,ed25519stuff  v1,{bogus} {headers['webhook-signature']}"
    verify(Scheme.STANDARD, BODY, headers, [SECRETS[Scheme.STANDARD]], now=NOW)


def test_standard_skips_an_entry_that_cannot_match_beside_one_that_does() -> None:
    """A v1 entry that is not base64 of 32 bytes refused the whole request, where the
    reference verifiers (which compare the encoded text) skip it and verify the rest.
    Alone it is still refused as malformed."""
    headers = signed(Scheme.STANDARD)
    good = headers["webhook-signature"]
    for junk in ("v1,not*base64", "v1," + "A" * 5, "v1," + base64.b64encode(b"x").decode()):
        headers["webhook-signature"] = f"{junk} {good}"
        verify(Scheme.STANDARD, BODY, headers, [SECRETS[Scheme.STANDARD]], now=NOW)
        headers["webhook-signature"] = junk
        with pytest.raises(WebhookRejected) as refused:
            verify(Scheme.STANDARD, BODY, headers, [SECRETS[Scheme.STANDARD]], now=NOW)
        assert refused.value.reason is R.MALFORMED_SIGNATURE


# --- interop with the reference Standard Webhooks library ------------------------------


def test_standardwebhooks_library_signs_we_verify() -> None:
    secret = generate_secret(Scheme.STANDARD)
    library = standardwebhooks.Webhook(secret)
    signature = library.sign("msg_interop", NOW, BODY.decode())
    headers = {
        "webhook-id": "msg_interop",
        "webhook-timestamp": str(int(NOW.timestamp())),
        "webhook-signature": signature,
    }
    result = verify(Scheme.STANDARD, BODY, headers, [secret], now=NOW)
    assert result.delivery_id == "msg_interop"
    assert result.signature == signature


def test_we_sign_standardwebhooks_library_verifies() -> None:
    secret = generate_secret(Scheme.STANDARD)
    # The library reads the wall clock with no way to inject one, so this is the one test
    # that signs at the real "now".
    headers = sign(Scheme.STANDARD, BODY, secret, now=datetime.now(UTC), msg_id="msg_ours")
    assert standardwebhooks.Webhook(secret).verify(BODY, headers) == {
        "id": "evt_1",
        "status": "approved",
        "correlationId": "c-42",
    }
    with pytest.raises(standardwebhooks.WebhookVerificationError):
        standardwebhooks.Webhook(secret).verify(BODY + b" ", headers)


def test_standard_secret_without_prefix_or_padding() -> None:
    raw = base64.b64encode(STANDARD_KEY).decode()
    headers = signed(Scheme.STANDARD)
    for secret in (raw, raw.rstrip("="), "whsec_" + raw.rstrip("=")):
        verify(Scheme.STANDARD, BODY, headers, [secret], now=NOW)


# --- secrets and configuration ---------------------------------------------------------


def test_generate_secret_shapes() -> None:
    standard = generate_secret(Scheme.STANDARD)
    assert standard.startswith("whsec_")
    assert len(base64.b64decode(standard.removeprefix("whsec_"))) == 32
    for scheme in (Scheme.TORPOR, Scheme.GITHUB, Scheme.STRIPE):
        assert re.fullmatch(r"[0-9a-f]{64}", generate_secret(scheme))
    assert generate_secret(Scheme.TORPOR) != generate_secret(Scheme.TORPOR)


@pytest.mark.parametrize("scheme", list(Scheme))
def test_secret_never_leaks_into_errors(scheme: Scheme) -> None:
    headers = signed(scheme)
    secret = OTHER_SECRETS[scheme]
    expected = sign(scheme, BODY, secret, now=NOW, nonce=NONCE)
    error = rejected(scheme, headers, secrets=[secret])
    texts = [str(error), repr(error), error.public_detail, repr(error.context), repr(error.args)]
    for text in texts:
        assert secret not in text
        for value in expected.values():
            if value != NONCE:
                assert value not in text


def test_bad_configured_secrets_are_config_errors_without_the_value() -> None:
    headers = signed(Scheme.STANDARD)
    with pytest.raises(WebhookSecretInvalid) as info:
        verify(Scheme.STANDARD, BODY, headers, ["whsec_not*base64!"], now=NOW)
    assert "not*base64" not in str(info.value)
    assert "#0" in str(info.value)
    with pytest.raises(WebhookSecretInvalid, match="empty"):
        verify(Scheme.TORPOR, BODY, signed(Scheme.TORPOR), ["ok-secret", ""], now=NOW)
    with pytest.raises(WebhookSecretInvalid, match="empty"):
        verify(Scheme.STANDARD, BODY, headers, ["whsec_"], now=NOW)
    with pytest.raises(WebhookSecretInvalid, match="no webhook secret"):
        verify(Scheme.GITHUB, BODY, signed(Scheme.GITHUB), [], now=NOW)


def test_programming_errors_are_loud() -> None:
    with pytest.raises(TypeError, match="one string"):
        verify(Scheme.TORPOR, BODY, signed(Scheme.TORPOR), SECRETS[Scheme.TORPOR], now=NOW)
    with pytest.raises(ValueError, match="timezone-aware"):
        verify(Scheme.TORPOR, BODY, {}, ["s"], now=datetime(2026, 1, 1))
    with pytest.raises(ValueError, match="timezone-aware"):
        sign(Scheme.TORPOR, BODY, "s", now=datetime(2026, 1, 1))
    with pytest.raises(ValueError, match="nope"):
        verify("nope", BODY, {}, ["s"], now=NOW)  # type: ignore[arg-type]


def test_scheme_accepts_its_string_value() -> None:
    headers = sign("github", BODY, "s", now=NOW)  # type: ignore[arg-type]
    assert verify("github", BODY, headers, ["s"], now=NOW).scheme is Scheme.GITHUB  # type: ignore[arg-type]


# --- the rejection type itself ---------------------------------------------------------


def test_reason_status_map_matches_the_contract() -> None:
    expected = {
        R.MISSING_SIGNATURE: 401,
        R.MALFORMED_SIGNATURE: 401,
        R.BAD_SIGNATURE: 401,
        R.MISSING_TIMESTAMP: 401,
        R.MALFORMED_TIMESTAMP: 401,
        R.TIMESTAMP_TOO_OLD: 401,
        R.TIMESTAMP_IN_FUTURE: 401,
        R.MISSING_NONCE: 401,
        R.MALFORMED_NONCE: 401,
        R.INVALID_TOKEN: 401,
        R.REPLAYED: 409,
        R.TOKEN_USED: 409,
        R.BODY_TOO_LARGE: 413,
        R.UNSUPPORTED_MEDIA_TYPE: 415,
        R.MALFORMED_BODY: 400,
        R.INVALID_CLOUDEVENT: 400,
        R.UNKNOWN_SOURCE: 404,
        R.TOKEN_EXPIRED: 410,
    }
    assert expected == STATUS
    for reason in RejectReason:
        error = WebhookRejected(reason)
        assert error.status == expected[reason]
        assert error.public_detail
        assert reason.value in str(error)


def test_rejection_is_a_permanent_torpor_error_and_pickles() -> None:
    error = WebhookRejected(R.REPLAYED, "seen it", delivery_id="abc")
    assert isinstance(error, PermanentError)
    assert error.code == "webhook_rejected"
    assert error.retryable is False
    clone = pickle.loads(pickle.dumps(error))
    assert (clone.reason, clone.status, clone.public_detail) == (R.REPLAYED, 409, "seen it")
    assert clone.context == {"delivery_id": "abc"}
    assert WebhookRejected("replayed").reason is R.REPLAYED  # type: ignore[arg-type]


def test_ensure_body_size() -> None:
    ensure_body_size(10, limit=10)
    with pytest.raises(WebhookRejected) as info:
        ensure_body_size(11, limit=10)
    assert (info.value.reason, info.value.status) == (R.BODY_TOO_LARGE, 413)


# --- fuzzing: nothing but WebhookRejected escapes --------------------------------------

HEADER_NAMES = sorted(
    {name for scheme in Scheme for name in signed(scheme)}
    | {name.lower() for scheme in Scheme for name in signed(scheme)}
)
header_values = st.one_of(
    st.text(max_size=80),
    st.text(alphabet="0123456789abcdefv1t=, .-_", max_size=120),
    st.sampled_from(["", " ", "v1,", "t=", "sha256=", "=", ",", "%", "\x00", "\ud800"]),
)


@settings(max_examples=300, deadline=None)
@given(
    scheme=st.sampled_from(list(Scheme)),
    body=st.binary(max_size=64),
    headers=st.dictionaries(
        st.one_of(st.sampled_from(HEADER_NAMES), st.text(max_size=20)), header_values, max_size=6
    ),
)
def test_verify_only_ever_raises_rejections(
    scheme: Scheme, body: bytes, headers: dict[str, str]
) -> None:
    try:
        verify(scheme, body, headers, [SECRETS[scheme], OTHER_SECRETS[scheme]], now=NOW)
    except WebhookRejected as error:
        assert error.status in {401, 409}


@settings(max_examples=300, deadline=None)
@given(
    scheme=st.sampled_from(list(Scheme)),
    victim=st.integers(min_value=0, max_value=2),
    value=header_values,
)
def test_mutating_one_valid_header_only_raises_rejections(
    scheme: Scheme, victim: int, value: str
) -> None:
    headers = signed(scheme)
    name = sorted(headers)[victim % len(headers)]
    headers[name] = value
    with contextlib.suppress(WebhookRejected):
        verify(scheme, BODY, headers, [SECRETS[scheme]], now=NOW)


@pytest.mark.parametrize("tolerance_s", [math.nan, math.inf, -1.0])
def test_a_window_that_cannot_be_checked_is_a_programming_error(tolerance_s: float) -> None:
    """NaN compares false both ways: a day-old delivery verified as if it had no window."""
    headers = signed(Scheme.TORPOR, now=NOW - timedelta(days=1))
    with pytest.raises(ValueError, match="tolerance_s"):
        verify(
            Scheme.TORPOR, BODY, headers, [SECRETS[Scheme.TORPOR]], now=NOW, tolerance_s=tolerance_s
        )


def test_torpor_and_stripe_sign_the_same_bytes_so_one_secret_verifies_for_both() -> None:
    # Why settings refuse two sources of one signed shape sharing a secret: a delivery
    # to one, its signature moved into the other's header, verifies there.
    secret = SECRETS[Scheme.TORPOR]
    torpor = sign(Scheme.TORPOR, BODY, secret, now=NOW)
    moved = {
        "Stripe-Signature": f"t={torpor['X-Torpor-Timestamp']},v1={torpor['X-Torpor-Signature']}"
    }
    assert verify(Scheme.STRIPE, BODY, moved, [secret], now=NOW).scheme is Scheme.STRIPE
    assert signed_shape(Scheme.TORPOR) == signed_shape(Scheme.STRIPE)
    assert len({signed_shape(s) for s in Scheme}) == 3
