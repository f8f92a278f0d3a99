"""Fan-in waits end to end on the in-memory adapters: all, any and n of m; answers out of
order and duplicated; one member expired under each policy; the rest closed and
compensated once; every member gated on its own."""

from __future__ import annotations

import json
from typing import Any

from tests.runtime import fanin_tools
from tests.runtime.memory_env import MemEnv, plan_agent
from tests.runtime.memory_env import memory_env as open_env
from torpor.events import EventKind, InboxEvent
from torpor.lifecycle import SessionState
from torpor.models import ObservationReason, SessionSnapshot, Wait
from torpor.ports import Reason
from torpor.service.sweeper import Sweeper
from torpor.session.suspend import binding_of

S = SessionState
VENDORS = ["a", "b", "c"]
QUOTE = "tests.runtime.fanin_tools:Quote"
QUOTES = "tests.runtime.fanin_tools:Quotes"


def turn_agent(fan_in: dict[str, Any] | None = None, **tool: Any) -> dict[str, Any]:
    """Three ``quote`` calls in one turn; the result names each call's answer."""
    plan = {
        "steps": [
            {
                "id": "q",
                "calls": [{"tool": "quote", "args": {"vendor": v}, "as": v} for v in VENDORS],
            },
            {"id": "done", "finish": {v: f"${{results.{v}}}" for v in VENDORS}},
        ]
    }
    agent = plan_agent(plan, {QUOTE: tool})
    return {**agent, "fan_in": fan_in} if fan_in else agent


def tool_agent(fan_in: dict[str, Any], **tool: Any) -> dict[str, Any]:
    """One ``quotes`` call asking the three vendors; the result is its aggregated answer."""
    plan = {
        "steps": [
            {
                "id": "q",
                "calls": [{"tool": "quotes", "args": {"vendors": VENDORS, "fan_in": fan_in}}],
            },
            {"id": "done", "finish": "${results.q}"},
        ]
    }
    return plan_agent(plan, {QUOTES: tool})


def member(snap: SessionSnapshot, vendor: str) -> Wait:
    return next(w for w in snap.waits if w.request["vendor"] == vendor)


async def answer(
    env: MemEnv, sid: str, wait: Wait, price: int, *, event_id: str | None = None, **fields: Any
) -> bool:
    return await env.control.deliver(
        InboxEvent.answering(
            wait,
            kind=EventKind.CALLBACK,
            session_id=sid,
            source="vendor",
            event_id=event_id or f"evt-{wait.request['vendor']}-{price}",
            type="vendor.quote",
            received_at=env.clock.now(),
            data={"price": price},
            **fields,
        )
    )


async def bound(env: MemEnv, wait: Wait) -> bool:
    found = await env.services.index.resolve(
        tenant="acme", now=env.clock.now(), correlation_id=wait.correlation_id
    )
    return found is not None


def tool_messages(snap: SessionSnapshot) -> list[tuple[str, Any]]:
    return [
        (m.tool_call_id or "", json.loads(m.content or "null"))
        for m in snap.messages
        if m.role == "tool"
    ]


async def test_a_turn_of_several_long_running_calls_sleeps_once_until_all_answered() -> None:
    async with open_env({"t": turn_agent()}) as env:
        record = fanin_tools.reset()
        sid = await env.submit("t")
        snap = await env.load(sid)
        assert snap.state is S.SUSPENDED and len(snap.waits) == 3
        [group] = snap.fan_ins
        assert {w.group_id for w in snap.waits} == {group.group_id}
        assert len({w.correlation_id for w in snap.waits}) == 3
        assert {w.epoch for w in snap.waits} == {snap.epoch}
        assert sorted(record.dispatched) == [f"acme:quote:{v}:1" for v in VENDORS]
        for w in snap.waits:
            assert await bound(env, w), "every member routes to the session"
        # out of order: c, a, then b
        for vendor, price in (("c", 30), ("a", 10)):
            await answer(env, sid, member(snap, vendor), price)
            mid = await env.load(sid)
            assert mid.state is S.SUSPENDED and tool_messages(mid) == []
            assert not await bound(env, member(snap, vendor))
        await answer(env, sid, member(snap, "b"), 20)
        done = await env.load(sid)
        assert done.state is S.COMPLETED
        assert done.result == {"a": {"price": 10}, "b": {"price": 20}, "c": {"price": 30}}
        # one tool result per call, in the order of the calls, not of the answers
        assert [c for c, _ in tool_messages(done)] == ["call_q_1_0", "call_q_1_1", "call_q_1_2"]
        assert done.fan_ins == [] and done.waits == []
        assert record.compensated == [], "nothing left open to undo"


async def test_any_takes_the_first_quote_and_compensates_the_others_once() -> None:
    async with open_env({"t": tool_agent({"condition": "any"})}) as env:
        record = fanin_tools.reset()
        sid = await env.submit("t")
        snap = await env.load(sid)
        assert snap.state is S.SUSPENDED and len(snap.waits) == 3
        await answer(env, sid, member(snap, "b"), 20)
        done = await env.load(sid)
        assert done.state is S.COMPLETED
        assert done.result == {
            "condition": "any",
            "needed": 1,
            "met": True,
            "answers": {"b": {"price": 20}},
            "failed": {},
            "expired": [],
            "cancelled": ["a", "c"],
        }
        [(call_id, _)] = tool_messages(done)
        assert call_id == "call_q_1_0", "one aggregated result for the one call"
        assert sorted(a for a, _, _ in record.compensated) == ["quote:a", "quote:c"]
        assert {k for _, _, k in record.compensated} == {
            "acme:quote:a:1:compensate",
            "acme:quote:c:1:compensate",
        }
        for vendor in VENDORS:
            assert not await bound(env, member(snap, vendor))
        # a late answer to a closed member is observed, never applied, never undone again
        await answer(env, sid, member(snap, "a"), 5)
        await env.runtime.activate(sid, reason=Reason.RETRY)
        after = await env.load(sid)
        assert after.result == done.result
        assert after.observations[-1].reason is ObservationReason.LATE
        assert len(record.compensated) == 2


async def test_n_of_m_waits_for_the_quorum_and_dedups_a_member() -> None:
    async with open_env({"t": tool_agent({"condition": "n_of_m", "n": 2})}) as env:
        record = fanin_tools.reset()
        sid = await env.submit("t")
        snap = await env.load(sid)
        assert await answer(env, sid, member(snap, "c"), 30, event_id="c-1")
        # the same delivery again: absorbed by the inbox
        assert not await answer(env, sid, member(snap, "c"), 30, event_id="c-1")
        # the same member again under a new id: observed as a duplicate, not counted
        await answer(env, sid, member(snap, "c"), 31, event_id="c-2")
        mid = await env.load(sid)
        assert mid.state is S.SUSPENDED
        assert mid.observations[-1].reason is ObservationReason.DUPLICATE
        [group] = mid.fan_ins
        assert [m.status.value for m in group.members] == ["open", "open", "answered"]
        await answer(env, sid, member(snap, "a"), 10)
        done = await env.load(sid)
        assert done.state is S.COMPLETED
        assert done.result is not None and done.result["answers"] == {  # type: ignore[index,call-overload]
            "a": {"price": 10},
            "c": {"price": 30},
        }
        assert [a for a, _, _ in record.compensated] == ["quote:b"]


async def test_each_member_answer_is_gated_on_its_own() -> None:
    async with open_env({"t": tool_agent({"condition": "any"})}) as env:
        fanin_tools.reset()
        sid = await env.submit("t")
        snap = await env.load(sid)
        a = member(snap, "a")
        old = a.model_copy(update={"epoch": a.epoch - 1})
        await answer(env, sid, old, 1, event_id="old-epoch")
        await env.control.deliver(
            InboxEvent.answering(
                a,
                kind=EventKind.CALLBACK,
                session_id=sid,
                source="stranger",
                event_id="wrong-source",
                type="vendor.quote",
                received_at=env.clock.now(),
                data={"price": 0},
            )
        )
        mid = await env.load(sid)
        assert mid.state is S.SUSPENDED and len(mid.waits) == 3
        assert [o.reason for o in mid.observations] == [
            ObservationReason.STALE,
            ObservationReason.UNEXPECTED,
        ]
        await answer(env, sid, a, 10)
        assert (await env.load(sid)).state is S.COMPLETED


async def test_an_expired_member_under_fail_all_times_the_whole_wait_out() -> None:
    agents = {"t": tool_agent({"condition": "any"}, sla={"b": 60})}
    async with open_env(agents) as env:
        record = fanin_tools.reset()
        sid = await env.submit("t")
        snap = await env.load(sid)
        env.clock.advance(61)
        await env.runtime.activate(sid, reason=Reason.TIMEOUT)
        done = await env.load(sid)
        assert done.state is S.TIMED_OUT
        assert done.error is not None and done.error.code == "sla_expired"
        assert done.fan_ins == []
        assert sorted(a for a, _, _ in record.compensated) == [f"quote:{v}" for v in VENDORS]
        for vendor in VENDORS:
            assert not await bound(env, member(snap, vendor))


async def test_an_expired_member_under_proceed_resolves_all_with_what_arrived() -> None:
    fan_in = {"condition": "all", "on_expiry": "proceed_with_arrived"}
    async with open_env({"t": tool_agent(fan_in, sla={"b": 60})}) as env:
        record = fanin_tools.reset()
        sid = await env.submit("t")
        snap = await env.load(sid)
        await answer(env, sid, member(snap, "a"), 10)
        env.clock.advance(61)
        await env.runtime.activate(sid, reason=Reason.TIMEOUT)
        done = await env.load(sid)
        assert done.state is S.COMPLETED
        assert done.result == {
            "condition": "all",
            "needed": 3,
            "met": False,
            "answers": {"a": {"price": 10}},
            "failed": {},
            "expired": ["b"],
            "cancelled": ["c"],
        }
        assert sorted((a, why) for a, why, _ in record.compensated) == [
            ("quote:b", "deadline passed"),
            ("quote:c", "fan-in resolved"),
        ]
        assert not await bound(env, member(snap, "b"))


async def test_an_expired_member_under_proceed_leaves_any_waiting_for_the_others() -> None:
    fan_in = {"condition": "any", "on_expiry": "proceed_with_arrived"}
    async with open_env({"t": tool_agent(fan_in, sla={"a": 60})}) as env:
        fanin_tools.reset()
        sid = await env.submit("t")
        snap = await env.load(sid)
        env.clock.advance(61)
        await env.runtime.activate(sid, reason=Reason.TIMEOUT)
        mid = await env.load(sid)
        assert mid.state is S.SUSPENDED and len(mid.waits) == 2
        assert not await bound(env, member(snap, "a")), "its SLA entry is gone"
        await answer(env, sid, member(snap, "c"), 30)
        done = await env.load(sid)
        assert done.state is S.COMPLETED
        assert done.result is not None
        assert done.result["expired"] == ["a"]  # type: ignore[index,call-overload]
        assert done.result["answers"] == {"c": {"price": 30}}  # type: ignore[index,call-overload]


async def test_an_expired_members_request_is_undone_while_its_group_waits_for_the_others() -> None:
    """The session goes on without the expired member: its request is compensated at once,
    as a lone wait's is when its SLA passes, not left open on the far side."""
    fan_in = {"condition": "any", "on_expiry": "proceed_with_arrived"}
    async with open_env({"t": tool_agent(fan_in, sla={"a": 60})}) as env:
        record = fanin_tools.reset()
        sid = await env.submit("t")
        snap = await env.load(sid)
        env.clock.advance(61)
        await env.runtime.activate(sid, reason=Reason.TIMEOUT)
        assert (await env.load(sid)).state is S.SUSPENDED
        assert [(a, why) for a, why, _ in record.compensated] == [("quote:a", "deadline passed")]
        await answer(env, sid, member(snap, "c"), 30)
        assert (await env.load(sid)).state is S.COMPLETED
        assert [(a, why) for a, why, _ in record.compensated] == [
            ("quote:a", "deadline passed"),
            ("quote:b", "fan-in resolved"),
        ], "a is undone once; b, closed by c's answer, as before"


async def test_turn_level_fan_in_is_configured_per_agent() -> None:
    async with open_env({"t": turn_agent({"condition": "any"})}) as env:
        record = fanin_tools.reset()
        sid = await env.submit("t")
        snap = await env.load(sid)
        await answer(env, sid, member(snap, "b"), 20)
        done = await env.load(sid)
        assert done.state is S.COMPLETED
        cancelled = {"fan_in": {"outcome": "cancelled", "reason": "condition resolved"}}
        assert done.result == {"a": cancelled, "b": {"price": 20}, "c": cancelled}
        assert sorted(a for a, _, _ in record.compensated) == ["quote:a", "quote:c"]


async def test_answers_in_one_activation_resolve_the_group_once() -> None:
    """Two answers land before the session wakes: the first meets ``any``, the second is
    a late answer to a closed member."""
    async with open_env({"t": tool_agent({"condition": "any"})}) as env:
        record = fanin_tools.reset()
        sid = await env.submit("t")
        snap = await env.load(sid)
        for vendor, price in (("c", 30), ("a", 10)):
            event = InboxEvent.answering(
                member(snap, vendor),
                kind=EventKind.CALLBACK,
                session_id=sid,
                source="vendor",
                event_id=f"evt-{vendor}",
                type="vendor.quote",
                received_at=env.clock.now(),
                data={"price": price},
            )
            assert await env.services.inbox.deliver(event)  # durable, no activation yet
        await env.runtime.activate(sid, reason=Reason.EVENT)
        done = await env.load(sid)
        assert done.state is S.COMPLETED
        assert done.result is not None
        assert list(done.result["answers"]) == ["c"]  # type: ignore[call-overload]
        assert done.observations[-1].reason is ObservationReason.STALE
        # a's answer arrived but was never applied: a was still open when c met the
        # condition, so it is closed (and undone) like b
        assert sorted(a for a, _, _ in record.compensated) == ["quote:a", "quote:b"]


async def test_closed_members_are_undone_when_the_group_resolves_not_when_the_session_runs() -> (
    None
):
    """A resolved group whose session still waits on another call: the compensations go
    out at once, not whenever the session next runs."""
    plan = {
        "steps": [
            {
                "id": "q",
                "calls": [
                    {
                        "tool": "quotes",
                        "args": {"vendors": VENDORS, "fan_in": {"condition": "any"}},
                    },
                    {"tool": "quote", "args": {"vendor": "z"}, "as": "z"},
                ],
            },
            {"id": "done", "finish": {"q": "${results.q}", "z": "${results.z}"}},
        ]
    }
    async with open_env({"t": plan_agent(plan, {QUOTES: {}, QUOTE: {}})}) as env:
        record = fanin_tools.reset()
        sid = await env.submit("t")
        snap = await env.load(sid)
        assert len(snap.waits) == 4 and len(snap.fan_ins) == 1
        await answer(env, sid, member(snap, "a"), 10)
        mid = await env.load(sid)
        assert mid.state is S.SUSPENDED and [w.request["vendor"] for w in mid.waits] == ["z"]
        assert sorted(a for a, _, _ in record.compensated) == ["quote:b", "quote:c"]
        assert [m.tool_call_id for m in mid.messages if m.role == "tool"] == ["call_q_1_0"]
        await answer(env, sid, member(snap, "z"), 99)
        done = await env.load(sid)
        assert done.state is S.COMPLETED and done.result is not None
        assert done.result["z"] == {"price": 99}  # type: ignore[index,call-overload]
        assert len(record.compensated) == 2


async def test_a_member_whose_request_fails_counts_as_failed_not_as_an_answer() -> None:
    agents = {
        "any": tool_agent({"condition": "any"}, refuse=["b"]),
        "all": tool_agent({"condition": "all"}, refuse=["b"]),
    }
    async with open_env(agents) as env:
        record = fanin_tools.reset()
        waiting = await env.submit("any")
        snap = await env.load(waiting)
        assert snap.state is S.SUSPENDED and len(snap.waits) == 2, "a and c may still answer"
        [group] = snap.fan_ins
        assert [m.status.value for m in group.members] == ["open", "failed", "open"]
        await answer(env, waiting, member(snap, "c"), 30)
        done = await env.load(waiting)
        assert done.result is not None and list(done.result["failed"]) == ["b"]  # type: ignore[call-overload]
        assert done.result["answers"] == {"c": {"price": 30}}  # type: ignore[index,call-overload]
        # all: one refused member makes the condition unmeetable at once
        record.compensated.clear()
        failed = await env.load(await env.submit("all"))
        assert failed.state is S.COMPLETED and failed.result is not None
        assert failed.result["met"] is False  # type: ignore[index,call-overload]
        assert failed.result["cancelled"] == ["a", "c"]  # type: ignore[index,call-overload]
        assert sorted(a for a, _, _ in record.compensated) == ["quote:a", "quote:c"]


async def test_cancelling_the_session_undoes_every_open_member_once() -> None:
    async with open_env({"t": tool_agent({"condition": "n_of_m", "n": 2})}) as env:
        record = fanin_tools.reset()
        sid = await env.submit("t")
        snap = await env.load(sid)
        await answer(env, sid, member(snap, "a"), 10)
        await env.control.cancel(sid)
        done = await env.load(sid)
        assert done.state is S.CANCELLED and done.fan_ins == [] and done.waits == []
        assert sorted(a for a, _, _ in record.compensated) == ["quote:b", "quote:c"]
        for vendor in VENDORS:
            assert not await bound(env, member(snap, vendor))


async def test_a_left_over_binding_of_a_closed_member_is_unbound_without_waking_the_session() -> (
    None
):
    """The process died between the commit that closed a member and its unbind: at the
    member's deadline the sweep removes the binding instead of waking the session."""
    agents = {"t": tool_agent({"condition": "n_of_m", "n": 2}, sla={"a": 60})}
    async with open_env(agents) as env:
        fanin_tools.reset()
        sid = await env.submit("t")
        snap = await env.load(sid)
        a = member(snap, "a")
        await answer(env, sid, a, 10)
        mid = await env.load(sid)
        grace = env.services.config.binding_grace
        await env.services.index.bind_wait(
            binding_of(mid, a), business_key=None, grace=grace, now=env.clock.now()
        )
        env.clock.advance(61)
        report = await Sweeper(env.control).sweep_once()
        assert report.timeouts == 0 and not await bound(env, a)
        after = await env.load(sid)
        assert after.generation == mid.generation and after.state is S.SUSPENDED
        assert await bound(env, member(snap, "b")), "the open members stay bound"


async def test_members_whose_deadlines_passed_together_all_count_as_expired() -> None:
    """Two members miss the same deadline (the plan's one SLA): both are expired, not one
    expired and the other cancelled (and undone) by whichever was looked at first."""
    fan_in = {"condition": "all", "on_expiry": "proceed_with_arrived"}
    async with open_env({"t": tool_agent(fan_in)}) as env:
        record = fanin_tools.reset()
        sid = await env.submit("t")
        snap = await env.load(sid)
        await answer(env, sid, member(snap, "a"), 10)
        env.clock.advance((member(snap, "b").deadline - env.clock.now()).total_seconds() + 1)
        await env.runtime.activate(sid, reason=Reason.TIMEOUT)
        done = await env.load(sid)
        assert done.state is S.COMPLETED and done.result is not None
        assert done.result["expired"] == ["b", "c"]  # type: ignore[index,call-overload]
        assert done.result["cancelled"] == []  # type: ignore[index,call-overload]
        assert sorted((a, why) for a, why, _ in record.compensated) == [
            ("quote:b", "deadline passed"),
            ("quote:c", "deadline passed"),
        ], "b and c are treated alike"


async def test_one_action_asked_twice_in_a_turn_opens_one_wait_not_two_under_one_key() -> None:
    """An agent repeats a call in one turn (an LLM's parallel calls often do): both ask
    for the action ``quote:a`` in one epoch, so both requests would go out under one
    business key, which the far side dedups into one request answered once. The second
    wait would never be answered and ``all`` never met; the repeat is refused instead."""
    calls = [
        {"tool": "quote", "args": {"vendor": "a"}, "as": "a"},
        {"tool": "quote", "args": {"vendor": "a"}, "as": "again"},
        {"tool": "quote", "args": {"vendor": "b"}, "as": "b"},
    ]
    plan = {
        "steps": [
            {"id": "q", "calls": calls},
            {"id": "done", "finish": {n: f"${{results.{n}}}" for n in ("a", "b")}},
        ]
    }
    async with open_env({"t": plan_agent(plan, {QUOTE: {}})}) as env:
        record = fanin_tools.reset()
        sid = await env.submit("t")
        snap = await env.load(sid)
        keys = [w.idempotency_key("acme") for w in snap.waits]
        assert sorted(keys) == ["acme:quote:a:1", "acme:quote:b:1"]
        assert sorted(record.dispatched) == ["acme:quote:a:1", "acme:quote:b:1"]
        # the far side answers each request once
        await answer(env, sid, member(snap, "a"), 10)
        await answer(env, sid, member(snap, "b"), 20)
        done = await env.load(sid)
        assert done.state is not S.SUSPENDED and done.waits == [] and done.fan_ins == []
        results = dict(tool_messages(done))
        assert results["call_q_1_0"] == {"price": 10} and results["call_q_1_2"] == {"price": 20}
        assert results["call_q_1_1"]["error"]["code"] == "action_repeated"


async def test_members_closed_by_an_activation_that_times_the_session_out_are_unbound() -> None:
    """Member a expires under ``proceed_with_arrived`` (its group then resolves, cancelling
    b and c) in the same activation as the session's other wait z times it out: every
    member closed on the way is unbound with z, not left routing answers to a session
    that no longer waits for them."""
    plan = {
        "steps": [
            {
                "id": "q",
                "calls": [
                    {
                        "tool": "quotes",
                        "args": {
                            "vendors": VENDORS,
                            "fan_in": {"condition": "all", "on_expiry": "proceed_with_arrived"},
                        },
                    },
                    {"tool": "quote", "args": {"vendor": "z"}, "as": "z"},
                ],
            },
            {"id": "done", "finish": {"q": "${results.q}", "z": "${results.z}"}},
        ]
    }
    tools = {QUOTES: {"sla": {"a": 60}}, QUOTE: {"sla": {"z": 60}}}
    async with open_env({"t": plan_agent(plan, tools)}) as env:
        fanin_tools.reset()
        sid = await env.submit("t")
        snap = await env.load(sid)
        assert len(snap.waits) == 4 and len(snap.fan_ins) == 1
        env.clock.advance(61)
        await env.runtime.activate(sid, reason=Reason.TIMEOUT)
        done = await env.load(sid)
        assert done.state is S.TIMED_OUT and done.waits == []
        for vendor in [*VENDORS, "z"]:
            assert not await bound(env, member(snap, vendor)), vendor


async def test_a_member_answered_in_the_activation_a_drift_ends_is_unbound() -> None:
    """a's answer and b's land before the session wakes; b's guard finds drift under
    ``compensate`` and ends the session. a, recorded in its group just before, is unbound
    with the rest: left bound, a second answer to it would still route to a session that
    failed."""
    agents = {"t": tool_agent({"condition": "all"}, drifted=["b"])}
    async with open_env(agents) as env:
        fanin_tools.reset()
        sid = await env.submit("t")
        snap = await env.load(sid)
        for vendor, price in (("a", 10), ("b", 20)):
            event = InboxEvent.answering(
                member(snap, vendor),
                kind=EventKind.CALLBACK,
                session_id=sid,
                source="vendor",
                event_id=f"evt-{vendor}",
                type="vendor.quote",
                received_at=env.clock.now(),
                data={"price": price},
            )
            assert await env.services.inbox.deliver(event)  # durable, no activation yet
            env.clock.advance(1)  # a's first: the inbox hands events over as received
        await env.runtime.activate(sid, reason=Reason.EVENT)
        done = await env.load(sid)
        assert done.state is S.FAILED and done.error is not None
        assert done.error.code == "state_drift"
        for vendor in VENDORS:
            assert not await bound(env, member(snap, vendor)), vendor


async def test_an_answer_to_an_expired_member_is_observed_late_not_as_a_duplicate() -> None:
    """a expired under ``proceed_with_arrived`` and its group waits on b and c: a's
    answer, arriving now, came after its deadline. No answer of a's was ever recorded, so
    it is late; a duplicate would claim one had been."""
    fan_in = {"condition": "any", "on_expiry": "proceed_with_arrived"}
    async with open_env({"t": tool_agent(fan_in, sla={"a": 60})}) as env:
        fanin_tools.reset()
        sid = await env.submit("t")
        snap = await env.load(sid)
        env.clock.advance(61)
        await env.runtime.activate(sid, reason=Reason.TIMEOUT)
        mid = await env.load(sid)
        [group] = mid.fan_ins
        assert [m.status.value for m in group.members] == ["expired", "open", "open"]
        await answer(env, sid, member(snap, "a"), 10)
        after = await env.load(sid)
        assert after.state is S.SUSPENDED and after.fan_ins == mid.fan_ins
        assert after.observations[-1].reason is ObservationReason.LATE


async def test_a_member_answered_before_a_guard_retry_is_unbound() -> None:
    """a's answer and b's land before the session wakes; b's guard cannot read the
    vendor's state, so the activation checkpoints and ends to retry later. a, closed in
    that checkpoint, is unbound with it: no later activation knows to unbind it."""
    agents = {"t": tool_agent({"condition": "all"}, unreadable=["b"])}
    async with open_env(agents) as env:
        fanin_tools.reset()
        sid = await env.submit("t")
        snap = await env.load(sid)
        for vendor, price in (("a", 10), ("b", 20)):
            event = InboxEvent.answering(
                member(snap, vendor),
                kind=EventKind.CALLBACK,
                session_id=sid,
                source="vendor",
                event_id=f"evt-{vendor}",
                type="vendor.quote",
                received_at=env.clock.now(),
                data={"price": price},
            )
            assert await env.services.inbox.deliver(event)  # durable, no activation yet
            env.clock.advance(1)  # a's first: the inbox hands events over as received
        await env.runtime.activate(sid, reason=Reason.EVENT)
        mid = await env.load(sid)
        assert mid.retry.used == 1 and [w.request["vendor"] for w in mid.waits] == ["b", "c"]
        assert not await bound(env, member(snap, "a"))
        assert await bound(env, member(snap, "b")), "b still waits for its retry"
