"""The built-in ApprovalTool in one process: authority, quorum, stages, reminders,
escalation and reassignment, on the real runtime (Redis index, local object store)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.runtime import approval_tools
from tests.runtime.approval_tools import SENT, WITHDRAWN, approval_agent
from tests.support.harness import Env, callback, local_env
from tests.support.receiver import Receiver
from torpor.approval.tool import REASSIGN
from torpor.errors import ConfigError, ReassignmentRefused
from torpor.events import EventKind, InboxEvent
from torpor.ids import event_key
from torpor.lifecycle import SessionState
from torpor.models import ObservationReason, SessionSnapshot, Wait
from torpor.ports import Observer, Reason, TimerKind
from torpor.service.deliveries import DeliveryWorker, secret_for
from torpor.service.sweeper import Sweeper, SweepReport
from torpor.webhooks.signing import Scheme, verify

S, R = SessionState, ObservationReason
POLICY = {
    "tiers": [{"up_to": 1000, "approvers": ["clerk"]}, {"approvers": ["fd", "cfo", "bob"]}],
    "delegations": [{"delegate": "deputy", "for": "fd"}],
}


class Alerts(Observer):
    def __init__(self) -> None:
        self.alerts: list[list[str]] = []

    async def security_alert(
        self, snapshot: SessionSnapshot, wait: Wait, reasons: list[str]
    ) -> None:
        self.alerts.append(reasons)


@pytest.fixture(autouse=True)
def oa() -> Iterator[None]:
    approval_tools.reset()
    yield
    approval_tools.reset()


@pytest.fixture
def make(tmp_path: Path, redis_url: str, redis_prefix: str) -> Any:
    def make(**options: Any) -> Any:
        agents = {"approval": approval_agent(**{"policy": POLICY, **options})}
        return local_env(tmp_path, redis_url, redis_prefix, extra={"agents": agents})

    return make


async def submit(env: Env, amount: float = 5000, doc: str = "PR-1") -> str:
    result = await env.control.submit(
        tenant="acme", agent="approval", input={"doc": doc, "amount": amount, "cc": "CC-7"}
    )
    return result.session_id


count = iter(range(10_000))


async def vote(env: Env, sid: str, approver: str, status: str = "approved") -> SessionSnapshot:
    await env.answer(sid, {"status": status, "approver": approver}, event_id=f"e{next(count)}")
    return await env.load(sid)


def reasons(snap: SessionSnapshot) -> list[ObservationReason]:
    return [o.reason for o in snap.observations]


@pytest.fixture
async def fd_or_clerk(make: Any) -> AsyncIterator[tuple[Env, Alerts]]:
    async with make(stages=[{"approvers": ["fd", "clerk"]}]) as env:
        alerts = Alerts()
        env.services.observer = alerts
        yield env, alerts


def reassign_event(
    env: Env, sid: str, wait: Wait, event_id: str, approvers: list[str]
) -> InboxEvent:
    """The operator's instruction to give ``wait`` to ``approvers``, as
    ``SessionService.reassign_approval`` puts it in the inbox (without its own check)."""
    return InboxEvent.answering(
        wait,
        kind=EventKind.OPERATOR,
        session_id=sid,
        source="torpor",
        event_id=event_id,
        type=REASSIGN,
        received_at=env.clock.now(),
        data={"approvers": approvers, "by": "operator:abc", "why": "fd on leave"},
    )


async def test_an_answer_without_authority_is_observed_alerted_and_never_applied(
    fd_or_clerk: tuple[Env, Alerts],
) -> None:
    env, alerts = fd_or_clerk
    sid = await submit(env, amount=5000)
    before = await env.load(sid)
    snap = await vote(env, sid, "clerk")  # asked, but may approve up to 1000 only
    assert snap.state is S.SUSPENDED and snap.waits == before.waits
    snap = await vote(env, sid, "mallory")  # never asked
    assert snap.state is S.SUSPENDED and snap.waits == before.waits
    assert reasons(snap) == [R.UNAUTHORIZED, R.UNAUTHORIZED]
    assert len(alerts.alerts) == 2 and "no authority for 5000" in alerts.alerts[0][0]
    snap = await vote(env, sid, "fd")
    assert snap.state is S.COMPLETED and snap.result is not None
    assert snap.result["decision"] == "approved"  # type: ignore[index,call-overload]


async def test_a_delegate_approves_for_whom_they_act_for(fd_or_clerk: tuple[Env, Alerts]) -> None:
    env, alerts = fd_or_clerk
    sid = await submit(env, amount=5000)
    snap = await vote(env, sid, "deputy")
    assert snap.state is S.COMPLETED and not alerts.alerts
    [stage] = snap.result["stages"]  # type: ignore[index,call-overload]
    assert stage["by"] == {"fd": "deputy"}


@pytest.mark.parametrize(
    ("quorum", "votes", "decided_at", "decision"),
    [
        # all of: out of order, a duplicate from one approver counted once
        ({"mode": "all"}, ["cfo", "fd", "fd", "bob"], 3, "approved"),
        ({"mode": "all"}, ["cfo", "bob:rejected"], 1, "rejected"),
        ({"mode": "any"}, ["bob", "fd"], 0, "approved"),
        # N of M: the second approval of the same person does not make two
        ({"mode": "n_of_m", "required": 2}, ["bob", "bob", "cfo"], 2, "approved"),
        ({"mode": "n_of_m", "required": 2}, ["bob:rejected", "cfo:rejected"], 1, "rejected"),
    ],
)
async def test_multi_approver_modes(
    make: Any, quorum: dict[str, Any], votes: list[str], decided_at: int, decision: str
) -> None:
    async with make(stages=[{"approvers": ["fd", "cfo", "bob"], "quorum": quorum}]) as env:
        sid = await submit(env)
        for i, cast in enumerate(votes):
            approver, _, status = cast.partition(":")
            snap = await vote(env, sid, approver, status or "approved")
            assert (snap.state is S.COMPLETED) is (i >= decided_at), (i, snap.state)
            if snap.state is S.COMPLETED:
                break
        assert snap.result["decision"] == decision  # type: ignore[index,call-overload]
        duplicates = votes[: decided_at + 1].count("fd") > 1 or votes.count("bob") > 1
        assert (R.DUPLICATE in reasons(snap)) is duplicates
        assert len(SENT) == 1  # one request, one epoch: collected inside the tool


async def test_a_second_stage_above_the_threshold_is_a_new_request(make: Any) -> None:
    stages = [{"approvers": ["bob"]}, {"approvers": ["cfo"], "above": 10_000}]
    async with make(stages=stages) as env:
        small = await submit(env, amount=500, doc="PR-S")
        assert (await vote(env, small, "bob")).state is S.COMPLETED
        big = await submit(env, amount=20_000, doc="PR-B")
        first = (await env.load(big)).waits[0]
        snap = await vote(env, big, "bob")
        [second] = snap.waits
        assert snap.state is S.SUSPENDED and second.epoch > first.epoch
        assert second.request["approvers"] == ["cfo"] and second.request["stage"] == 2
        assert WITHDRAWN == []  # the first stage was decided, not abandoned
        snap = await vote(env, big, "cfo")
        assert snap.state is S.COMPLETED
        assert [s["stage"] for s in snap.result["stages"]] == [1, 2]  # type: ignore[index,call-overload]


async def test_a_reminder_is_sent_signed_and_recorded_on_the_session(make: Any) -> None:
    hook = Receiver()
    try:
        async with make(
            stages=[{"approvers": ["fd"]}], sla_s=3600, remind_before_s=[600], notify_url=hook.url
        ) as env:
            sid = await submit(env)
            sweeper = Sweeper(env.control)
            await sweeper.sweep_once(env.clock.now())
            assert reasons(await env.load(sid)) == []  # not yet
            env.clock.advance(3001)
            await sweeper.sweep_once(env.clock.now())
            snap = await env.load(sid)
            assert snap.state is S.SUSPENDED and reasons(snap) == [R.REMINDER]
            assert await DeliveryWorker(env.services).due(env.clock.now()) == 1
            [got] = hook.received
            secret = secret_for(env.services.settings, "acme", hook.url)
            # Signed as every notification is (Standard Webhooks), at the manual clock's time.
            verify(Scheme.STANDARD, got.body, got.headers, [secret], now=env.clock.now())
            payload = json.loads(got.body)
            assert payload["type"] == "approval.reminder"
            assert payload["data"]["correlation_id"] == snap.waits[0].correlation_id
            await sweeper.sweep_once(env.clock.now())  # the timer is gone: one reminder
            assert reasons(await env.load(sid)) == [R.REMINDER]
            # The hourly repair makes sure of the wait's timers; the one that fired stays
            # gone (put back, it fired again, to no effect, every hour for each wait).
            await sweeper.repair(env.clock.now(), SweepReport())
            far = env.clock.now() + timedelta(days=1)
            due = await env.services.index.due(kind=TimerKind.TOOL, now=far, limit=10)
            assert due == [], "the reminder that fired is not put back"
    finally:
        hook.close()


async def test_escalation_opens_a_new_epoch_and_the_old_answer_is_stale(make: Any) -> None:
    async with make(
        stages=[{"approvers": ["fd"]}], escalation=["cfo"], escalate_after_s=1200
    ) as env:
        sid = await submit(env)
        old = (await env.load(sid)).waits[0]
        env.clock.advance(1201)
        await Sweeper(env.control).sweep_once(env.clock.now())
        snap = await env.load(sid)
        [new] = snap.waits
        assert new.epoch > old.epoch and new.correlation_id != old.correlation_id
        assert new.request["approvers"] == ["cfo"] and R.ESCALATED in reasons(snap)
        assert [r.idempotency_key for r in SENT] == [
            f"acme:{old.action_key}:{old.epoch}",
            f"acme:{new.action_key}:{new.epoch}",
        ]
        assert [(f"acme:{old.action_key}:{old.epoch}:compensate", "escalated")] == WITHDRAWN
        # The first approver answers the withdrawn request: stale, never applied.
        late = callback(
            sid,
            old,
            event_id="late",
            data={"status": "approved", "approver": "fd"},
            at=env.clock.now(),
        )
        await env.control.deliver(late)
        snap = await env.load(sid)
        assert snap.state is S.SUSPENDED and reasons(snap)[-1] is R.STALE
        assert (await vote(env, sid, "cfo")).state is S.COMPLETED


async def test_an_operator_reassigns_an_approval(make: Any) -> None:
    async with make(stages=[{"approvers": ["fd"]}]) as env:
        sid = await submit(env)
        old = (await env.load(sid)).waits[0]
        await env.control.reassign_approval(
            sid, old.correlation_id, approvers=["bob"], by="operator:abc", why="fd on leave"
        )
        snap = await env.load(sid)
        [new] = snap.waits
        assert new.epoch > old.epoch and new.request["approvers"] == ["bob"]
        assert reasons(snap) == [R.REASSIGNED]
        assert [(f"acme:{old.action_key}:{old.epoch}:compensate", "reassigned")] == WITHDRAWN
        assert (await vote(env, sid, "fd")).state is S.SUSPENDED  # no longer asked
        assert (await vote(env, sid, "bob")).state is S.COMPLETED


@pytest.mark.parametrize("bound", [False, True], ids=["wait-lost", "timer-lost-alone"])
async def test_a_rebuilt_index_gets_the_approvals_timers_back(make: Any, bound: bool) -> None:
    """The index lost the wait and its timers (a flushed Redis), or the escalation timer
    alone (a key evicted): with the wait still bound repair passed it over, and the
    approval never escalated."""
    async with make(
        stages=[{"approvers": ["fd"]}], escalation=["cfo"], escalate_after_s=1200
    ) as env:
        sid = await submit(env)
        wait = (await env.load(sid)).waits[0]
        index = env.services.index
        if not bound:
            await index.unbind(
                tenant="acme", correlation_id=wait.correlation_id, business_key="PR-1"
            )
        member = f"{sid}|{wait.correlation_id}|escalate-1"
        await index.unschedule(kind=TimerKind.TOOL, member=member)
        sweeper = Sweeper(env.control)
        await sweeper.repair(env.clock.now(), SweepReport())
        env.clock.advance(1201)
        await sweeper.sweep_once(env.clock.now())
        assert (await env.load(sid)).waits[0].request["approvers"] == ["cfo"]


async def together(env: Env, sid: str, *votes: str) -> SessionSnapshot:
    """Votes that land in the inbox before the session wakes: one activation takes them."""
    wait = (await env.load(sid)).waits[0]
    for cast in votes:
        approver, _, status = cast.partition(":")
        data = {"status": status or "approved", "approver": approver}
        event = callback(sid, wait, event_id=f"e{next(count)}", data=data, at=env.clock.now())
        assert await env.services.inbox.deliver(event)  # durable, no activation yet
    await env.control.activate(sid, reason=Reason.EVENT)
    return await env.load(sid)


async def test_votes_in_one_activation_decide_a_stage_once(make: Any) -> None:
    """fd's approval decides stage 1 (any of fd, bob) and puts the request to the cfo:
    bob's approval, in the same activation, answers the request being replaced. It is
    stale, as it would be had the session woken for each vote: stage 1 is decided once."""
    stages = [{"approvers": ["fd", "bob"]}, {"approvers": ["cfo"], "above": 1000}]
    async with make(stages=stages) as env:
        sid = await submit(env, amount=5000)
        snap = await together(env, sid, "fd", "bob")
        [second] = snap.waits
        assert snap.state is S.SUSPENDED and second.request["stage"] == 2
        assert reasons(snap) == [R.COUNTED, R.STALE]
        assert (await vote(env, sid, "cfo")).state is S.COMPLETED
        decided = (await env.load(sid)).result["stages"]  # type: ignore[index,call-overload]
        assert [(s["stage"], s["by"]) for s in decided] == [(1, {"fd": "fd"}), (2, {"cfo": "cfo"})]


async def test_a_vote_after_a_reassignment_in_one_activation_is_stale(make: Any) -> None:
    """The operator reassigns fd's request to bob; fd's approval lands behind it in the
    inbox, before the session wakes. It answers the withdrawn request: stale, not the
    decision (nor a vote carried into bob's request)."""
    async with make(stages=[{"approvers": ["fd"]}]) as env:
        sid = await submit(env)
        old = (await env.load(sid)).waits[0]
        reassign = reassign_event(env, sid, old, "reassign:1", ["bob"])
        assert await env.services.inbox.deliver(reassign)
        snap = await together(env, sid, "fd")
        [new] = snap.waits
        assert snap.state is S.SUSPENDED and new.request["approvers"] == ["bob"]
        assert reasons(snap) == [R.REASSIGNED, R.STALE] and new.progress["votes"] == {}
        assert (await vote(env, sid, "bob")).state is S.COMPLETED


async def test_an_approver_named_twice_in_a_reassignment_votes_once(make: Any) -> None:
    """Reassigned to fd, cfo and fd again, two of them must approve: fd is one."""
    quorum = {"mode": "n_of_m", "required": 2}
    async with make(stages=[{"approvers": ["bob"], "quorum": quorum}]) as env:
        sid = await submit(env)
        old = (await env.load(sid)).waits[0]
        await env.control.reassign_approval(
            sid, old.correlation_id, approvers=["fd", "cfo", "fd"], by="operator:abc"
        )
        assert (await env.load(sid)).waits[0].request["required"] == 2
        assert (await vote(env, sid, "fd")).state is S.SUSPENDED
        assert (await vote(env, sid, "cfo")).state is S.COMPLETED


@pytest.mark.parametrize("amount", ["NaN", "inf", "-Infinity"])
async def test_an_amount_that_is_no_finite_number_is_refused_not_taken_as_small(
    make: Any, amount: str
) -> None:
    """NaN is above no threshold and inf is stored as null (read back as 0): either way the
    CFO's stage was skipped and a clerk's tier had authority. The call fails instead."""
    stages = [{"approvers": ["clerk", "fd"]}, {"approvers": ["cfo"], "above": 10_000}]
    async with make(stages=stages) as env:
        sid = await submit(env, amount=amount)  # type: ignore[arg-type]
        snap = await env.load(sid)
        assert snap.waits == [] and SENT == []
        assert snap.state is S.COMPLETED and snap.result == {"decision": "error"}


async def test_a_reassignment_to_someone_without_authority_is_refused_to_the_operator(
    make: Any,
) -> None:
    """The clerk may approve up to 1,000: a 5,000 request reassigned to the clerk alone
    could never be approved. The operator is told so (before, the call was accepted and
    only an alert said later that the session had refused it); nothing reaches the
    session, and fd's request stays open."""
    async with make(stages=[{"approvers": ["fd"]}]) as env:
        alerts = Alerts()
        env.services.observer = alerts
        sid = await submit(env, amount=5000)
        old = (await env.load(sid)).waits[0]
        with pytest.raises(ReassignmentRefused, match="clerk") as refused:
            await env.control.reassign_approval(
                sid, old.correlation_id, approvers=["clerk"], by="operator:abc", why="fd on leave"
            )
        assert refused.value.status == 422
        assert await env.services.inbox.pending(sid, processed=()) == []
        snap = await env.load(sid)
        [wait] = snap.waits
        assert (wait.epoch, wait.request["approvers"]) == (old.epoch, ["fd"])
        assert reasons(snap) == [] and WITHDRAWN == [] and alerts.alerts == []
        assert (await vote(env, sid, "fd")).state is S.COMPLETED


async def test_a_reassignment_without_authority_that_reaches_the_session_is_refused_and_alerted(
    make: Any,
) -> None:
    """The session decides again under its lease (the wait, or the rules, may have moved
    since the operator was answered): an instruction to give the 5,000 request to the
    clerk alone is refused and alerted there too, and fd's request is not withdrawn."""
    async with make(stages=[{"approvers": ["fd"]}]) as env:
        alerts = Alerts()
        env.services.observer = alerts
        sid = await submit(env, amount=5000)
        old = (await env.load(sid)).waits[0]
        reassign = reassign_event(env, sid, old, "reassign:clerk", ["clerk"])
        assert await env.control.deliver(reassign)
        snap = await env.load(sid)
        [wait] = snap.waits
        assert (wait.epoch, wait.request["approvers"]) == (old.epoch, ["fd"])
        assert reasons(snap) == [R.UNAUTHORIZED] and WITHDRAWN == []
        assert len(alerts.alerts) == 1 and "reassignment refused" in alerts.alerts[0][0]
        assert (await vote(env, sid, "fd")).state is S.COMPLETED


@pytest.mark.parametrize(
    ("mode", "accepted"), [("any", True), ("n_of_m", False)], ids=["one-of-them", "two-of-them"]
)
async def test_a_reassignment_stands_when_enough_of_its_people_have_authority(
    make: Any, mode: str, accepted: bool
) -> None:
    """Reassigned to the clerk and bob for 5,000: bob alone has authority. Enough when one
    of them must approve; not when two must."""
    quorum = {"mode": mode, "required": 2}
    async with make(stages=[{"approvers": ["fd"], "quorum": quorum}]) as env:
        sid = await submit(env, amount=5000)
        old = (await env.load(sid)).waits[0]
        with contextlib.nullcontext() if accepted else pytest.raises(ReassignmentRefused):
            await env.control.reassign_approval(
                sid, old.correlation_id, approvers=["clerk", "bob"], by="operator:abc"
            )
        snap = await env.load(sid)
        assert (snap.waits[0].request["approvers"] == ["clerk", "bob"]) is accepted
        assert reasons(snap) == ([R.REASSIGNED] if accepted else [])


@pytest.mark.parametrize("amount", [None, -5000], ids=["missing", "negative"])
async def test_an_amount_missing_or_negative_is_refused_where_the_rules_depend_on_it(
    make: Any, amount: float | None
) -> None:
    """Read as 0 (or taken as it is), the CFO's stage above 10,000 was skipped and the
    clerk's tier had authority: the rules failed open. The call fails instead."""
    stages = [{"approvers": ["clerk", "fd"]}, {"approvers": ["cfo"], "above": 10_000}]
    async with make(stages=stages) as env:
        sid = await submit(env, amount=amount)  # type: ignore[arg-type]
        snap = await env.load(sid)
        assert snap.waits == [] and SENT == []
        assert snap.state is S.COMPLETED and snap.result == {"decision": "error"}


async def test_an_amount_may_be_left_out_where_no_rule_depends_on_it(make: Any) -> None:
    anyone = {"tiers": [{"approvers": ["fd"]}]}
    async with make(stages=[{"approvers": ["fd"]}], policy=anyone) as env:
        sid = await submit(env, amount=None)  # type: ignore[arg-type]
        [wait] = (await env.load(sid)).waits
        assert wait.request["amount"] == 0
        assert (await vote(env, sid, "fd")).state is S.COMPLETED


async def test_a_stage_put_to_the_escalation_target_is_not_escalated_to_them_again(
    make: Any,
) -> None:
    """Stage 2 goes to the CFO, whom stage 1 escalates to: the chain started again at the
    second stage, and after ``escalate_after_s`` the CFO's request was withdrawn and sent
    to the CFO again, an answer to the first one then stale."""
    stages = [{"approvers": ["fd"]}, {"approvers": ["cfo"], "above": 1000}]
    async with make(stages=stages, escalation=["cfo"], escalate_after_s=1200) as env:
        sid = await submit(env, amount=5000)
        second = (await vote(env, sid, "fd")).waits[0]
        assert second.request["approvers"] == ["cfo"] and second.request["stage"] == 2
        env.clock.advance(1201)
        await Sweeper(env.control).sweep_once(env.clock.now())
        [still] = (await env.load(sid)).waits
        assert (still.epoch, still.correlation_id) == (second.epoch, second.correlation_id)
        assert WITHDRAWN == []
        assert (await vote(env, sid, "cfo")).state is S.COMPLETED


async def test_an_escalation_chain_skips_whom_the_stage_is_put_to_already(make: Any) -> None:
    stages = [{"approvers": ["fd"]}, {"approvers": ["cfo"], "above": 1000}]
    chain = ["cfo", "bob"]
    async with make(stages=stages, escalation=chain, escalate_after_s=1200) as env:
        sid = await submit(env, amount=5000)
        await vote(env, sid, "fd")
        env.clock.advance(1201)
        await Sweeper(env.control).sweep_once(env.clock.now())
        [wait] = (await env.load(sid)).waits
        assert wait.request["approvers"] == ["bob"] and wait.request["stage"] == 2


async def test_a_reassignment_where_the_agent_does_not_load_is_left_to_the_session(
    make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Asked where the operator asks, the tool's check needs the agent loaded there: one
    that does not load in that process (a tool's option it cannot resolve) turned the
    reassignment into an error, where the session, which loads it, decides anyway."""
    async with make(stages=[{"approvers": ["fd"]}]) as env:
        sid = await submit(env)
        old = (await env.load(sid)).waits[0]

        def broken(name: str) -> Any:
            raise ConfigError("agent 'approval': a tool option did not resolve here")

        loads = env.services.plugins.agent
        monkeypatch.setattr(env.services.plugins, "agent", broken)
        event_id = await env.control.reassign_approval(
            sid, old.correlation_id, approvers=["bob"], by="operator:abc", why="fd on leave"
        )
        monkeypatch.setattr(env.services.plugins, "agent", loads)
        assert event_id.startswith("reassign:")
        assert await env.services.inbox.find(sid, event_key("torpor", event_id)) is not None
