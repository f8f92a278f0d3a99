"""SessionRuntime end to end in one process: real local store, real Redis, no Ray."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from actors.wiring import session_runtime
from tests.support.harness import Env, callback, local_env
from torpor.errors import (
    IdempotencyInProgress,
    IdempotencyMismatch,
    InvalidRequest,
    UnknownAgent,
)
from torpor.events import EventKind, InboxEvent
from torpor.lifecycle import SessionState
from torpor.models import ObservationReason
from torpor.ports import Reason
from torpor.service.batches import BatchService
from torpor.service.sessions import SessionService
from torpor.session import ActivationOutcome

S = SessionState
MakeEnv = Callable[..., AbstractAsyncContextManager[Env]]


@pytest.fixture
def make_env(tmp_path: Path, redis_url: str, redis_prefix: str) -> MakeEnv:
    def make(**approval: Any) -> AbstractAsyncContextManager[Env]:
        return local_env(tmp_path, redis_url, redis_prefix, **approval)

    return make


@pytest.fixture
async def env(make_env: MakeEnv) -> AsyncIterator[Env]:
    async with make_env() as e:
        yield e


async def test_suspends_on_long_running_tool_and_binds_the_callback(env: Env) -> None:
    sid = await env.submit()
    snap = await env.load(sid)
    assert snap.state is S.SUSPENDED
    [wait] = snap.waits
    assert wait.tool_name == "request_approval" and wait.epoch == snap.epoch == 1
    binding = await env.services.index.resolve(
        tenant="acme", now=env.clock.now(), correlation_id=wait.correlation_id
    )
    assert binding is not None and binding.session_id == sid
    by_key = await env.services.index.resolve(
        tenant="acme", now=env.clock.now(), business_key="PR-1"
    )
    assert by_key == binding
    assert await env.services.correlations.lookup(wait.correlation_id) == binding
    # dispatched once, with the business idempotency key tenant:action_key:epoch
    assert await env.world.counts("dispatch") == {"acme:approve:PR-1:1": 1}
    [outbox] = snap.outbox
    assert outbox.status == "dispatched"
    dispatched = (await env.world.entries("dispatch"))["acme:approve:PR-1:1"]
    assert dispatched["token"], "a capability token goes with the request"


async def test_callback_resumes_and_completes(env: Env) -> None:
    sid = await env.submit()
    cid = (await env.load(sid)).waits[0].correlation_id
    assert await env.answer(sid, {"status": "approved", "approver": "u-17"})
    snap = await env.load(sid)
    assert snap.state is S.COMPLETED
    assert snap.result == {"decision": "approved", "doc": "PR-1"}
    assert snap.epoch == 2 and snap.waits == []
    assert (
        await env.services.index.resolve(tenant="acme", now=env.clock.now(), correlation_id=cid)
        is None
    )
    tool_messages = [m for m in snap.messages if m.role == "tool"]
    assert tool_messages[-1].tool_call_id == "call_approve_1_0"
    assert [h.state for h in snap.history] == [
        S.RUNNING,
        S.SUSPENDED,
        S.RESUMING,
        S.RUNNING,
        S.COMPLETED,
    ]


async def test_duplicate_delivery_is_absorbed(env: Env) -> None:
    sid = await env.submit()
    wait = (await env.load(sid)).waits[0]
    event = callback(sid, wait, event_id="evt-1", data={"status": "approved"}, at=env.clock.now())
    assert await env.control.deliver(event)
    done = await env.load(sid)
    assert done.state is S.COMPLETED
    assert not await env.control.deliver(event)  # the same delivery again: a no-op
    assert (await env.load(sid)).generation == done.generation


async def test_same_decision_delivered_twice_with_new_ids_applies_once(env: Env) -> None:
    sid = await env.submit()
    wait = (await env.load(sid)).waits[0]
    await env.answer(sid, {"status": "approved"}, event_id="evt-1")
    done = await env.load(sid)
    # The sender retries with a new delivery id: the wait is closed, so it is stale.
    await env.control.deliver(
        callback(sid, wait, event_id="evt-2", data={"status": "rejected"}, at=env.clock.now())
    )
    after = await env.load(sid)
    assert after.state is S.COMPLETED and after.result == done.result
    assert after.observations[-1].reason is ObservationReason.LATE


async def test_stale_epoch_is_observed_not_applied(env: Env) -> None:
    sid = await env.submit()
    before = await env.load(sid)
    await env.answer(sid, {"status": "rejected"}, event_id="old", epoch=before.epoch - 1)
    after = await env.load(sid)
    assert after.state is S.SUSPENDED
    assert after.waits == before.waits and after.messages == before.messages
    assert after.observations[-1].reason is ObservationReason.STALE
    # the real answer still works afterwards
    await env.answer(sid, {"status": "approved"}, event_id="new")
    assert (await env.load(sid)).state is S.COMPLETED


async def test_unexpected_event_type_is_observed(env: Env) -> None:
    sid = await env.submit()
    await env.answer(sid, {"status": "approved"}, type="oa.comment.added")
    snap = await env.load(sid)
    assert snap.state is S.SUSPENDED
    assert snap.observations[-1].reason is ObservationReason.UNEXPECTED


async def test_sla_expiry_times_out_and_compensates_once(make_env: MakeEnv) -> None:
    async with make_env(sla_s=60) as env:
        sid = await env.submit()
        env.clock.advance(61)
        runtime = session_runtime(env.services, "sweeper")
        await asyncio.gather(*(runtime.activate(sid, reason=Reason.TIMEOUT) for _ in range(3)))
        await runtime.activate(sid, reason=Reason.TIMEOUT)
        snap = await env.load(sid)
        assert snap.state is S.TIMED_OUT and snap.error and snap.error.code == "sla_expired"
        assert await env.world.counts("compensate") == {"acme:approve:PR-1:1:compensate": 1}
        # a callback that comes after the deadline cannot revive it
        assert (
            await env.services.index.resolve(
                tenant="acme", now=env.clock.now(), business_key="PR-1"
            )
            is None
        )


LAST_DAY = datetime(9999, 12, 31, tzinfo=UTC)
# SLAs, from now, that no index can hold a deadline for.
UNHOLDABLE_SLAS: dict[str, Callable[[datetime], float]] = {
    "past 9999": lambda now: 1e12,
    "within the grace of 9999": lambda now: (LAST_DAY - timedelta(days=2) - now).total_seconds(),
    "before 1970": lambda now: -(now - datetime(1960, 1, 1, tzinfo=UTC)).total_seconds(),
    "inf": lambda now: float("inf"),
    "nan": lambda now: float("nan"),
}


@pytest.mark.parametrize("when", list(UNHOLDABLE_SLAS))
async def test_an_sla_no_deadline_can_hold_is_the_calls_error_not_a_crash(
    make_env: MakeEnv, when: str
) -> None:
    """An SLA that reaches past year 9999, or within the binding grace of it, before 1970,
    or that is not a number, made no storable deadline: the activation crashed
    (OverflowError) before or after the commit that opened the wait, or, before 1970, the
    bind never returned. It is refused where the tool makes its plan: the call's answer
    is the error."""
    async with make_env(sla_s=UNHOLDABLE_SLAS[when](datetime.now(UTC))) as env:
        sid = await env.submit()
        snap = await env.load(sid)
        assert not snap.waits and snap.state is not S.QUARANTINED
        answers = [m.content or "" for m in snap.messages if m.role == "tool"]
        assert answers and "sla_s" in answers[-1]


async def test_callback_received_after_deadline_times_out(make_env: MakeEnv) -> None:
    async with make_env(sla_s=60) as env:
        sid = await env.submit()
        env.clock.advance(120)
        await env.answer(sid, {"status": "approved"})
        assert (await env.load(sid)).state is S.TIMED_OUT


async def test_drift_replans_with_a_fresh_wait(env: Env) -> None:
    sid = await env.submit()
    first = (await env.load(sid)).waits[0]
    await env.world.set_version("PR-1", "v2")  # the budget moved while the session slept
    await env.answer(sid, {"status": "approved"}, event_id="a1")
    snap = await env.load(sid)
    assert snap.state is S.SUSPENDED, "the plan branched back to approval"
    [second] = snap.waits
    assert second.correlation_id != first.correlation_id and second.epoch == 3
    assert second.guard and second.guard.version_tag == "v2"
    drift = [
        m.content for m in snap.messages if m.role == "tool" and m.content and "drift" in m.content
    ]
    assert drift, "the agent received a drift notice as the tool result"
    assert await env.world.counts("dispatch") == {
        "acme:approve:PR-1:1": 1,
        "acme:approve:PR-1:3": 1,
    }
    await env.answer(sid, {"status": "approved"}, event_id="a2")
    assert (await env.load(sid)).result == {"decision": "approved", "doc": "PR-1"}


async def test_drift_with_compensate_policy_undoes_and_fails(make_env: MakeEnv) -> None:
    async with make_env(on_drift="compensate") as env:
        sid = await env.submit()
        await env.world.set_version("PR-1", "v9")
        await env.answer(sid, {"status": "approved"})
        snap = await env.load(sid)
        assert snap.state is S.FAILED and snap.error and snap.error.code == "state_drift"
        assert await env.world.counts("compensate") == {"acme:approve:PR-1:1:compensate": 1}


async def test_drift_with_block_policy_writes_nothing_more(make_env: MakeEnv) -> None:
    async with make_env(on_drift="block") as env:
        sid = await env.submit()
        await env.world.set_version("PR-1", "v9")
        await env.answer(sid, {"status": "approved"})
        snap = await env.load(sid)
        assert snap.state is S.FAILED and snap.error and snap.error.code == "guard_blocked"
        assert await env.world.counts("compensate") == {}
        assert not any(
            m.role == "tool" and m.tool_call_id == "call_approve_1_0" for m in snap.messages
        )


async def test_cancel_compensates_and_is_idempotent(env: Env) -> None:
    sid = await env.submit()
    await env.control.cancel(sid)
    await env.control.cancel(sid)
    snap = await env.load(sid)
    assert snap.state is S.CANCELLED
    assert await env.world.counts("compensate") == {"acme:approve:PR-1:1:compensate": 1}


async def test_ten_concurrent_activations_commit_once(env: Env) -> None:
    sid = await env.submit()
    wait = (await env.load(sid)).waits[0]
    await env.services.inbox.deliver(
        callback(sid, wait, event_id="e", data={"status": "approved"}, at=env.clock.now())
    )
    before = (await env.load(sid)).generation
    runtimes = [session_runtime(env.services, f"host-{i}") for i in range(10)]
    results = await asyncio.gather(*(r.activate(sid) for r in runtimes))
    ran = [r for r in results if r.outcome is ActivationOutcome.RAN]
    assert len(ran) == 1 and all(
        r.outcome is ActivationOutcome.BUSY for r in results if r not in ran
    )
    snap = await env.load(sid)
    assert snap.state is S.COMPLETED
    assert snap.generation == before + 2  # exactly one activation's two commits
    assert len([m for m in snap.messages if m.role == "tool"]) == 2


class NoActivation:
    """An activator that activates nothing: the test runs the activation itself, later."""

    async def request(self, session_id: str, *, reason: Reason, agent: str | None = None) -> None:
        return None


async def test_event_arriving_before_the_wait_is_applied_on_suspend(env: Env) -> None:
    # The far side answers by business key before the session has even started, so before
    # its wait exists: no binding in the index, nothing in the snapshot to answer.
    idle = SessionService(env.services, NoActivation())
    sid = (await idle.submit(tenant="acme", agent="purchase", input={"doc": "PR-E"})).session_id
    assert (await env.load(sid)).waits == []
    early = InboxEvent.new(
        kind=EventKind.CALLBACK,
        session_id=sid,
        source="oa",
        event_id="early-1",
        type="oa.approval.decided",
        received_at=env.clock.now(),
        business_key="PR-E",
        data={"status": "approved"},
    )
    assert await env.services.inbox.deliver(early)
    # Now the session runs: extract, ask for approval, suspend, and find the answer waiting.
    await session_runtime(env.services, "host-early").activate(sid)
    snap = await env.load(sid)
    assert snap.state is S.COMPLETED
    assert snap.result == {"decision": "approved", "doc": "PR-E"}
    assert await env.world.counts("dispatch") == {"acme:approve:PR-E:1": 1}


async def test_an_answer_to_the_first_wait_does_not_close_the_replanned_one(env: Env) -> None:
    sid = await env.submit()
    first = await env.load(sid)
    # Drift makes the plan open a second wait; the answer to the first one is not its answer.
    await env.world.set_version("PR-1", "v2")
    await env.control.deliver(
        callback(
            sid, first.waits[0], event_id="a1", data={"status": "approved"}, at=env.clock.now()
        )
    )
    assert (await env.load(sid)).state is S.SUSPENDED
    assert (await env.load(sid)).epoch == 3


async def test_sync_tool_log_prevents_reruns_on_replay(env: Env) -> None:
    sid = await env.submit()
    snap = await env.load(sid)
    assert len(snap.tool_log) == 1
    counts = await env.world.counts("extract")
    assert list(counts.values()) == [1]
    assert list(counts) == list(snap.tool_log)  # the tool got H(session:step:call) as key


async def test_idempotent_submission(env: Env) -> None:
    a = await env.control.submit(
        tenant="acme", agent="purchase", input={"doc": "X"}, idempotency_key="k-1"
    )
    b = await env.control.submit(
        tenant="acme", agent="purchase", input={"doc": "X"}, idempotency_key="k-1"
    )
    assert a.created and not b.created and a.session_id == b.session_id
    with pytest.raises(IdempotencyMismatch):
        await env.control.submit(
            tenant="acme", agent="purchase", input={"doc": "Y"}, idempotency_key="k-1"
        )
    other = await env.control.submit(
        tenant="beta", agent="purchase", input={"doc": "X"}, idempotency_key="k-1"
    )
    assert other.created and other.session_id != a.session_id


async def test_submission_in_progress_is_a_conflict(env: Env) -> None:
    await env.services.index.claim_idempotency(
        tenant="acme",
        key="k-2",
        fingerprint="whatever",
        session_id="s_x",
        ttl=__import__("datetime").timedelta(hours=1),
        now=env.clock.now(),
    )
    from torpor.service.sessions import fingerprint

    fp = fingerprint({"agent": "purchase", "input": {"doc": "X"}, "metadata": {}, "callback": None})
    await env.services.index.release_idempotency(tenant="acme", key="k-2")
    await env.services.index.claim_idempotency(
        tenant="acme",
        key="k-2",
        fingerprint=fp,
        session_id="s_x",
        ttl=__import__("datetime").timedelta(hours=1),
        now=env.clock.now(),
    )
    with pytest.raises(IdempotencyInProgress):
        await env.control.submit(
            tenant="acme", agent="purchase", input={"doc": "X"}, idempotency_key="k-2"
        )


async def test_unknown_agent_is_refused(env: Env) -> None:
    with pytest.raises(UnknownAgent):
        await env.control.submit(tenant="acme", agent="nope", input={})


async def test_dispatch_failure_reaches_the_agent(make_env: MakeEnv) -> None:
    async with make_env(fail_dispatch=True) as env:
        sid = await env.submit()
        snap = await env.load(sid)
        assert snap.state is S.COMPLETED
        assert snap.result == {"decision": "error", "doc": "PR-1"}


@pytest.mark.parametrize("tenant", ["", "acme corp", "a/b"])
async def test_a_submit_for_a_tenant_no_api_tenant_could_be_is_refused_storing_nothing(
    env: Env, tenant: str
) -> None:
    """Below the entry points too (the API's tenants and a client's are checked there):
    a session or a batch for "" (the session registry's "tenant not known") or a name
    outside the storage alphabet is refused, and nothing is stored for it."""
    with pytest.raises(InvalidRequest, match="tenant"):
        await env.control.submit(tenant=tenant, agent="purchase", input={"doc": "X"})
    with pytest.raises(InvalidRequest, match="tenant"):
        await BatchService(env.control).submit(
            tenant=tenant, agent="purchase", documents=[{"doc": "X"}]
        )
    page = await env.services.index.list_sessions(tenant=tenant, state=None, cursor=None, limit=5)
    assert page.session_ids == []
    stored = await env.services.store.list("", limit=1000)
    assert stored.keys == [], stored.keys


async def test_batch_progress(env: Env) -> None:
    batches = BatchService(env.control)
    manifest = await batches.submit(
        tenant="acme", agent="purchase", documents=[{"doc": f"PR-{i}"} for i in range(5)]
    )
    progress = await batches.progress(manifest.batch_id)
    assert progress.total == 5 and progress.by_state == {"SUSPENDED": 5}
    again = await batches.submit(
        tenant="acme",
        agent="purchase",
        documents=[{"doc": f"PR-{i}"} for i in range(5)],
        batch_id=manifest.batch_id,
    )
    assert again.session_ids == manifest.session_ids  # resubmitting creates nothing twice
    for sid in manifest.session_ids[:2]:
        await env.answer(sid, {"status": "approved"})
    progress = await batches.progress(manifest.batch_id)
    assert progress.by_state == {"COMPLETED": 2, "SUSPENDED": 3} and not progress.finished
