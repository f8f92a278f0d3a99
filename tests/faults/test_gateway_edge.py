"""The webhook gateway at the edge of failure: nothing accepted is lost or left asleep,
nothing that stored nothing is refused as a replay, and a stale answer never applies.

Each test breaks one step of one request (the index answer lost after the claim, the
activation lost after the inbox write, the index flushed) and then plays the sender's
retry, byte-identical or freshly signed, through the real gateway over real Redis and a
local object store, with the session runtime inline.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

import storage.local_store as local_store
from tests.support.harness import Env, local_env
from torpor.errors import (
    AmbiguousEvent,
    IndexUnavailable,
    RejectReason,
    StorageUnavailable,
    WebhookRejected,
)
from torpor.lifecycle import SessionState
from torpor.ports import Stored
from torpor.service.gateway import WebhookGateway
from torpor.service.replay import ReplayGuard, replay_claims
from torpor.webhooks.signing import Scheme, generate_secret, sign, verify

SECRET = generate_secret(Scheme.TORPOR)
JSON = "application/json"
MAPPING = {
    "event_id_path": "eventId",
    "type_path": "eventType",
    "correlation_id_path": "correlationId",
    "business_key_path": "businessKey",
    "epoch_path": "epoch",
    "idempotency_key_path": "idempotencyKey",
    "status_path": "decision.status",
    "data_path": "decision",
}
SOURCES = {"oa": {"tenant": "acme", "scheme": "torpor", "secrets": [SECRET], "mapping": MAPPING}}


def body(event_id: str, status: str = "approved", **fields: Any) -> bytes:
    return json.dumps(
        {
            "eventId": event_id,
            "eventType": "oa.approval.decided",
            "decision": {"status": status},
            **fields,
        }
    ).encode()


@pytest.fixture
async def env(tmp_path: Path, redis_url: str, redis_prefix: str) -> AsyncIterator[Env]:
    async with local_env(tmp_path, redis_url, redis_prefix, extra={"sources": SOURCES}) as e:
        yield e


def signed(env: Env, raw: bytes, *, later_s: float = 0) -> dict[str, str]:
    at = env.clock.now() + timedelta(seconds=later_s)
    return {**sign(Scheme.TORPOR, raw, SECRET, now=at), "Content-Type": JSON}


async def state(env: Env, sid: str) -> SessionState:
    return (await env.load(sid)).state


def fail_once(
    target: object, name: str, *, after: bool, error: BaseException | None = None
) -> list[int]:
    """Make ``target.name`` fail on its next call: before it runs, or after it ran (the
    answer lost). Returns a list that counts the failures."""
    original: Callable[..., Awaitable[Any]] = getattr(target, name)
    fired: list[int] = []

    async def broken(*args: Any, **kwargs: Any) -> Any:
        if fired:
            return await original(*args, **kwargs)
        fired.append(1)
        if after:
            await original(*args, **kwargs)
        raise error or IndexUnavailable("injected: the answer was lost")

    setattr(target, name, broken)
    return fired


async def test_a_claim_whose_answer_was_lost_does_not_refuse_the_retry(env: Env) -> None:
    gateway = WebhookGateway(env.control)
    sid = await env.submit()
    cid = (await env.load(sid)).waits[0].correlation_id
    raw = body("e-claim", correlationId=cid)
    headers = signed(env, raw)
    fired = fail_once(env.services.index, "admit", after=True)
    with pytest.raises(IndexUnavailable):
        await gateway.receive("oa", raw, headers, now=env.clock.now())
    assert fired and await state(env, sid) is SessionState.SUSPENDED  # nothing stored
    result = await gateway.receive("oa", raw, headers, now=env.clock.now())  # byte-identical
    assert result.status == 202
    assert await state(env, sid) is SessionState.COMPLETED


@pytest.mark.parametrize("retry", ["byte_identical", "freshly_signed"])
async def test_a_stored_event_whose_wake_was_lost_is_woken_by_the_retry(
    env: Env, retry: str
) -> None:
    gateway = WebhookGateway(env.control)
    sid = await env.submit()
    cid = (await env.load(sid)).waits[0].correlation_id
    raw = body("e-wake", correlationId=cid)
    headers = signed(env, raw)
    fail_once(env.control, "arm_wake", after=False)  # the wake timer is not armed
    with pytest.raises(IndexUnavailable):
        await gateway.receive("oa", raw, headers, now=env.clock.now())
    assert await state(env, sid) is SessionState.SUSPENDED  # stored, never woken
    again = headers if retry == "byte_identical" else signed(env, raw, later_s=1)
    result = await gateway.receive("oa", raw, again, now=env.clock.now())
    assert result.status == 200 and result.body["duplicate"] is True
    assert await state(env, sid) is SessionState.COMPLETED


@pytest.mark.parametrize(
    ("lost", "answered"),
    [
        (IndexUnavailable("injected: the answer was lost"), IndexUnavailable),
        # A call of the request's own cancelled under it (the index's, as the index
        # closes), the request not cancelled: a 503 too. Before, the cancel passed every
        # handler as the request's: no answer at all.
        (asyncio.CancelledError(), StorageUnavailable),
    ],
    ids=["lost", "cancelled-under-it"],
)
async def test_a_used_capability_link_whose_wake_was_lost_is_woken_by_the_retry(
    env: Env, lost: BaseException, answered: type[Exception]
) -> None:
    gateway = WebhookGateway(env.control)
    sid = await env.submit()
    token = await env.capability_link(sid)
    raw = json.dumps({"status": "approved"}).encode()
    headers = {"Content-Type": JSON}
    fail_once(env.control, "activate_for_event", after=False, error=lost)
    with pytest.raises(answered):
        await gateway.capability(token, raw, headers, now=env.clock.now())
    assert await state(env, sid) is SessionState.SUSPENDED
    result = await gateway.capability(token, raw, headers, now=env.clock.now())
    assert result.status == 200 and result.body["duplicate"] is True
    assert await state(env, sid) is SessionState.COMPLETED
    # Another answer through the same link is still refused: the token was used.
    other = json.dumps({"status": "rejected"}).encode()
    with pytest.raises(WebhookRejected) as refused:
        await gateway.capability(token, other, headers, now=env.clock.now())
    assert refused.value.reason is RejectReason.TOKEN_USED


async def test_a_replay_after_the_index_was_flushed_is_still_refused(
    env: Env, redis_url: str, redis_prefix: str
) -> None:
    gateway = WebhookGateway(env.control)
    sid = await env.submit()
    cid = (await env.load(sid)).waits[0].correlation_id
    raw = body("e-replay", correlationId=cid)
    headers = signed(env, raw)
    assert (await gateway.receive("oa", raw, headers, now=env.clock.now())).status == 202
    client = aioredis.Redis.from_url(redis_url)
    async for key in client.scan_iter(match=redis_prefix + "*"):
        await client.delete(key)
    await client.aclose()
    with pytest.raises(WebhookRejected) as refused:
        await gateway.receive("oa", raw, headers, now=env.clock.now())
    assert refused.value.reason is RejectReason.REPLAYED and refused.value.status == 409


async def test_a_nonce_reused_by_another_request_is_still_a_replay(env: Env) -> None:
    # The content claim of a request that died is no proof of a replay; a nonce taken by
    # another, accepted request is.
    gateway = WebhookGateway(env.control)
    first, second = await env.submit(doc="PR-1"), await env.submit(doc="PR-2")
    cids = [(await env.load(s)).waits[0].correlation_id for s in (first, second)]
    raws = [body(f"e-nonce-{i}", correlationId=cid) for i, cid in enumerate(cids)]
    nonce = "nonce-0123456789abcdef"
    at = env.clock.now()
    headers = [
        {**sign(Scheme.TORPOR, r, SECRET, now=at, nonce=nonce), "Content-Type": JSON} for r in raws
    ]
    assert (await gateway.receive("oa", raws[0], headers[0], now=at)).status == 202
    for _ in range(2):  # a refusal gives back no claim it did not take: the nonce stays taken
        with pytest.raises(WebhookRejected) as refused:
            await gateway.receive("oa", raws[1], headers[1], now=at)
        assert refused.value.reason is RejectReason.REPLAYED
    assert await state(env, second) is SessionState.SUSPENDED
    # and the refusal took no claim of its own: the content of the second is still free
    fresh = {**sign(Scheme.TORPOR, raws[1], SECRET, now=at), "Content-Type": JSON}
    assert (await gateway.receive("oa", raws[1], fresh, now=at)).status == 202


async def test_a_retry_after_a_failed_request_gave_back_only_its_content_is_let_through(
    env: Env,
) -> None:
    # A request that stored nothing gives its claims back; if that is cut short, what is
    # left must read as "its holder never finished", never as a nonce another request took.
    gateway = WebhookGateway(env.control)
    sid = await env.submit()
    cid = (await env.load(sid)).waits[0].correlation_id
    raw = body("e-release", correlationId=cid)
    headers = signed(env, raw)
    index = env.services.index
    release = index.release_nonce

    async def nonce_lost(*, scope: str, nonce: str) -> None:
        if scope.startswith("nonce:"):
            index.release_nonce = release  # type: ignore[method-assign]
            raise IndexUnavailable("injected: the connection dropped")
        await release(scope=scope, nonce=nonce)

    fail_once(env.services.inbox, "stage", after=False)  # nothing is stored
    index.release_nonce = nonce_lost  # type: ignore[method-assign]
    with pytest.raises(IndexUnavailable):
        await gateway.receive("oa", raw, headers, now=env.clock.now())
    assert await state(env, sid) is SessionState.SUSPENDED
    result = await gateway.receive("oa", raw, headers, now=env.clock.now())  # byte-identical
    assert result.status == 202
    assert await state(env, sid) is SessionState.COMPLETED


async def test_a_retry_whose_first_try_gave_its_claims_back_meanwhile_is_let_through(
    env: Env,
) -> None:
    # The sender's retry meets the claims of its first try, which then fails and gives
    # them back: the retry is no replay (nothing was accepted), and goes on holding them.
    gateway = WebhookGateway(env.control)
    sid = await env.submit()
    cid = (await env.load(sid)).waits[0].correlation_id
    raw = body("e-meanwhile", correlationId=cid)
    headers = signed(env, raw)
    at = env.clock.now()
    verified = verify(Scheme.TORPOR, raw, headers, [SECRET], now=at)
    claims = replay_claims("oa", env.services.settings.sources["oa"], verified)
    index = env.services.index
    first_try = await index.admit(
        claims=claims.pairs,
        ttl=claims.ttl,
        now=at,
        tenant="",
        correlation_id=None,
        business_key=None,
    )
    assert first_try.fresh
    admit = index.admit

    async def then_first_try_fails(**kwargs: Any) -> Any:
        index.admit = admit  # type: ignore[method-assign]
        seen = await admit(**kwargs)
        await ReplayGuard(env.services).release(claims)  # the first try failed
        return seen

    index.admit = then_first_try_fails  # type: ignore[method-assign]
    assert (await gateway.receive("oa", raw, headers, now=at)).status == 202
    assert await state(env, sid) is SessionState.COMPLETED
    # the retry held the claims as its own: a replay of it is refused
    with pytest.raises(WebhookRejected) as refused:
        await gateway.receive("oa", raw, headers, now=at)
    assert refused.value.reason is RejectReason.REPLAYED


# -- stale answers by business key (seed 004) -----------------------------------------------


async def replanned(env: Env) -> tuple[str, str]:
    """A session whose approval was re-planned: epoch 1 superseded by epoch 3, same
    business key. Returns (session id, the first wait's correlation id)."""
    sid = await env.submit()
    first = (await env.load(sid)).waits[0]
    await env.world.set_version("PR-1", "v2")  # the budget moved: the answer is a drift
    await env.answer(sid, {"status": "approved"}, event_id="a1")
    [second] = (await env.load(sid)).waits
    assert second.epoch == 3 and second.business_key == first.business_key == "PR-1"
    return sid, first.correlation_id


async def test_a_late_business_key_answer_is_not_applied_to_the_new_wait(env: Env) -> None:
    gateway = WebhookGateway(env.control)
    sid, _ = await replanned(env)
    raw = body("late-1", status="rejected", businessKey="PR-1")
    with pytest.raises(AmbiguousEvent) as refused:
        await gateway.receive("oa", raw, signed(env, raw), now=env.clock.now())
    assert refused.value.status == 409 and "correlation" in (refused.value.problem_detail or "")
    assert refused.value.problem_type == "ambiguous_event"
    snap = await env.load(sid)
    assert snap.state is SessionState.SUSPENDED and snap.waits[0].epoch == 3


@pytest.mark.parametrize("echo", ["epoch", "idempotency_key"])
async def test_an_answer_naming_an_older_epoch_is_observed_and_answered_stale(
    env: Env, echo: str
) -> None:
    gateway = WebhookGateway(env.control)
    sid, _ = await replanned(env)
    named = {"epoch": 1} if echo == "epoch" else {"idempotencyKey": "acme:approve:PR-1:1"}
    raw = body("late-2", status="rejected", businessKey="PR-1", **named)
    result = await gateway.receive("oa", raw, signed(env, raw), now=env.clock.now())
    assert result.status == 200 and result.body["outcome"] == "stale"
    snap = await env.load(sid)
    assert snap.state is SessionState.SUSPENDED and snap.waits[0].epoch == 3
    assert snap.observations[-1].reason.value == "stale"
    # The answer to the current request, naming its epoch, is applied.
    raw = body("now-3", businessKey="PR-1", epoch=3)
    assert (await gateway.receive("oa", raw, signed(env, raw), now=env.clock.now())).status == 202
    assert (await env.load(sid)).state is SessionState.COMPLETED


def two_stage_agent(env_agents: dict[str, Any]) -> dict[str, Any]:
    """The test agent with a second approval for another business key (``PR-1/cfo``)."""
    purchase = env_agents["purchase"]
    plan = json.loads(json.dumps(purchase["options"]["plan"]))
    steps = plan["steps"]
    second = json.loads(json.dumps(next(s for s in steps if s["id"] == "approve")))
    second["id"] = "cfo"
    second["calls"][0]["args"]["doc"] = "${input.cfo_doc}"
    second["branches"] = []
    steps.insert(steps.index(next(s for s in steps if s["id"] == "done")), second)
    return {**purchase, "options": {**purchase["options"], "plan": plan, "name": "two"}}


async def test_a_business_key_answer_to_a_later_wait_that_is_no_replan_is_applied(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    # Only a re-plan (an earlier wait with the same business key) makes a business-key
    # answer ambiguous; a later wait for another key is answered by its key as usual.
    async with local_env(tmp_path, redis_url, redis_prefix, extra={"sources": SOURCES}) as env:
        agents = {"two": two_stage_agent(env.services.settings.model_dump()["agents"])}
        async with local_env(
            tmp_path / "two", redis_url, redis_prefix, extra={"sources": SOURCES, "agents": agents}
        ) as two:
            gateway = WebhookGateway(two.control)
            submitted = await two.control.submit(
                tenant="acme", agent="two", input={"doc": "PR-1", "amount": 5, "cfo_doc": "CFO-1"}
            )
            sid = submitted.session_id
            raw = body("first", businessKey="PR-1")
            assert (
                await gateway.receive("oa", raw, signed(two, raw), now=two.clock.now())
            ).status == 202
            [cfo] = (await two.load(sid)).waits
            assert cfo.epoch > 1 and cfo.business_key == "CFO-1" and not cfo.replanned
            raw = body("second", businessKey="CFO-1")
            result = await gateway.receive("oa", raw, signed(two, raw), now=two.clock.now())
            assert result.status == 202
            assert (await two.load(sid)).state is SessionState.COMPLETED


async def test_an_answer_to_a_closed_wait_says_so(env: Env) -> None:
    gateway = WebhookGateway(env.control)
    sid, first_cid = await replanned(env)
    raw = body("late-4", status="rejected", correlationId=first_cid)
    result = await gateway.receive("oa", raw, signed(env, raw), now=env.clock.now())
    assert result.status == 200 and result.body["outcome"] == "closed"
    assert (await env.load(sid)).state is SessionState.SUSPENDED


async def test_a_replica_whose_clock_runs_ahead_does_not_make_an_answer_late(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    # received_at comes from the index's clock (Redis TIME), shared by every replica: a
    # replica an hour ahead must not judge a punctual answer later than its 30 min SLA.
    async with local_env(
        tmp_path, redis_url, redis_prefix, extra={"sources": SOURCES}, sla_s=1800
    ) as env:
        gateway = WebhookGateway(env.control)
        sid = await env.submit()
        cid = (await env.load(sid)).waits[0].correlation_id
        ahead = env.clock.now() + timedelta(hours=1)
        raw = body("e-skew", correlationId=cid)
        headers = {**sign(Scheme.TORPOR, raw, SECRET, now=ahead), "Content-Type": JSON}
        result = await gateway.receive("oa", raw, headers, now=ahead)
        assert result.status == 202
        assert await state(env, sid) is SessionState.COMPLETED


async def test_a_failed_audit_record_takes_the_replay_marker_back(env: Env) -> None:
    """The audit record and the replay marker are written together: when the record
    fails, the request is answered with the error and its byte-identical retry must be
    let through (200 duplicate, woken), not refused as a replay of an accepted request."""
    gateway = WebhookGateway(env.control)
    sid = await env.submit()
    cid = (await env.load(sid)).waits[0].correlation_id
    raw = body("e-audit", correlationId=cid)
    headers = signed(env, raw)
    fired = fail_once(
        env.services.audit, "append", after=False, error=StorageUnavailable("injected")
    )
    with pytest.raises(StorageUnavailable):
        await gateway.receive("oa", raw, headers, now=env.clock.now())
    assert fired
    digest = sign_digest(raw, headers)
    assert not await env.services.inbox.was_accepted(source="oa", content_digest=digest)
    result = await gateway.receive("oa", raw, headers, now=env.clock.now())
    assert result.status == 200 and result.body["duplicate"] is True
    assert await state(env, sid) is SessionState.COMPLETED


async def test_the_audit_record_is_written_beside_the_replay_marker(env: Env) -> None:
    """The audit record and the replay marker meet at a barrier: a gateway that wrote
    them one after the other would hang here instead of answering."""
    gateway = WebhookGateway(env.control)
    sid = await env.submit()
    cid = (await env.load(sid)).waits[0].correlation_id
    raw = body("e-pairs", correlationId=cid)
    barrier = asyncio.Barrier(2)
    meet(env.services.audit, "append", barrier)
    meet(env.services.inbox, "remember_accepted", barrier)
    result = await asyncio.wait_for(
        gateway.receive("oa", raw, signed(env, raw), now=env.clock.now()), timeout=10
    )
    assert result.status == 202
    await env.control.drain()
    assert await state(env, sid) is SessionState.COMPLETED


async def test_the_wake_timer_follows_the_inbox_write_and_precedes_the_marker(
    env: Env,
) -> None:
    """An activation unschedules the wake timer before its last look at the inbox, so a
    timer armed before the event is visible can be taken by a look that missed it; and a
    marker (a retry answered 409) must never name an event nothing would wake."""
    inbox = env.services.inbox
    _, steps = await accepted_in_steps(
        env, [(inbox, "stage"), (env.control, "arm_wake"), (inbox, "remember_accepted")]
    )
    assert steps == [
        "stage:start",
        "stage:end",
        "arm_wake:start",
        "arm_wake:end",
        "remember_accepted:start",
        "remember_accepted:end",
    ], steps


async def test_behind_the_answer_the_activation_is_asked_for_before_the_marker(
    env: Env,
) -> None:
    """In an HTTP handler the activation runs behind the answer: it is asked for once the
    wake timer is armed, so the session's load overlaps the flush of the marker and the
    audit record instead of waiting for it."""
    control = env.control
    sid, steps = await accepted_in_steps(
        env,
        [(control, "arm_wake"), (control, "activate"), (env.services.inbox, "remember_accepted")],
        background=True,  # as in the Serve app (submitted and suspended inline)
    )
    assert steps == [
        "arm_wake:start",
        "arm_wake:end",
        "activate:start",
        "activate:end",
        "remember_accepted:start",
        "remember_accepted:end",
    ], steps
    await env.control.drain()
    assert await state(env, sid) is SessionState.COMPLETED


async def test_with_other_webhooks_in_flight_the_activation_goes_last(env: Env) -> None:
    """Under load the session would take the cores the durable writes need: a webhook
    with others in flight asks for its activation after its marker; the one left alone
    again asks before."""
    gateway = WebhookGateway(env.control)
    first, second = await env.submit(doc="PR-a"), await env.submit(doc="PR-b")
    raws = [
        body(f"e-{n}", correlationId=(await env.load(sid)).waits[0].correlation_id)
        for n, sid in (("a", first), ("b", second))
    ]
    env.control.background = True
    entered, release = asyncio.Event(), asyncio.Event()
    real_stage = env.services.inbox.stage

    async def held_once(event: Any) -> Stored:
        env.services.inbox.stage = real_stage  # type: ignore[method-assign]
        entered.set()
        await release.wait()
        return await real_stage(event)

    env.services.inbox.stage = held_once  # type: ignore[method-assign]
    steps: list[str] = []
    record_steps(env.control, "activate", steps)
    record_steps(env.services.inbox, "remember_accepted", steps)
    held = asyncio.create_task(
        gateway.receive("oa", raws[0], signed(env, raws[0]), now=env.clock.now())
    )
    await asyncio.wait_for(entered.wait(), timeout=10)  # the first is held at its write
    result = await gateway.receive("oa", raws[1], signed(env, raws[1]), now=env.clock.now())
    assert result.status == 202
    release.set()
    assert (await asyncio.wait_for(held, timeout=10)).status == 202
    assert steps == [
        "remember_accepted:start",  # the second, while the first is in flight: last
        "remember_accepted:end",
        "activate:start",
        "activate:end",
        "activate:start",  # the first, alone by then: early
        "activate:end",
        "remember_accepted:start",
        "remember_accepted:end",
    ], steps
    await env.control.drain()
    assert {await state(env, sid) for sid in (first, second)} == {SessionState.COMPLETED}


async def test_an_awaited_activation_is_asked_for_after_the_marker(env: Env) -> None:
    """Awaited in turn (no HTTP answer to run behind), the activation would hold back the
    durable writes the answer promises: it is asked for last."""
    assert not env.control.background
    sid, steps = await accepted_in_steps(
        env, [(env.control, "activate"), (env.services.inbox, "remember_accepted")]
    )
    assert steps == [
        "remember_accepted:start",
        "remember_accepted:end",
        "activate:start",
        "activate:end",
    ], steps
    assert await state(env, sid) is SessionState.COMPLETED


async def test_a_failed_audit_record_leaves_a_marker_it_did_not_write(env: Env) -> None:
    """The marker is taken back only by the request that wrote it: one found there was
    written for a request answered 2xx, whose replays must stay refused."""
    gateway = WebhookGateway(env.control)
    sid = await env.submit()
    cid = (await env.load(sid)).waits[0].correlation_id
    raw = body("e-theirs", correlationId=cid)
    headers = signed(env, raw)
    digest = sign_digest(raw, headers)
    # Remembered already (its request accepted, its index claims since flushed).
    assert await env.services.inbox.remember_accepted(source="oa", content_digest=digest)
    fail_once(env.services.audit, "append", after=False, error=StorageUnavailable("injected"))
    with pytest.raises(StorageUnavailable):
        await gateway.receive("oa", raw, headers, now=env.clock.now())
    assert await env.services.inbox.was_accepted(source="oa", content_digest=digest)


async def test_an_event_not_made_durable_takes_the_replay_marker_back(env: Env) -> None:
    """The inbox event is staged (visible, flushed with the audit record): when its
    flush fails after all, the request is answered with the error, its marker is taken
    back, and the byte-identical retry is let through (200 duplicate, woken)."""
    gateway = WebhookGateway(env.control)
    sid = await env.submit()
    cid = (await env.load(sid)).waits[0].correlation_id
    raw = body("e-flush", correlationId=cid)
    headers = signed(env, raw)
    real_stage = env.services.inbox.stage

    async def unflushable() -> None:
        raise StorageUnavailable("injected: the log could not be flushed")

    async def staged_once(event: Any) -> Stored:
        env.services.inbox.stage = real_stage  # type: ignore[method-assign]
        return Stored((await real_stage(event)).new, unflushable)

    env.services.inbox.stage = staged_once  # type: ignore[method-assign]
    with pytest.raises(StorageUnavailable):
        await gateway.receive("oa", raw, headers, now=env.clock.now())
    digest = sign_digest(raw, headers)
    assert not await env.services.inbox.was_accepted(source="oa", content_digest=digest)
    result = await gateway.receive("oa", raw, headers, now=env.clock.now())
    assert result.status == 200 and result.body["duplicate"] is True
    assert await state(env, sid) is SessionState.COMPLETED


async def test_a_webhooks_event_and_audit_record_take_one_flush_of_the_log(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The local folder store: the inbox event is staged, the audit record's create
    flushes the log once for both, and the event's wait for its flush costs nothing."""
    gateway = WebhookGateway(env.control)
    flushed: list[int] = []
    real = local_store._Inline.flushed
    ours = env.services.inbox.store._inline  # type: ignore[attr-defined]

    def counted(
        inline: local_store._Inline, fd: int, how: Callable[[int], None] | None = None
    ) -> None:
        if inline is ours:  # not a store of an earlier test, flushing as it is collected
            flushed.append(fd)
        real(inline, fd, how)

    async def later(*_: object, **__: object) -> None:
        return None

    for event_id in ("e-first", "e-second"):  # the first also names the audit stream
        sid = await env.submit(doc=f"PR-{event_id}")
        cid = (await env.load(sid)).waits[0].correlation_id
        raw = body(event_id, correlationId=cid)
        headers = signed(env, raw)
        monkeypatch.setattr(local_store._Inline, "flushed", counted)
        monkeypatch.setattr(env.control, "activate", later)  # the session's own writes
        flushed.clear()
        result = await gateway.receive("oa", raw, headers, now=env.clock.now())
        monkeypatch.undo()
        assert result.status == 202
    assert len(flushed) == 1, f"{len(flushed)} flushes of the log for one webhook"


async def accepted_in_steps(
    env: Env, watched: list[tuple[object, str]], *, background: bool = False
) -> tuple[str, list[str]]:
    """A session's answer accepted (202) while ``watched`` calls note when they start and
    end: the session and the steps, in order."""
    gateway = WebhookGateway(env.control)
    sid = await env.submit()
    cid = (await env.load(sid)).waits[0].correlation_id
    env.control.background = background
    raw = body(f"e-steps-{sid}", correlationId=cid)
    steps: list[str] = []
    for target, name in watched:
        record_steps(target, name, steps)
    result = await gateway.receive("oa", raw, signed(env, raw), now=env.clock.now())
    assert result.status == 202
    return sid, steps


def record_steps(target: object, name: str, steps: list[str]) -> None:
    """``target.name`` notes when each call starts and ends."""
    original: Callable[..., Awaitable[Any]] = getattr(target, name)

    async def noted(*args: Any, **kwargs: Any) -> Any:
        steps.append(f"{name}:start")
        try:
            return await original(*args, **kwargs)
        finally:
            steps.append(f"{name}:end")

    setattr(target, name, noted)


def meet(target: object, name: str, barrier: asyncio.Barrier) -> None:
    """``target.name`` waits at ``barrier`` (once) before it runs."""
    original: Callable[..., Awaitable[Any]] = getattr(target, name)
    met: list[int] = []

    async def waiting(*args: Any, **kwargs: Any) -> Any:
        if not met:
            met.append(1)
            await barrier.wait()
        return await original(*args, **kwargs)

    setattr(target, name, waiting)


def sign_digest(raw: bytes, headers: dict[str, str]) -> str:
    return verify(
        Scheme.TORPOR, raw, headers, [SECRET], now=datetime.now(UTC), tolerance_s=300
    ).content_digest
