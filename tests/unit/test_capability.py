"""Capability callback tokens: round trip, tampering, expiry, rotation, garbage."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from torpor.errors import WebhookSecretInvalid
from torpor.webhooks import CapabilityClaims, RejectReason, WebhookRejected, mint, open_token

R = RejectReason
NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
EXPIRES = NOW + timedelta(hours=24)
KEY = b"k" * 32
OLD_KEY = b"o" * 32
ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
CLAIMS: dict[str, Any] = {
    "tenant": "acme-corp",
    "session_id": "01JGZ8Q4WQ7X9N3V5K2M6P8R0T",
    "wait_id": "wait-approval-po-77",
    "correlation_id": "c5f0d3b2-6a1e-4c1b-9f1d-3e2a7b8c9d0e",
    "epoch": 3,
}


def token(key: bytes = KEY, expires_at: datetime = EXPIRES, **overrides: Any) -> str:
    return mint(key=key, expires_at=expires_at, **{**CLAIMS, **overrides})


def rejected(value: str, *, keys: list[bytes] | None = None, now: datetime = NOW) -> RejectReason:
    with pytest.raises(WebhookRejected) as info:
        open_token(value, keys=keys or [KEY], now=now)
    return info.value.reason


def test_round_trip() -> None:
    claims = open_token(token(), keys=[KEY], now=NOW)
    assert claims.model_dump(exclude={"token_id"}) == {**CLAIMS, "expires_at": EXPIRES}
    assert re.fullmatch(r"[0-9a-f]{32}", claims.token_id)


def test_format() -> None:
    value = token()
    assert re.fullmatch(r"v1\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]{43}", value)
    payload = value.split(".")[1]
    document = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    assert document["t"] == "acme-corp"
    assert " " not in base64.urlsafe_b64decode(payload + "==").decode()


def test_tokens_fit_in_a_url_for_typical_ids() -> None:
    value = token(
        tenant="tenant-" + uuid.uuid4().hex[:12],
        session_id=str(uuid.uuid4()),
        wait_id=str(uuid.uuid4()),
        correlation_id=str(uuid.uuid4()),
        epoch=2**31,
    )
    assert len(value) <= 400


def test_token_id_is_deterministic_and_not_the_mac() -> None:
    value = token()
    first = open_token(value, keys=[KEY], now=NOW)
    again = open_token(value, keys=[KEY], now=NOW + timedelta(hours=1))
    assert first.token_id == again.token_id
    assert first.token_id not in value
    other = open_token(token(wait_id="another-wait"), keys=[KEY], now=NOW)
    assert other.token_id != first.token_id


def test_expires_at_is_kept_to_the_second() -> None:
    claims = open_token(
        token(expires_at=EXPIRES + timedelta(microseconds=999_999)), keys=[KEY], now=NOW
    )
    assert claims.expires_at == EXPIRES


def test_claims_are_frozen() -> None:
    claims = open_token(token(), keys=[KEY], now=NOW)
    with pytest.raises(ValidationError):
        claims.epoch = 4  # type: ignore[misc]
    assert isinstance(claims, CapabilityClaims)


# --- expiry ----------------------------------------------------------------------------


def test_expiry_boundary() -> None:
    open_token(token(), keys=[KEY], now=EXPIRES - timedelta(seconds=1))
    assert rejected(token(), now=EXPIRES) is R.TOKEN_EXPIRED
    assert rejected(token(), now=EXPIRES + timedelta(days=30)) is R.TOKEN_EXPIRED


def test_expired_status_is_410() -> None:
    with pytest.raises(WebhookRejected) as info:
        open_token(token(), keys=[KEY], now=EXPIRES)
    assert info.value.status == 410


def test_expired_token_under_a_wrong_key_is_just_invalid() -> None:
    assert rejected(token(), keys=[OLD_KEY], now=EXPIRES + timedelta(days=1)) is R.INVALID_TOKEN


# --- keys and rotation -----------------------------------------------------------------


def test_wrong_key() -> None:
    assert rejected(token(), keys=[OLD_KEY]) is R.INVALID_TOKEN


def test_rotation() -> None:
    minted_before = token(key=OLD_KEY)
    minted_after = token(key=KEY)
    for value in (minted_before, minted_after):
        open_token(value, keys=[KEY, OLD_KEY], now=NOW)
        open_token(value, keys=[OLD_KEY, KEY], now=NOW)
    assert rejected(minted_before, keys=[KEY]) is R.INVALID_TOKEN


def test_key_configuration_errors() -> None:
    with pytest.raises(WebhookSecretInvalid, match="at least 16 bytes"):
        token(key=b"short")
    with pytest.raises(WebhookSecretInvalid, match="#1"):
        open_token(token(), keys=[KEY, b""], now=NOW)
    with pytest.raises(WebhookSecretInvalid, match="no capability key"):
        open_token(token(), keys=[], now=NOW)
    with pytest.raises(TypeError):
        open_token(token(), keys=KEY, now=NOW)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timezone-aware"):
        open_token(token(), keys=[KEY], now=datetime(2026, 1, 1))
    with pytest.raises(ValueError, match="timezone-aware"):
        token(expires_at=datetime(2026, 1, 2))


@pytest.mark.parametrize(
    "overrides",
    [{"tenant": ""}, {"session_id": "x" * 300}, {"epoch": -1}, {"epoch": True}],
)
def test_mint_validates_claims(overrides: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        token(**overrides)


def test_errors_never_show_the_key_or_mac() -> None:
    value = token()
    with pytest.raises(WebhookRejected) as info:
        open_token(value[:-2] + "AA", keys=[KEY], now=NOW)
    for text in (str(info.value), repr(info.value), info.value.public_detail):
        assert KEY.decode() not in text
        assert value.split(".")[2] not in text


# --- tampering and garbage -------------------------------------------------------------


def swap_claims(value: str, **changes: Any) -> str:
    version, payload, tag = value.split(".")
    document = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    document.update(changes)
    forged = base64.urlsafe_b64encode(json.dumps(document).encode()).rstrip(b"=").decode()
    return f"{version}.{forged}.{tag}"


@pytest.mark.parametrize(
    "changes", [{"s": "someone-elses-session"}, {"x": 4_102_444_800}, {"e": 4}, {"t": "other"}]
)
def test_tampered_claims(changes: dict[str, Any]) -> None:
    assert rejected(swap_claims(token(), **changes)) is R.INVALID_TOKEN


def test_every_single_character_change_is_rejected() -> None:
    value = token()
    for index, char in enumerate(value):
        replacement = "A" if char != "A" else "B"
        mutated = value[:index] + replacement + value[index + 1 :]
        with pytest.raises(WebhookRejected) as info:
            open_token(mutated, keys=[KEY], now=NOW)
        assert info.value.reason is R.INVALID_TOKEN


def test_mixing_parts_of_two_tokens() -> None:
    first, second = token(), token(wait_id="other")
    _, payload_1, tag_1 = first.split(".")
    _, payload_2, tag_2 = second.split(".")
    assert rejected(f"v1.{payload_1}.{tag_2}") is R.INVALID_TOKEN
    assert rejected(f"v1.{payload_2}.{tag_1}") is R.INVALID_TOKEN


def test_non_canonical_base64_spelling_is_rejected() -> None:
    # The 43rd character of a 32-byte tag carries two spare bits: flipping them yields a
    # different string for the same MAC, which must not count as a different token.
    value = token()
    last = value[-1]
    twin = ALPHABET[ALPHABET.index(last) ^ 1]
    alias = value[:-1] + twin
    tag = alias.split(".")[2]
    assert base64.urlsafe_b64decode(tag + "=") == base64.urlsafe_b64decode(
        value.split(".")[2] + "="
    )
    assert rejected(alias) is R.INVALID_TOKEN


@pytest.mark.parametrize(
    "garbage",
    [
        "",
        " ",
        "v1",
        "v1.",
        "v1..",
        "v2.abc.def",
        "v1.abc.def.ghi",
        "....",
        "v1.%%%.$$$",
        "v1.YWJj.YWJj",
        "v1.ÿÿÿ.ÿÿÿ",
        "v1." + "A" * 5000 + ".AAAA",
        "v1.e30." + "A" * 43,
        "Bearer v1.x.y",
        "v1.abc=.def==",
    ],
)
def test_garbage(garbage: str) -> None:
    assert rejected(garbage) is R.INVALID_TOKEN


def test_authentic_but_unparseable_claims_are_invalid() -> None:
    # Someone holding the key minted a document of the wrong shape: still never a crash.
    for document in (
        b"not json",
        b"[]",
        b'{"t":"a"}',
        b'{"t":"a","s":"b","w":"c","c":"d","e":1,"x":1e400}',
    ):
        payload = base64.urlsafe_b64encode(document).rstrip(b"=").decode()
        mac = hmac.new(KEY, f"v1.{payload}".encode(), hashlib.sha256).digest()
        forged = f"v1.{payload}." + base64.urlsafe_b64encode(mac).rstrip(b"=").decode()
        assert rejected(forged) is R.INVALID_TOKEN


@settings(max_examples=400, deadline=None)
@given(st.text(max_size=120) | st.from_regex(r"v1\.[A-Za-z0-9_-]{0,60}\.[A-Za-z0-9_-]{0,50}"))
def test_open_token_on_arbitrary_text_only_raises_rejections(value: str) -> None:
    with pytest.raises(WebhookRejected) as info:
        open_token(value, keys=[KEY, OLD_KEY], now=NOW)
    assert info.value.reason is R.INVALID_TOKEN


@settings(max_examples=200, deadline=None)
@given(index=st.integers(min_value=0), char=st.characters())
def test_random_mutations_never_open(index: int, char: str) -> None:
    value = token()
    index %= len(value)
    mutated = value[:index] + char + value[index + 1 :]
    if mutated == value:
        return
    with pytest.raises(WebhookRejected):
        open_token(mutated, keys=[KEY], now=NOW)
