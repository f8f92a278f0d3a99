"""A number JSON cannot hold (NaN, Infinity, or one past a 64-bit float's range) is
refused at the edge, never stored: each used to become null in the stored session input
or inbox event, a value the client never sent (or signed)."""

from __future__ import annotations

import pytest

from torpor.api import SessionCreate
from torpor.entry.http import parse_json_body
from torpor.errors import InvalidRequest, WebhookRejected
from torpor.webhooks.payloads import loads_json

OUT_OF_RANGE = ["1e400", "-1e400", "1E+400", "0.5e0309", "9" * 400 + ".0", "1" + "0" * 298 + "e11"]
LITERALS = ["NaN", "Infinity", "-Infinity"]


def session_body(number: str) -> bytes:
    return b'{"agent": "purchase", "input": {"amount": ' + number.encode() + b"}}"


@pytest.mark.parametrize("number", OUT_OF_RANGE + LITERALS)
def test_an_api_body_with_a_number_json_cannot_hold_is_refused(number: str) -> None:
    with pytest.raises(InvalidRequest, match="NaN, infinite or out of range"):
        parse_json_body(session_body(number), SessionCreate)


@pytest.mark.parametrize("number", ["1e300", "-1.5e-400", "12345678901234567890", "0.1"])
def test_an_api_body_with_large_or_tiny_finite_numbers_is_taken(number: str) -> None:
    body = parse_json_body(session_body(number), SessionCreate)
    assert body.input["amount"] == float(number) or body.input["amount"] == int(number)


def test_the_words_inside_strings_are_only_words() -> None:
    raw = b'{"agent": "a", "input": {"note": "NaN Infinity 1e400 ' + b"9" * 400 + b'"}}'
    assert parse_json_body(raw, SessionCreate).input["note"].startswith("NaN Infinity")


@pytest.mark.parametrize("number", OUT_OF_RANGE)
def test_a_webhook_body_with_a_number_out_of_range_is_malformed(number: str) -> None:
    with pytest.raises(WebhookRejected):
        loads_json(b'{"eventId": "e1", "amount": ' + number.encode() + b"}")
