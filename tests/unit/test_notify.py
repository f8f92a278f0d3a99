"""Outbound notifications, the pure part: payload, per-endpoint secret, Retry-After."""

from __future__ import annotations

import base64
from datetime import timedelta

from standardwebhooks.webhooks import Webhook

from tests.support.factories import NOW, snapshot
from torpor import notify
from torpor.lifecycle import SessionState
from torpor.models import ErrorInfo
from torpor.outbound import retry_after_s

KEY = b"k" * 32
URL = "https://hooks.example.com/torpor"
CAP = notify.MAX_RETRY_AFTER_S


def test_the_payload_describes_the_session_as_it_ended() -> None:
    snap = snapshot(state=SessionState.FAILED).model_copy(
        update={
            "epoch": 3,
            "error": ErrorInfo(code="guard_blocked", message="budget moved"),
            "batch_id": "b-1",
            "metadata": {"ticket": "T-7"},
        }
    )
    body = notify.payload(snap, event="FAILED", now=NOW + timedelta(hours=8))
    assert body == {
        "type": "session.failed",
        "timestamp": "2026-11-29T20:00:00+00:00",
        "data": {
            "session_id": snap.session_id,
            "tenant": "acme",
            "state": "FAILED",
            "epoch": 3,
            "result": None,
            "error": {"code": "guard_blocked", "message": "budget moved", "detail": {}},
            "batch_id": "b-1",
            "metadata": {"ticket": "T-7"},
        },
    }


def test_the_payload_carries_the_result_of_a_completed_session() -> None:
    snap = snapshot(state=SessionState.COMPLETED).model_copy(update={"result": {"ok": 1}})
    data = notify.payload(snap, event="COMPLETED", now=NOW)["data"]
    assert data["result"] == {"ok": 1} and data["error"] is None


def test_event_types_are_namespaced_and_lower_case() -> None:
    assert notify.event_type("COMPLETED") == "session.completed"
    assert notify.event_type("suspended") == "session.suspended"


def test_the_endpoint_secret_is_stable_for_one_tenant_and_url() -> None:
    # Tenants fetch this secret once and keep it: its derivation may never change.
    secret = notify.endpoint_secret(KEY, "acme", URL)
    assert secret == "whsec_yVv5Sop6tU2pTr7toQnRZAQn7+7mxB1tOlF2QCKpNJg="
    assert len(base64.b64decode(secret.removeprefix("whsec_"))) == 32


def test_each_tenant_url_and_key_gets_its_own_secret() -> None:
    secrets = {
        notify.endpoint_secret(KEY, "acme", URL),
        notify.endpoint_secret(KEY, "globex", URL),
        notify.endpoint_secret(KEY, "acme", URL + "/other"),
        notify.endpoint_secret(b"j" * 32, "acme", URL),
        # the separator keeps ("ab", "c") and ("a", "bc") apart
        notify.endpoint_secret(KEY, "acme" + URL[:1], URL[1:]),
    }
    assert len(secrets) == 5


def test_the_secret_is_one_a_standard_webhooks_library_signs_with() -> None:
    body = '{"type":"session.completed"}'
    acme = Webhook(notify.endpoint_secret(KEY, "acme", URL)).sign("msg_1", NOW, body)
    globex = Webhook(notify.endpoint_secret(KEY, "globex", URL)).sign("msg_1", NOW, body)
    assert acme.startswith("v1,") and acme != globex


def test_retry_after_in_seconds() -> None:
    assert retry_after_s("120", now=NOW, cap_s=CAP) == 120.0
    assert retry_after_s(" 7 ", now=NOW, cap_s=CAP) == 7.0


def test_retry_after_is_capped_at_a_day() -> None:
    assert retry_after_s("999999", now=NOW, cap_s=CAP) == CAP
    far = "Tue, 29 Dec 2026 12:00:00 GMT"
    assert retry_after_s(far, now=NOW, cap_s=CAP) == CAP


def test_retry_after_as_an_http_date_counts_from_now() -> None:
    assert retry_after_s("Sun, 29 Nov 2026 12:00:30 GMT", now=NOW, cap_s=CAP) == 30.0
    # a date without a zone is read as UTC
    assert retry_after_s("Sun, 29 Nov 2026 12:01:00 -0000", now=NOW, cap_s=CAP) == 60.0


def test_retry_after_in_the_past_means_now() -> None:
    assert retry_after_s("Sun, 29 Nov 2026 11:00:00 GMT", now=NOW, cap_s=CAP) == 0.0


def test_a_missing_or_malformed_retry_after_is_ignored() -> None:
    for value in (None, "", "soon", "-5", "1.5", "Sun, 99 Nov 2026 12:00:00 GMT"):
        assert retry_after_s(value, now=NOW, cap_s=CAP) is None, value
