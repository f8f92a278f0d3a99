"""A multi-stage approval inside a fan-in group: two ``request_approval`` calls in one
turn, one of them above the threshold of a second stage. The first stage's decision puts
that member's request to the second stage's approvers in place, without moving the
session's epoch (the other member's routing and gates hang on it); the group resolves
once both members are decided. On the real runtime (Redis index, local object store)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.runtime import approval_tools
from tests.runtime.approval_tools import SENT, WITHDRAWN, approval_pair_agent
from tests.runtime.test_gateway import JSON, SECRET, SOURCES
from tests.support.harness import Env, callback, local_env
from torpor.errors import AmbiguousEvent
from torpor.events import EventKind, InboxEvent
from torpor.lifecycle import SessionState
from torpor.models import DispatchStatus, ObservationReason, OutboxKind, SessionSnapshot, Wait
from torpor.ports import Reason
from torpor.service.gateway import WebhookGateway
from torpor.service.sweeper import Sweeper
from torpor.webhooks.signing import Scheme, sign

S, R = SessionState, ObservationReason
POLICY = {"tiers": [{"approvers": ["cfo", "bob"]}]}
STAGES = [{"approvers": ["bob"]}, {"approvers": ["cfo"], "above": 1000}]
count = iter(range(10_000))


@pytest.fixture(autouse=True)
def oa() -> Iterator[None]:
    approval_tools.reset()
    yield
    approval_tools.reset()


@pytest.fixture
def make(tmp_path: Path, redis_url: str, redis_prefix: str) -> Any:
    def make(sources: dict[str, Any] | None = None, **options: Any) -> Any:
        agents = {"pair": approval_pair_agent(**{"policy": POLICY, "stages": STAGES, **options})}
        extra = {"agents": agents, "sources": sources or {}}
        return local_env(tmp_path, redis_url, redis_prefix, extra=extra)

    return make


@pytest.fixture
async def env(make: Any) -> AsyncIterator[Env]:
    async with make() as e:
        yield e


async def submit(env: Env) -> str:
    return (await env.control.submit(tenant="acme", agent="pair", input={})).session_id


def request_for(snap: SessionSnapshot, doc: str) -> Wait:
    return next(w for w in snap.waits if w.request["subject"] == doc)


async def routed(env: Env, wait: Wait) -> InboxEvent | None:
    """An event shell stamped from the index binding of ``wait``, as the ingress stamps
    it; None if the index does not route the wait."""
    binding = await env.services.index.resolve(
        tenant="acme", now=env.clock.now(), correlation_id=wait.correlation_id
    )
    if binding is None:
        return None
    return InboxEvent.new(
        kind=EventKind.CALLBACK,
        session_id=binding.session_id,
        source="oa",
        event_id="probe",
        type="oa.approval.decided",
        received_at=env.clock.now(),
        correlation_id=wait.correlation_id,
        epoch=binding.epoch,
        step_id=binding.step_id,
    )


async def vote(
    env: Env, sid: str, doc: str, approver: str, status: str = "approved"
) -> SessionSnapshot:
    """``approver``'s decision on the open request for ``doc``, routed by the index."""
    shell = await routed(env, request_for(await env.load(sid), doc))
    assert shell is not None, f"the request for {doc} is not routed"
    data = {"status": status, "approver": approver}
    event = InboxEvent.new(
        **{**shell.model_dump(exclude={"key", "data", "event_id"}), "data": data},
        event_id=f"e{next(count)}",
    )
    await env.control.deliver(event)
    return await env.load(sid)


def answer_to(sid: str, wait: Wait, approver: str, at: Any) -> InboxEvent:
    data = {"status": "approved", "approver": approver}
    return callback(sid, wait, event_id=f"e{next(count)}", data=data, at=at)


def decisions(snap: SessionSnapshot, name: str) -> list[tuple[int, str]]:
    assert isinstance(snap.result, dict)
    answer = snap.result[name]
    assert isinstance(answer, dict) and isinstance(answer["stages"], list)
    return [(s["stage"], s["outcome"]) for s in answer["stages"]]  # type: ignore[index,call-overload]


@pytest.mark.parametrize("small_first", [False, True], ids=["both-open", "big-left-alone"])
async def test_the_first_stage_inside_a_group_sends_the_second_and_the_group_completes(
    env: Env, small_first: bool
) -> None:
    sid = await submit(env)
    snap = await env.load(sid)
    [group] = snap.fan_ins
    first = request_for(snap, "PR-BIG")
    assert snap.state is S.SUSPENDED and len(snap.waits) == 2 and len(SENT) == 2
    if small_first:  # big is then the group's one open member
        assert (await vote(env, sid, "PR-SMALL", "bob")).state is S.SUSPENDED
    snap = await vote(env, sid, "PR-BIG", "bob")
    second = request_for(snap, "PR-BIG")
    assert snap.state is S.SUSPENDED and snap.epoch == first.epoch == second.epoch
    assert second.request["stage"] == 2 and second.request["approvers"] == ["cfo"]
    assert second.correlation_id != first.correlation_id
    assert second.group_id == group.group_id
    [member] = [m for m in snap.fan_ins[0].members if m.tool_call_id == first.tool_call_id]
    assert member.correlation_id == second.correlation_id
    assert await routed(env, first) is None and await routed(env, second) is not None
    assert SENT[-1].request["approvers"] == ["cfo"]
    assert len({r.idempotency_key for r in SENT}) == 3, "stage 2 has its own key"
    assert WITHDRAWN == []  # the first stage was decided, not abandoned
    if not small_first:
        assert (await vote(env, sid, "PR-SMALL", "bob")).state is S.SUSPENDED
    snap = await vote(env, sid, "PR-BIG", "cfo")
    assert snap.state is S.COMPLETED
    assert decisions(snap, "big") == [(1, "approved"), (2, "approved")]
    assert decisions(snap, "small") == [(1, "approved")]
    assert len(SENT) == 3


async def test_a_second_stage_rejection_answers_its_member_as_a_single_wait_does(
    env: Env,
) -> None:
    sid = await submit(env)
    await vote(env, sid, "PR-BIG", "bob")
    snap = await vote(env, sid, "PR-BIG", "cfo", "rejected")
    assert snap.state is S.SUSPENDED and [w.request["subject"] for w in snap.waits] == ["PR-SMALL"]
    snap = await vote(env, sid, "PR-SMALL", "bob")
    assert snap.state is S.COMPLETED and isinstance(snap.result, dict)
    assert snap.result["big"]["status"] == "rejected"  # type: ignore[index,call-overload]
    assert snap.result["big"]["approver"] == "cfo"  # type: ignore[index,call-overload]
    assert decisions(snap, "big") == [(1, "approved"), (2, "rejected")]
    assert decisions(snap, "small") == [(1, "approved")]


async def test_an_answer_to_the_superseded_first_stage_is_stale(env: Env) -> None:
    """The cfo answers the first stage's request (as a second, delayed approval would): it
    was replaced by the second stage's, so the answer is stale, not the cfo's decision of
    the second stage."""
    sid = await submit(env)
    first = request_for(await env.load(sid), "PR-BIG")
    await vote(env, sid, "PR-BIG", "bob")
    await env.control.deliver(answer_to(sid, first, "cfo", env.clock.now()))
    snap = await env.load(sid)
    assert snap.state is S.SUSPENDED and snap.observations[-1].reason is R.STALE
    second = request_for(snap, "PR-BIG")
    assert second.request["stage"] == 2 and second.progress["votes"] == {}
    assert (await vote(env, sid, "PR-BIG", "cfo")).state is S.SUSPENDED  # small still open


async def test_votes_in_one_activation_decide_a_members_stage_once(env: Env) -> None:
    """bob's approval and the cfo's, both to the first stage's request, land before the
    session wakes: bob's decides stage 1, the cfo's answers the request being replaced."""
    sid = await submit(env)
    first = request_for(await env.load(sid), "PR-BIG")
    for approver in ("bob", "cfo"):
        assert await env.services.inbox.deliver(answer_to(sid, first, approver, env.clock.now()))
    await env.control.activate(sid, reason=Reason.EVENT)
    snap = await env.load(sid)
    second = request_for(snap, "PR-BIG")
    assert snap.state is S.SUSPENDED and second.request["stage"] == 2
    assert [o.reason for o in snap.observations] == [R.COUNTED, R.STALE]
    assert second.progress["votes"] == {} and len(SENT) == 3


@pytest.mark.parametrize("sent", [False, True], ids=["died-before-the-send", "died-after"])
async def test_a_retry_after_a_crash_sends_the_second_stage_once(env: Env, sent: bool) -> None:
    """The activation that decided stage 1 died after its commit: before it bound and sent
    the second stage's request, or after the send but before the commit of its status.
    The retry binds and sends what the outbox owes, under the one key the far side
    dedups on; nothing decides stage 1 again."""
    sid = await submit(env)
    snap = await vote(env, sid, "PR-BIG", "bob")
    second = request_for(snap, "PR-BIG")
    owed = [
        e.model_copy(
            update={"status": DispatchStatus.PENDING, "attempts": 0, "dispatched_at": None}
        )
        if e.correlation_id == second.correlation_id
        else e
        for e in snap.outbox
    ]
    await env.services.snapshots.save(
        snap.model_copy(update={"outbox": owed}), expected_generation=snap.generation
    )
    if not sent:
        SENT.pop()
        await env.services.index.unbind(
            tenant="acme", correlation_id=second.correlation_id, business_key="PR-BIG"
        )
    await env.control.activate(sid, reason=Reason.RETRY)
    await env.control.activate(sid, reason=Reason.RETRY)  # nothing owed any more
    snap = await env.load(sid)
    assert snap.state is S.SUSPENDED and request_for(snap, "PR-BIG") == second
    stage_two = [r.idempotency_key for r in SENT if r.request["stage"] == 2]
    assert len(stage_two) == (2 if sent else 1) and len(set(stage_two)) == 1
    starts = [e for e in snap.outbox if e.kind is OutboxKind.START]
    assert len(starts) == 3 and all(e.status is DispatchStatus.DISPATCHED for e in starts)
    assert await routed(env, second) is not None
    await vote(env, sid, "PR-SMALL", "bob")
    snap = await vote(env, sid, "PR-BIG", "cfo")
    assert snap.state is S.COMPLETED
    assert decisions(snap, "big") == [(1, "approved"), (2, "approved")]


async def test_a_stage_decided_after_the_deadline_times_out_instead_of_reissuing(
    env: Env,
) -> None:
    """bob approved in time, but the session woke only after the SLA: the group times out
    as a session waiting on the approval alone would, and the cfo is never asked."""
    sid = await submit(env)
    first = request_for(await env.load(sid), "PR-BIG")
    await vote(env, sid, "PR-SMALL", "bob")  # big is the one member left to time out
    assert await env.services.inbox.deliver(answer_to(sid, first, "bob", env.clock.now()))
    env.clock.advance((first.deadline - env.clock.now()).total_seconds() + 1)
    await env.control.activate(sid, reason=Reason.EVENT)
    snap = await env.load(sid)
    assert snap.state is S.TIMED_OUT and len(SENT) == 2
    assert snap.error is not None and snap.error.code == "sla_expired"


async def test_an_escalation_inside_a_group_withdraws_and_reissues_each_member_in_place(
    make: Any,
) -> None:
    """Both requests escalate at once: each member's old request is withdrawn under its
    own key and the next one goes out under another, in the session's epoch."""
    async with make(escalation=["cfo"], escalate_after_s=1200) as env:
        sid = await submit(env)
        before = await env.load(sid)
        env.clock.advance(1201)
        await Sweeper(env.control).sweep_once(env.clock.now())
        snap = await env.load(sid)
        assert snap.state is S.SUSPENDED and snap.epoch == before.epoch
        assert [w.request["approvers"] for w in snap.waits] == [["cfo"], ["cfo"]]
        assert [o.reason for o in snap.observations] == [R.ESCALATED, R.ESCALATED]
        keys = [w.idempotency_key("acme") for w in before.waits]
        assert sorted(k for k, _ in WITHDRAWN) == sorted(f"{k}:compensate" for k in keys)
        assert sorted(r.idempotency_key for r in SENT[2:]) == [
            "acme:request_approval:PR-BIG#1:1",
            "acme:request_approval:PR-SMALL#1:1",
        ]
        await vote(env, sid, "PR-SMALL", "cfo")
        snap = await vote(env, sid, "PR-BIG", "cfo")  # stage 1, escalated; stage 2 is the cfo's
        assert snap.state is S.SUSPENDED and request_for(snap, "PR-BIG").request["stage"] == 2
        snap = await vote(env, sid, "PR-BIG", "cfo")
        assert snap.state is S.COMPLETED
        assert decisions(snap, "big") == [(1, "approved"), (2, "approved")]


async def test_an_answer_by_business_key_alone_is_ambiguous_after_a_reissue_in_place(
    make: Any,
) -> None:
    """The key now names the second stage's request, in the same epoch: a webhook that
    names only the key may answer the first stage's (a late or repeated delivery), so
    only its sender can say which; it is refused, as for a re-planned single wait."""
    mapping = {**SOURCES["oa"]["mapping"], "business_key_path": "businessKey"}  # type: ignore[dict-item]
    async with make(sources={"oa": {**SOURCES["oa"], "mapping": mapping}}) as env:
        gateway = WebhookGateway(env.control)
        sid = await submit(env)
        await vote(env, sid, "PR-BIG", "bob")
        now = env.clock.now()
        raw = json.dumps(
            {
                "eventId": "key-only",
                "eventType": "oa.approval.decided",
                "businessKey": "PR-BIG",
                "decision": {"status": "approved", "approver": "cfo"},
            }
        ).encode()
        headers = {**sign(Scheme.TORPOR, raw, SECRET, now=now), "Content-Type": JSON}
        with pytest.raises(AmbiguousEvent):
            await gateway.receive("oa", raw, headers, now=now)
        snap = await env.load(sid)
        assert request_for(snap, "PR-BIG").progress["votes"] == {}
        assert [m.status.value for m in snap.fan_ins[0].members] == ["open", "open"]
