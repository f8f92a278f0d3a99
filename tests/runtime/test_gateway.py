"""The webhook gateway in one process: every outcome reaches the observer and the audit."""

from __future__ import annotations

import asyncio
import hashlib
import json
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from starlette.datastructures import Headers
from starlette.requests import Request

from storage import keys
from storage.audit import ObjectAudit
from storage.codec import SnapshotCodec
from tests.storage.test_history_chunks import age
from tests.support.harness import keys_read, local_env
from torpor.entry.http import read_audited_body
from torpor.errors import (
    RejectReason,
    SessionNotFound,
    StorageUnavailable,
    UnknownCorrelation,
    WebhookRejected,
    WebhookSecretInvalid,
)
from torpor.ids import event_key
from torpor.lifecycle import SessionState
from torpor.ports import Observer
from torpor.problems import problem_for
from torpor.service.gateway import WebhookGateway
from torpor.session.runtime import lease_name
from torpor.webhooks.signing import Scheme, generate_secret, sign

SECRET = generate_secret(Scheme.TORPOR)
JSON = "application/json"
SOURCES = {
    "oa": {
        "tenant": "acme",
        "scheme": "torpor",
        "secrets": [SECRET],
        "mapping": {
            "event_id_path": "eventId",
            "type_path": "eventType",
            "correlation_id_path": "correlationId",
            "status_path": "decision.status",
            "data_path": "decision",
        },
    }
}


class Handled(Observer):
    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str]] = []

    async def webhook_handled(self, source: str, outcome: str, reason: str = "") -> None:
        self.seen.append((source, outcome, reason))


def signed(raw: bytes, at: datetime) -> dict[str, str]:
    """The headers of ``raw`` signed for source ``oa`` at ``at``, as JSON."""
    return {**sign(Scheme.TORPOR, raw, SECRET, now=at), "Content-Type": JSON}


def ce_source() -> tuple[str, dict[str, object]]:
    """A secret, and this module's sources with a CloudEvents source ``ce`` signed by it."""
    secret = generate_secret(Scheme.STANDARD)
    return secret, {
        **SOURCES,
        "ce": {"tenant": "acme", "scheme": "standard", "secrets": [secret]},
    }


def ce_batch(raw: bytes, secret: str, at: datetime) -> dict[str, str]:
    """The headers of a CloudEvents batch ``raw`` signed for source ``ce`` at ``at``."""
    return {
        **sign(Scheme.STANDARD, raw, secret, now=at),
        "Content-Type": "application/cloudevents-batch+json",
    }


async def cancelled_under(*args: object, **fields: object) -> None:
    """A store's call cancelled under its caller (the store closing), the caller not."""
    raise asyncio.CancelledError


def body(correlation_id: str, event_id: str) -> bytes:
    return json.dumps(
        {
            "eventId": event_id,
            "eventType": "oa.approval.decided",
            "correlationId": correlation_id,
            "decision": {"status": "approved"},
        }
    ).encode()


async def test_outcomes_are_observed_and_audited(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    async with local_env(tmp_path, redis_url, redis_prefix, extra={"sources": SOURCES}) as env:
        observer = Handled()
        env.services.observer = observer
        gateway = WebhookGateway(env.control)
        sid = await env.submit()
        wait = (await env.load(sid)).waits[0]
        now = env.clock.now()

        async def post(raw: bytes, *, later_s: int = 0) -> int:
            at = now + timedelta(seconds=later_s)  # a retry is signed afresh
            headers = signed(raw, at)
            return (await gateway.receive("oa", raw, headers, now=now)).status

        assert await post(body(wait.correlation_id, "e1")) == 202
        assert (await env.load(sid)).state is SessionState.COMPLETED
        assert await post(body(wait.correlation_id, "e1"), later_s=1) == 200  # a retry
        with pytest.raises(UnknownCorrelation):
            await post(body("Q" * 22, "e2"))
        with pytest.raises(WebhookRejected):
            bad = body(wait.correlation_id, "e3")
            await gateway.receive("oa", bad, {"Content-Type": JSON}, now=now)

        assert observer.seen == [
            ("oa", "accepted", ""),
            ("oa", "duplicate", ""),
            ("oa", "unknown", ""),
            ("oa", "rejected", "missing_signature"),
        ]
        await env.services.audit.close()
        checks = await ObjectAudit(env.services.store).verify_all()
        assert [c.records for c in checks.values()] == [4] and all(c.ok for c in checks.values())


@pytest.mark.parametrize("cancelled", ["audit record", "replay marker"])
async def test_a_durable_write_cancelled_on_its_own_is_a_503_the_sender_may_send_again(
    tmp_path: Path,
    redis_url: str,
    redis_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    cancelled: str,
) -> None:
    """A durable write of the request cancelled under it (its store's call cancelled as
    the store closes), the request itself not cancelled: a typed 503, counted as an
    error, and the sender's retry let through. Before, the write's own
    ``CancelledError`` was raised from the gateway and passed every handler as a cancel
    of the request: no answer, nothing counted."""
    async with local_env(tmp_path, redis_url, redis_prefix, extra={"sources": SOURCES}) as env:
        observer = Handled()
        env.services.observer = observer
        gateway = WebhookGateway(env.control)
        sid = await env.submit()
        wait = (await env.load(sid)).waits[0]
        now = env.clock.now()
        raw = body(wait.correlation_id, "e1")

        with monkeypatch.context() as patched:
            if cancelled == "audit record":
                patched.setattr(env.services.audit, "append", cancelled_under)
            else:
                patched.setattr(gateway.replays, "remember", cancelled_under)
            headers = signed(raw, now)
            with pytest.raises(StorageUnavailable) as refused:
                await gateway.receive("oa", raw, headers, now=now)
        assert problem_for(refused.value).status == 503
        # Counted once, as the error answered: stored, but not durably acknowledged.
        assert observer.seen == [("oa", "error", "StorageUnavailable")]

        later = now + timedelta(seconds=1)  # the sender's retry, signed afresh
        headers = signed(raw, later)
        retried = await gateway.receive("oa", raw, headers, now=later)
        assert retried.status in (200, 202)
        assert (await env.load(sid)).state is SessionState.COMPLETED


async def test_a_refusal_whose_audit_write_is_cancelled_under_it_is_still_the_refusal(
    tmp_path: Path, redis_url: str, redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unsigned request, its audit record's write cancelled under it (the request not
    cancelled): still the 401 it was, not a cancel that answers nothing."""
    async with local_env(tmp_path, redis_url, redis_prefix, extra={"sources": SOURCES}) as env:
        gateway = WebhookGateway(env.control)

        monkeypatch.setattr(env.services.audit, "append", cancelled_under)
        raw = body("Q" * 22, "e1")
        with pytest.raises(WebhookRejected) as refused:
            await gateway.receive("oa", raw, {"Content-Type": JSON}, now=env.clock.now())
        assert refused.value.reason is RejectReason.MISSING_SIGNATURE


async def test_the_requests_own_cancel_stays_a_cancel(
    tmp_path: Path, redis_url: str, redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sender gone while the replay marker is written (the event stored, its wake
    armed, its audit record on the way): the request is cancelled, and the gateway raises
    the cancel, not a 503 nobody is left to read."""
    async with local_env(tmp_path, redis_url, redis_prefix, extra={"sources": SOURCES}) as env:
        observer = Handled()
        env.services.observer = observer
        gateway = WebhookGateway(env.control)
        sid = await env.submit()
        wait = (await env.load(sid)).waits[0]
        now = env.clock.now()
        raw = body(wait.correlation_id, "e1")
        reached, never = asyncio.Event(), asyncio.Event()

        async def held(*args: object, **fields: object) -> None:
            reached.set()
            await never.wait()

        monkeypatch.setattr(gateway.replays, "remember", held)
        headers = signed(raw, now)
        request = asyncio.create_task(gateway.receive("oa", raw, headers, now=now))
        await asyncio.wait_for(reached.wait(), 5)
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(request, 5)
        assert ("oa", "error", "StorageUnavailable") not in observer.seen


async def test_rejected_requests_are_audited_by_digest_never_by_body(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    sources = {"oa": {**SOURCES["oa"], "max_body_bytes": 4096}}
    async with local_env(tmp_path, redis_url, redis_prefix, extra={"sources": sources}) as env:
        gateway = WebhookGateway(env.control)
        now = env.clock.now()
        secret_body = body("C" * 22, "e-secret-payload")
        traced = {"traceparent": f"00-{'ab' * 16}-{'cd' * 8}-01", "Content-Type": JSON}
        refusals = [
            ("oa", secret_body, traced),  # unsigned: 401
            ("nobody", secret_body, {"Content-Type": JSON}),  # unknown source
            ("oa", b"x" * 5000, {"Content-Type": JSON}),  # too large: 413
        ]
        for source, raw, headers in refusals:
            with pytest.raises(WebhookRejected):
                await gateway.receive(source, raw, headers, now=now)
        await env.services.audit.close()
        blocks = (await env.services.store.list("audit/")).keys
        stored = b"\n".join([(await env.services.store.get(k)).data for k in blocks])
        assert b"e-secret-payload" not in stored and b"xxxxx" not in stored
        records = [json.loads(line) for line in stored.decode().splitlines()]
        assert [(r["source"], r["verdict"]) for r in records] == [
            ("oa", "rejected:missing_signature"),
            ("nobody", "rejected:unknown_source"),
            ("oa", "rejected:body_too_large"),
        ]
        assert records[0]["body_sha256"] == hashlib.sha256(secret_body).hexdigest()
        assert records[0]["trace_id"] == "ab" * 16
        checks = await ObjectAudit(env.services.store).verify_all()
        assert all(c.ok for c in checks.values())


async def test_the_audit_record_carries_the_sessions_trace_id(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    async with local_env(tmp_path, redis_url, redis_prefix, extra={"sources": SOURCES}) as env:
        gateway = WebhookGateway(env.control)
        sid = await env.submit()
        snap = await env.load(sid)
        now = env.clock.now()
        raw = body(snap.waits[0].correlation_id, "e1")
        sender = "ab" * 16
        headers = {
            **sign(Scheme.TORPOR, raw, SECRET, now=now),
            "Content-Type": JSON,
            "traceparent": f"00-{sender}-{'cd' * 8}-01",
        }
        assert (await gateway.receive("oa", raw, headers, now=now)).status == 202
        await env.services.audit.close()
        [key] = (await env.services.store.list("audit/")).keys
        [record] = [json.loads(x) for x in (await env.services.store.get(key)).data.splitlines()]
        assert record["session_id"] == sid
        # The webhook links to the reasoning it caused: the session's trace, beside the
        # sender's own.
        assert record["session_trace_id"] == snap.trace_id != sender
        assert record["trace_id"] == sender
        checks = await ObjectAudit(env.services.store).verify_all()
        assert all(c.ok for c in checks.values())


@pytest.mark.parametrize("declared", [False, True])
async def test_a_body_refused_while_streamed_is_audited_without_a_digest(
    tmp_path: Path, redis_url: str, redis_prefix: str, declared: bool
) -> None:
    sources = {"oa": {**SOURCES["oa"], "max_body_bytes": 4096}}
    async with local_env(tmp_path, redis_url, redis_prefix, extra={"sources": sources}) as env:
        observer = Handled()
        env.services.observer = observer
        gateway = WebhookGateway(env.control)
        chunks = [b"x" * 3000, b"x" * 3000, b""]  # no Content-Length: refused mid-stream

        async def receive() -> dict[str, object]:
            chunk = chunks.pop(0)
            return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}

        headers = [(b"content-type", b"application/json")]
        if declared:
            headers.append((b"content-length", b"6000"))
        scope = {"type": "http", "method": "POST", "path": "/v1/hooks/oa", "headers": headers}
        with pytest.raises(WebhookRejected) as refused:
            await read_audited_body(
                Request(scope, receive), 4096, gateway=gateway, source="oa", now=env.clock.now()
            )
        assert refused.value.status == 413
        assert observer.seen == [("oa", "rejected", "body_too_large")]
        await env.services.audit.close()
        [key] = (await env.services.store.list("audit/")).keys
        [record] = [json.loads(x) for x in (await env.services.store.get(key)).data.splitlines()]
        assert (record["source"], record["verdict"]) == ("oa", "rejected:body_too_large")
        assert record["body_sha256"] == ""  # never read in full: no digest


async def test_each_request_is_counted_once_as_what_it_did(
    tmp_path: Path, redis_url: str, redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The observer's count (``torpor_webhooks_total``): a replay, the exact request sent
    again, is its rejection alone; a batch counts each of its events once, one that names
    no wait with the rest, once the writes are done; a batch whose writes then fail is
    the error it is answered with, alone (it counted its events as they were routed,
    then the error)."""
    secret, sources = ce_source()
    async with local_env(tmp_path, redis_url, redis_prefix, extra={"sources": sources}) as env:
        observer = Handled()
        env.services.observer = observer
        gateway = WebhookGateway(env.control)
        sid = await env.submit(doc="PR-1")
        now = env.clock.now()
        raw = body((await env.load(sid)).waits[0].correlation_id, "e1")
        headers = signed(raw, now)
        assert (await gateway.receive("oa", raw, headers, now=now)).status == 202
        with pytest.raises(WebhookRejected) as replayed:
            await gateway.receive("oa", raw, headers, now=now)  # the same request again
        assert replayed.value.reason is RejectReason.REPLAYED
        other = await env.submit(doc="PR-2")
        base = {"specversion": "1.0", "source": "erp", "type": "oa.approval.decided"}
        batch = [
            {
                **base,
                "id": "ok-1",
                "correlationid": (await env.load(other)).waits[0].correlation_id,
            },
            {**base, "id": "bad-2", "correlationid": "not/a-valid-id"},
        ]
        raw = json.dumps([{**e, "data": {"status": "approved"}} for e in batch]).encode()
        headers = ce_batch(raw, secret, now)
        assert (await gateway.receive("ce", raw, headers, now=now)).status == 202
        assert observer.seen == [
            ("oa", "accepted", ""),
            ("oa", "rejected", "replayed"),
            ("ce", "accepted", ""),
            ("ce", "unknown", ""),
        ]
        observer.seen.clear()
        third = await env.submit(doc="PR-3")
        batch[0]["correlationid"] = (await env.load(third)).waits[0].correlation_id
        raw = json.dumps([{**e, "id": f"{e['id']}-b", "data": {}} for e in batch]).encode()
        headers = ce_batch(raw, secret, now)

        async def down(*_: object, **__: object) -> None:
            raise StorageUnavailable("the object store does not answer")

        monkeypatch.setattr(env.services.audit, "append", down)
        with pytest.raises(StorageUnavailable):
            await gateway.receive("ce", raw, headers, now=now)
        assert observer.seen == [("ce", "error", "StorageUnavailable")]


async def test_a_duplicate_whose_session_goes_before_its_answer_is_still_its_200(
    tmp_path: Path, redis_url: str, redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A duplicate is answered with its session's state; a session removed between the
    routing and the answer (retention) made the request a 404, counted nowhere, for an
    event the inbox holds. Now its 200 without the state, counted as the duplicate."""
    async with local_env(tmp_path, redis_url, redis_prefix, extra={"sources": SOURCES}) as env:
        observer = Handled()
        env.services.observer = observer
        gateway = WebhookGateway(env.control)
        sid = await env.submit()
        now = env.clock.now()
        raw = body((await env.load(sid)).waits[0].correlation_id, "e1")
        assert (await gateway.receive("oa", raw, signed(raw, now), now=now)).status == 202

        async def gone(session_id: str, **_: object) -> None:
            raise SessionNotFound(f"no session {session_id}", session_id=session_id)

        monkeypatch.setattr(gateway.sessions, "get", gone)
        later = now + timedelta(seconds=1)  # the sender's retry, signed afresh
        again = await gateway.receive("oa", raw, signed(raw, later), now=later)
        assert (again.status, again.body["outcome"], "session" in again.body) == (
            200,
            "duplicate",
            False,
        )
        assert observer.seen == [("oa", "accepted", ""), ("oa", "duplicate", "")]


async def test_a_batch_event_that_names_no_wait_is_its_own_outcome_not_the_requests(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    """A correlation id no wait could have (outside the id alphabet) or a wait whose
    session is gone made the whole request 400 or 404 after the batch's earlier events
    were stored and woken: the sender was told it failed while it changed a session.
    Each is its event's outcome now (unknown, audited), as an unknown id always was."""
    secret, sources = ce_source()
    async with local_env(tmp_path, redis_url, redis_prefix, extra={"sources": sources}) as env:
        gateway = WebhookGateway(env.control)
        sid = await env.submit(doc="PR-1")
        gone = await env.submit(doc="PR-2")
        gone_cid = (await env.load(gone)).waits[0].correlation_id
        await env.services.store.delete(keys.snapshot(gone))  # its bindings left behind
        base = {
            "specversion": "1.0",
            "source": "erp",
            "type": "oa.approval.decided",
            "data": {"status": "approved"},
        }
        batch = [
            {**base, "id": "ok-1", "correlationid": (await env.load(sid)).waits[0].correlation_id},
            {**base, "id": "bad-2", "correlationid": "not/a-valid-id"},
            {**base, "id": "gone-3", "correlationid": gone_cid},
        ]
        raw = json.dumps(batch).encode()
        now = env.clock.now()
        headers = ce_batch(raw, secret, now)
        result = await gateway.receive("ce", raw, headers, now=now)
        assert result.status == 202
        assert [(e["event_id"], e["outcome"]) for e in result.body["events"]] == [
            ("ok-1", "accepted"),
            ("bad-2", "unknown"),
            ("gone-3", "unknown"),
        ]
        assert (await env.load(sid)).state is SessionState.COMPLETED
        assert await env.services.inbox.pending(gone, processed=set()) == []
        # Alone, such an event is the unknown correlation it is (404, audited), not a 400.
        single = json.dumps({**base, "id": "bad-4", "correlationid": "x" * 200}).encode()
        headers = {
            **sign(Scheme.STANDARD, single, secret, now=now),
            "Content-Type": "application/cloudevents+json",
        }
        with pytest.raises(UnknownCorrelation):
            await gateway.receive("ce", single, headers, now=now)
        await env.services.audit.close()
        verdicts = [
            json.loads(line)["verdict"]
            for key in (await env.services.store.list("audit/")).keys
            for line in (await env.services.store.get(key)).data.splitlines()
        ]
        assert verdicts.count("unknown") == 3


async def test_a_batchs_answers_to_one_wait_are_applied_in_the_order_sent(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    """Every event of a batch was stamped with one time received, and the inbox applies
    what it holds by that time, then by key (a hash of source and id): [rejected,
    approved] for one wait ended approved whenever the second id hashed first."""
    secret, sources = ce_source()
    first, second = next(
        (f"evt-{i}-a", f"evt-{i}-b")
        for i in range(1000)
        if event_key("ce", f"evt-{i}-b", producer="oa")
        < event_key("ce", f"evt-{i}-a", producer="oa")
    )
    async with local_env(tmp_path, redis_url, redis_prefix, extra={"sources": sources}) as env:
        gateway = WebhookGateway(env.control)
        sid = await env.submit(doc="PR-1")
        cid = (await env.load(sid)).waits[0].correlation_id
        base = {"specversion": "1.0", "source": "oa", "type": "oa.approval.decided"}
        batch = [
            {**base, "id": first, "correlationid": cid, "data": {"status": "rejected"}},
            {**base, "id": second, "correlationid": cid, "data": {"status": "approved"}},
        ]
        raw = json.dumps(batch).encode()
        now = env.clock.now()
        headers = ce_batch(raw, secret, now)
        assert (await gateway.receive("ce", raw, headers, now=now)).status == 202
        applied = await env.load(sid)
        assert applied.state is SessionState.COMPLETED
        answer = json.dumps(applied.result)
        assert "rejected" in answer and "approved" not in answer, answer


async def test_a_resent_answer_to_a_session_that_does_not_decode_is_a_duplicate(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    """Its snapshot's body damaged (the header reads): the first delivery is stored and
    answered 202; the sender's retry looked at the whole snapshot to see whether the
    event was taken, and every retry was a 500."""
    async with local_env(tmp_path, redis_url, redis_prefix, extra={"sources": SOURCES}) as env:
        gateway = WebhookGateway(env.control)
        sid = await env.submit(doc="PR-1")
        cid = (await env.load(sid)).waits[0].correlation_id
        store, codec = env.services.store, SnapshotCodec()
        data = (await store.get(keys.snapshot(sid))).data
        await store.put(keys.snapshot(sid), data[: codec.header_end(data)] + b"not zlib")
        raw = body(cid, "evt-1")
        for status in (202, 200):
            now = env.clock.now()
            headers = signed(raw, now)
            result = await gateway.receive("oa", raw, headers, now=now)
            assert result.status == status and result.body["duplicate"] is (status == 200)
            env.clock.advance(1)
        assert [e.event_id for e in await env.services.inbox.pending(sid, processed=())] == [
            "evt-1"
        ]


async def test_one_cloudevent_id_from_two_producers_is_two_events(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    """A CloudEvent's id is unique only within its ``source``: a relay forwarding two
    vendors through one torpor source may carry id "1" from each. The second was
    answered "duplicate" and never stored, as if the first vendor had sent it again."""
    secret, sources = ce_source()
    async with local_env(tmp_path, redis_url, redis_prefix, extra={"sources": sources}) as env:
        gateway = WebhookGateway(env.control)
        sid = await env.submit(doc="PR-1")
        cid = (await env.load(sid)).waits[0].correlation_id
        outcomes = []
        for producer in ("https://vendor-a.example", "https://vendor-b.example"):
            event = {
                "specversion": "1.0",
                "source": producer,
                "id": "1",
                "type": "oa.approval.decided",
                "correlationid": cid,
                "data": {"status": "approved"},
            }
            raw = json.dumps(event).encode()
            now = env.clock.now()
            headers = {
                **sign(Scheme.STANDARD, raw, secret, now=now),
                "Content-Type": "application/cloudevents+json",
            }
            answer = await gateway.receive("ce", raw, headers, now=now)
            outcomes.append((answer.body["outcome"], answer.body["duplicate"]))
        # The second is its own event: stored, and found the wait answered already.
        assert outcomes == [("accepted", False), ("closed", False)]
        stored = [
            k
            for k in (await env.services.store.list(keys.inbox_prefix(sid))).keys
            if k.rsplit("/", 1)[1]
            in {
                event_key("ce", "1", producer=p)
                for p in ("https://vendor-a.example", "https://vendor-b.example")
            }
        ]
        assert len(stored) == 2


async def test_a_batch_of_one_is_answered_as_a_batch(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    """The answer followed the number of events, not the mode: a batch holding one event
    got a single event's answer (no ``events``), and one naming no wait failed the
    request with 404 where a longer batch reports it as that event's outcome."""
    secret, sources = ce_source()
    async with local_env(tmp_path, redis_url, redis_prefix, extra={"sources": sources}) as env:
        gateway = WebhookGateway(env.control)
        sid = await env.submit()
        cid = (await env.load(sid)).waits[0].correlation_id
        now = env.clock.now()

        async def post(event_id: str, correlation_id: str) -> tuple[int, object]:
            batch = [
                {
                    "specversion": "1.0",
                    "id": event_id,
                    "source": "erp",
                    "type": "oa.approval.decided",
                    "correlationid": correlation_id,
                    "data": {"status": "approved"},
                }
            ]
            raw = json.dumps(batch).encode()
            headers = ce_batch(raw, secret, now)
            result = await gateway.receive("ce", raw, headers, now=now)
            return result.status, result.body.get("events")

        assert await post("nobody-1", "Q" * 22) == (
            200,
            [{"event_id": "nobody-1", "status": 404, "duplicate": False, "outcome": "unknown"}],
        )
        assert await post("ok-2", cid) == (
            202,
            [{"event_id": "ok-2", "status": 202, "duplicate": False, "outcome": "accepted"}],
        )
        assert (await env.load(sid)).state is SessionState.COMPLETED


async def test_a_source_secret_from_the_environment_that_makes_no_key_is_a_503_naming_it(
    tmp_path: Path, redis_url: str, redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Inline secrets are refused at load; an env: one is only known where it resolves.
    # Not base64 for the standard scheme, it failed every delivery as an internal error.
    monkeypatch.setenv("TP_TEST_WHSEC", "whsec_not*base64!")
    sources = {"std": {"tenant": "acme", "scheme": "standard", "secrets": ["env:TP_TEST_WHSEC"]}}
    async with local_env(tmp_path, redis_url, redis_prefix, extra={"sources": sources}) as env:
        observer = Handled()
        env.services.observer = observer
        gateway = WebhookGateway(env.control)
        raw = body("c" * 32, "e1")
        headers = sign(Scheme.STANDARD, raw, generate_secret(Scheme.STANDARD), now=env.clock.now())
        with pytest.raises(WebhookSecretInvalid, match=r"source 'std'.*not valid base64") as failed:
            await gateway.receive("std", raw, headers, now=env.clock.now())
        assert "not*base64" not in str(failed.value)
        assert problem_for(failed.value).status == 503  # the sender retries; 500 is a bug
        assert observer.seen == [("std", "error", "WebhookSecretInvalid")]


async def test_two_sources_whose_environment_gives_them_one_secret_accept_nothing(
    tmp_path: Path, redis_url: str, redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two variables holding one secret, for schemes that sign the same bytes: a delivery
    to one source was accepted again by the other, into its tenant (replay claims are per
    source). Settings cannot see it at load; the gateway refuses both as misconfigured."""
    secret = "s" * 32
    monkeypatch.setenv("TP_TEST_HOOK_A", secret)
    monkeypatch.setenv("TP_TEST_HOOK_B", secret)
    sources = {
        "one": {**SOURCES["oa"], "secrets": ["env:TP_TEST_HOOK_A"]},
        "two": {**SOURCES["oa"], "scheme": "stripe", "secrets": ["env:TP_TEST_HOOK_B"]},
    }
    async with local_env(tmp_path, redis_url, redis_prefix, extra={"sources": sources}) as env:
        gateway = WebhookGateway(env.control)
        raw = body("c" * 32, "e1")
        for name, scheme in (("one", Scheme.TORPOR), ("two", Scheme.STRIPE)):
            headers = sign(scheme, raw, secret, now=env.clock.now())
            with pytest.raises(WebhookSecretInvalid, match="'one' and 'two' share") as refused:
                await gateway.receive(name, raw, headers, now=env.clock.now())
            assert secret not in str(refused.value)
            assert problem_for(refused.value).status == 503
        monkeypatch.setenv("TP_TEST_HOOK_B", "t" * 32)  # given its own: both verify again
        headers = {
            **sign(Scheme.TORPOR, raw, secret, now=env.clock.now()),
            "Content-Type": "application/json",
        }
        with pytest.raises(UnknownCorrelation):  # verified, and it names no wait
            await gateway.receive("one", raw, headers, now=env.clock.now())


async def test_a_resent_answer_to_a_long_session_reads_only_its_processed_ids(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    """A sender's retry of an answer asks whether its session processed the event: the
    session's processed ids decide, sealed ones too, and its conversation and tool log
    are not read (58 more chunks for a session 1,000 steps old, at every retry)."""
    async with local_env(tmp_path, redis_url, redis_prefix, extra={"sources": SOURCES}) as env:
        gateway = WebhookGateway(env.control)
        sid = await env.submit(doc="PR-1")
        held = await env.services.index.acquire_lease(
            name=lease_name(sid),
            owner="someone-else",
            ttl=timedelta(minutes=1),
            now=env.clock.now(),
        )
        assert held is not None  # busy: the first delivery is stored, not taken
        snap = await env.load(sid)
        raw = body(snap.waits[0].correlation_id, "evt-1")

        async def deliver(status: int) -> None:
            now = env.clock.now()
            headers = signed(raw, now)
            result = await gateway.receive("oa", raw, headers, now=now)
            assert result.status == status and result.body["duplicate"] is (status == 200)
            env.clock.advance(1)

        await deliver(202)
        [event] = await env.services.inbox.pending(sid, processed=())
        # Taken a thousand steps ago (as if): its id is sealed in a chunk.
        snap = await env.load(sid)
        snap = await env.services.snapshots.save(
            snap.model_copy(update={"processed_events": [*snap.processed_events, event.key]}),
            expected_generation=snap.generation,
        )
        aged = await age(env.services.snapshots, snap, 1000)
        assert aged.chunks.processed_events and event.key not in aged.processed_events[-128:]
        read = keys_read(env.services.store)
        woken = env.control.activate_for_event
        env.control.activate_for_event = lambda session_id: pytest.fail("processed: not woken")  # type: ignore[method-assign]
        await deliver(200)
        env.control.activate_for_event = woken  # type: ignore[method-assign]
        chunks = [k.removeprefix(keys.chunk_prefix(sid)) for k in read if "chunks/" in k]
        assert chunks and all(k.startswith("processed_events/") for k in chunks)


class CountedHeaders(Headers):
    """Starlette's headers, as a Serve replica hands them to the gateway, counting the
    passes made over them whole (each decodes every raw header again)."""

    passes = 0

    def items(self) -> list[tuple[str, str]]:  # type: ignore[override]
        type(self).passes += 1
        return super().items()

    def keys(self) -> list[str]:  # type: ignore[override]
        type(self).passes += 1
        return super().keys()


async def test_a_webhooks_headers_are_read_once_for_the_verifier_the_parser_and_the_trace(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    async with local_env(tmp_path, redis_url, redis_prefix, extra={"sources": SOURCES}) as env:
        gateway = WebhookGateway(env.control)
        sid = await env.submit()
        now = env.clock.now()
        raw = body((await env.load(sid)).waits[0].correlation_id, "e1")
        sender = "ab" * 16
        sent = {
            **sign(Scheme.TORPOR, raw, SECRET, now=now),
            "Content-Type": JSON,
            "Traceparent": f" 00-{sender}-{'cd' * 8}-01",  # any case, padded: still read
        }
        headers = CountedHeaders(raw=[(k.lower().encode(), v.encode()) for k, v in sent.items()])
        CountedHeaders.passes = 0
        assert (await gateway.receive("oa", raw, headers, now=now)).status == 202
        assert CountedHeaders.passes == 1
        await env.services.audit.close()
        [key] = (await env.services.store.list("audit/")).keys
        [record] = [json.loads(x) for x in (await env.services.store.get(key)).data.splitlines()]
        assert record["trace_id"] == sender


async def test_two_spellings_of_a_signature_header_with_different_values_are_refused(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    """Read once for every reader, a header sent twice with two values is still refused
    (Starlette's headers keep both): the verifier and the parser could read different
    ones."""
    async with local_env(tmp_path, redis_url, redis_prefix, extra={"sources": SOURCES}) as env:
        gateway = WebhookGateway(env.control)
        sid = await env.submit()
        now = env.clock.now()
        raw = body((await env.load(sid)).waits[0].correlation_id, "e1")
        sent = [(k.lower().encode(), v.encode()) for k, v in signed(raw, now).items()]
        other = sign(Scheme.TORPOR, b"{}", SECRET, now=now)
        [(name, value)] = [(k, v) for k, v in other.items() if "signature" in k.lower()]
        headers = Headers(raw=[*sent, (name.upper().encode(), value.encode())])
        with pytest.raises(WebhookRejected) as refused:
            await gateway.receive("oa", raw, headers, now=now)
        assert refused.value.reason is RejectReason.MALFORMED_SIGNATURE
        assert (await env.load(sid)).state is SessionState.SUSPENDED  # still waiting
