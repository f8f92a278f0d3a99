"""Errors carry their HTTP answer; ``problem_for`` reads it in one place."""

from __future__ import annotations

import pickle

import pytest

from torpor import errors as e
from torpor.problems import problem_for

# The answers the HTTP API has always given: (status, title, detail is the message).
ANSWERS: dict[type[e.TorporError], tuple[int, str, bool]] = {
    e.Unauthenticated: (401, "Unauthenticated", True),
    e.SessionNotFound: (404, "Not found", True),
    e.NotFound: (404, "Not found", True),
    e.UnknownCorrelation: (404, "No matching wait", True),
    e.UnknownAgent: (422, "Unknown agent", True),
    e.InvalidRequest: (400, "Invalid request", True),
    e.InvalidKey: (400, "Invalid identifier", False),
    e.UnsafeUrl: (400, "Callback URL refused", True),
    e.IdempotencyMismatch: (422, "Idempotency-Key reused with a different request", True),
    e.IdempotencyInProgress: (409, "Request with this Idempotency-Key in progress", True),
    e.CommitConflict: (409, "Conflict", False),
}
UNAVAILABLE = {
    e.StorageUnavailable: "Storage unavailable",
    e.IndexUnavailable: "Index unavailable",
    e.ActivationUnavailable: "Activation unavailable",
}


@pytest.mark.parametrize("cls", list(ANSWERS))
def test_client_errors_answer_their_status_title_and_detail(cls: type[e.TorporError]) -> None:
    status, title, public = ANSWERS[cls]
    spec = problem_for(cls("the message"))
    assert (spec.status, spec.code, spec.title) == (status, cls.code, title)
    assert spec.detail == ("the message" if public else None)
    assert spec.retry_after is None


@pytest.mark.parametrize("cls", list(UNAVAILABLE))
def test_unavailable_is_503_with_retry_after(cls: type[e.TorporError]) -> None:
    spec = problem_for(cls("redis is down at 10.0.0.7"))
    assert (spec.status, spec.code, spec.title) == (503, cls.code, UNAVAILABLE[cls])
    assert spec.detail == "try again shortly" and spec.retry_after == 5
    assert problem_for(cls("x", retry_after=12.5)).retry_after == 13


@pytest.mark.parametrize(
    "exc",
    [
        e.SnapshotCorrupt("bad bytes in s_1"),
        e.ConfigError("secret"),
        e.AgentError("x"),
        e.ObjectExists("k"),
        e.RetryableError("x"),
        ValueError("boom"),
    ],
)
def test_everything_else_is_an_internal_error_that_says_nothing(exc: Exception) -> None:
    spec = problem_for(exc)
    assert (spec.status, spec.code, spec.title, spec.detail) == (
        500,
        "internal",
        "Internal error",
        None,
    )


def test_a_webhook_rejection_answers_with_its_reason() -> None:
    spec = problem_for(e.WebhookRejected(e.RejectReason.TIMESTAMP_TOO_OLD))
    assert (spec.status, spec.code, spec.title) == (401, "timestamp_too_old", "Timestamp too old")
    assert spec.detail == "the timestamp is outside the accepted window"
    replayed = problem_for(e.WebhookRejected(e.RejectReason.REPLAYED, "seen before"))
    assert (replayed.status, replayed.detail) == (409, "seen before")


def test_retryable_is_a_class_default_an_instance_may_override() -> None:
    assert e.StorageUnavailable("x").retryable and not e.ToolError("x").retryable
    assert e.ToolError("x", retryable=True).retryable
    assert not e.StorageUnavailable("x", retryable=False).retryable
    assert e.AgentUnavailable("x").retry_after is None
    assert e.AgentUnavailable("x", retry_after=30).retry_after == 30
    assert e.StorageUnavailable.retryable, "the class default is untouched"


def test_instance_overrides_survive_pickling() -> None:
    # Errors cross Ray process boundaries.
    exc = pickle.loads(pickle.dumps(e.ToolError("x", retryable=True, retry_after=3, step=2)))
    assert exc.retryable and exc.retry_after == 3 and exc.context == {"step": 2}
    rejected = pickle.loads(pickle.dumps(e.WebhookRejected(e.RejectReason.TOKEN_USED)))
    assert rejected.status == 409 and rejected.reason is e.RejectReason.TOKEN_USED


def test_not_found_and_session_not_found_are_distinct() -> None:
    assert issubclass(e.SessionNotFound, e.NotFound)
    assert e.NotFound.code == "not_found" and e.SessionNotFound.code == "session_not_found"
