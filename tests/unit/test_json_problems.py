"""A webhook's JSON is refused for what it holds, however it got there: a lone surrogate
(escaped, in a value or a member name), nesting past the bound, a number out of range;
and the walk that looks for them is skipped for text that cannot hold one."""

from __future__ import annotations

import json

import pytest

from torpor.errors import RejectReason, WebhookRejected
from torpor.webhooks import payloads
from torpor.webhooks.payloads import loads_json

DEPTH = 64  # payloads._MAX_JSON_DEPTH


def nested(levels: int, *, leaf: str = "1") -> bytes:
    """``levels`` of objects and arrays, alternating, around ``leaf``."""
    text = leaf
    for i in range(levels):
        text = f'{{"k": {text}}}' if i % 2 else f"[{text}]"
    return text.encode()


def refused(raw: bytes) -> str:
    with pytest.raises(WebhookRejected) as caught:
        loads_json(raw)
    assert caught.value.reason is RejectReason.MALFORMED_BODY
    return str(caught.value)


@pytest.mark.parametrize(
    "raw",
    [
        rb'{"a": "\ud800"}',
        rb'{"a": "x \uDBFF y"}',
        rb'{"\udc00": 1}',
        rb'{"a": ["ok", {"b": "\uDFFF"}]}',
        rb'["\ud83d"]',
    ],
)
def test_a_lone_surrogate_is_refused(raw: bytes) -> None:
    assert "surrogate" in refused(raw)


@pytest.mark.parametrize(
    "raw",
    [rb'{"a": "\ud83d\ude00"}', rb'{"a": "\\ud800"}', rb'{"a": "\ue000 \u00e9"}'],
)
def test_a_pair_an_escaped_backslash_or_another_escape_is_taken(raw: bytes) -> None:
    assert loads_json(raw) == json.loads(raw)


def test_nesting_past_the_bound_is_refused_and_up_to_it_taken() -> None:
    assert "nested too deeply" in refused(nested(DEPTH + 1))
    assert loads_json(nested(DEPTH)) == json.loads(nested(DEPTH))


@pytest.mark.parametrize("number", ["1e400", "-1E+400", "9" * 400 + ".0"])
def test_a_number_out_of_range_is_refused_at_any_depth(number: str) -> None:
    assert "out of range" in refused(nested(3, leaf=number))
    assert "out of range" in refused(nested(DEPTH, leaf=number))


def test_text_that_cannot_hold_a_problem_is_not_walked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fewer opening brackets than the bound and no escaped surrogate: nothing to look
    for in the parsed tree (the walk was ~300 interpreted instructions a webhook)."""

    def walked(value: object) -> str | None:
        raise AssertionError("the tree was walked")

    monkeypatch.setattr(payloads, "_tree_problem", walked)
    body = {
        "eventId": "evt-1",
        "eventType": "oa.approval.decided",
        "correlationId": "c" * 22,
        "decision": {"status": "approved", "amount": 18250.5, "note": "é \\u00e9 [x]"},
    }
    assert loads_json(json.dumps(body).encode()) == body
