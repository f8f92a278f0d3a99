"""Every ``torpor_*`` metric, driven through the path that records it and read back.

The services run in one process on real storage (Redis, a local folder) with the observer
the Ray actors use (``RayObserver``); ``metrics.tap()`` reads what was recorded, by the
exported name. A test at the end checks that no metric is left untested.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from actors import metrics
from actors.observer import RayObserver
from actors.wiring import session_runtime
from storage import wal
from storage.local_store import LocalObjectStore
from tests.conftest import eventually
from tests.faults.test_dead_letters import exhaust_the_compensation
from tests.runtime.test_notifications import finished_session
from tests.storage.test_write_ahead_log import fail_a_checkpoint_in_another_process
from tests.support.harness import Env, callback, local_env
from tests.support.receiver import Receiver
from torpor.errors import StorageUnavailable, WebhookRejected
from torpor.lifecycle import SessionState
from torpor.ports import Reason
from torpor.service.coalescing import Coalescer, Fallback
from torpor.service.deliveries import DeliveryWorker
from torpor.service.gateway import WebhookGateway
from torpor.service.sweeper import Sweeper
from torpor.webhooks.signing import Scheme, generate_secret, sign

SECRET = generate_secret(Scheme.TORPOR)
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
TESTED: set[str] = set()


def tested(*names: str) -> None:
    TESTED.update(names)


@pytest.fixture
async def env(tmp_path: Path, redis_url: str, redis_prefix: str) -> AsyncIterator[Env]:
    extra = {"sources": SOURCES}
    async with local_env(
        tmp_path, redis_url, redis_prefix, extra=extra, sla_s=60, compensate_gate="undo-up"
    ) as e:
        e.services.observer = RayObserver()
        yield e


def hook(correlation_id: str, event_id: str) -> bytes:
    return json.dumps(
        {
            "eventId": event_id,
            "eventType": "oa.approval.decided",
            "correlationId": correlation_id,
            "decision": {"status": "approved"},
        }
    ).encode()


async def test_a_webhook_that_completes_a_session(env: Env) -> None:
    gateway = WebhookGateway(env.control)
    with metrics.tap() as read:
        sid = await env.submit()
        snap = await env.load(sid)
        wait = snap.waits[0]
        env.clock.advance(2)
        raw = hook(wait.correlation_id, "e1")

        def signed() -> dict[str, str]:  # each delivery attempt is signed afresh
            headers = sign(Scheme.TORPOR, raw, SECRET, now=env.clock.now())
            return {**headers, "Content-Type": "application/json"}

        assert (await gateway.receive("oa", raw, signed(), now=env.clock.now())).status == 202
        env.clock.advance(1)  # the sender's retry, a second later
        assert (await gateway.receive("oa", raw, signed(), now=env.clock.now())).status == 200
        with pytest.raises(WebhookRejected):
            await gateway.receive(
                "oa", raw, {"Content-Type": "application/json"}, now=env.clock.now()
            )
    assert (await env.load(sid)).state is SessionState.COMPLETED
    webhooks = "torpor_webhooks_total"
    assert read.counter(webhooks, source="oa", outcome="accepted") == 1
    assert read.counter(webhooks, source="oa", outcome="duplicate") == 1
    assert read.counter(webhooks, outcome="rejected", reason="missing_signature") == 1
    assert read.counter("torpor_events_total", verdict="applied", reason="callback") == 1
    assert read.counter("torpor_session_transitions_total", state="SUSPENDED") == 1
    assert read.counter("torpor_session_transitions_total", state="COMPLETED") == 1
    # the approval request went out in the activation that recorded it: lag 0 on the
    # manual clock, one observation per dispatched entry
    assert read.observations("torpor_outbox_lag_seconds", kind="start") == [0.0]
    tested(
        webhooks,
        "torpor_events_total",
        "torpor_session_transitions_total",
        "torpor_outbox_lag_seconds",
    )


@pytest.mark.parametrize("failing", ["inbox event", "audit record"])
async def test_a_webhook_answered_5xx_is_counted_once_as_the_error(
    env: Env, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    """Its inbox write failed, or its event was staged in the inbox and its audit record
    then failed: the sender is answered 503 and retries. The second was counted
    "accepted" at the inbox write and then "error", one webhook twice, an accept rate
    that counted what was not acknowledged."""
    gateway = WebhookGateway(env.control)
    sid = await env.submit()
    wait = (await env.load(sid)).waits[0]
    raw = hook(wait.correlation_id, "e1")
    headers = {**sign(Scheme.TORPOR, raw, SECRET, now=env.clock.now())}
    headers["Content-Type"] = "application/json"

    async def down(*_: object, **__: object) -> None:
        raise StorageUnavailable("the object store does not answer")

    if failing == "inbox event":
        monkeypatch.setattr(env.services.inbox, "stage", down)
    else:
        monkeypatch.setattr(env.services.audit, "append", down)
    with metrics.tap() as read, pytest.raises(StorageUnavailable):
        await gateway.receive("oa", raw, headers, now=env.clock.now())
    stored = await env.services.inbox.pending(sid, processed=())
    assert len(stored) == (failing == "audit record")  # the inbox took it, or not
    assert read.counter("torpor_webhooks_total", outcome="accepted") == 0
    assert read.counter("torpor_webhooks_total", outcome="error", reason="StorageUnavailable") == 1


async def test_an_answer_to_a_replaced_wait_is_observed_as_stale(env: Env) -> None:
    with metrics.tap() as read:
        sid = await env.submit()
        await env.world.set_version("PR-1", "v2")  # drift: the plan asks again (epoch 3)
        await env.answer(sid, {"status": "approved"}, event_id="a1")
        assert (await env.load(sid)).waits[0].epoch == 3
        await env.answer(sid, {"status": "approved"}, event_id="late", epoch=1)
    assert read.counter("torpor_events_total", verdict="observed") == 1
    assert read.counter("torpor_events_total", verdict="applied") == 1


async def test_a_blocked_drift_is_a_security_alert(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    async with local_env(tmp_path, redis_url, redis_prefix, on_drift="block") as env:
        env.services.observer = RayObserver()
        with metrics.tap() as read:
            sid = await env.submit()
            await env.world.set_version("PR-1", "v9")
            await env.answer(sid, {"status": "approved"})
    assert read.counter("torpor_security_alerts_total", tool="request_approval") == 1
    tested("torpor_security_alerts_total")


async def test_an_activation_records_its_outcome_and_resume_latency(env: Env) -> None:
    sid = await env.submit()
    wait = (await env.load(sid)).waits[0]
    answer = callback(sid, wait, event_id="e1", data={"status": "approved"}, at=env.clock.now())
    await env.services.inbox.deliver(answer)  # in the inbox, not yet activated
    with metrics.tap() as read:
        result = await session_runtime(env.services, "metrics").activate(
            sid, reason=Reason.EVENT, requested_at=time.time()
        )
        metrics.activation(result, placement="dedicated")  # what the session actor does
    assert read.counter("torpor_commits_total", outcome=result.outcome.value) == 1
    assert result.outcome.value == "ran"
    [latency] = read.observations("torpor_resume_latency_seconds", placement="dedicated")
    assert latency >= 0
    tested("torpor_commits_total", "torpor_resume_latency_seconds")


async def test_a_compensation_that_gives_up_counts_a_dead_letter(env: Env) -> None:
    with metrics.tap() as read:
        await exhaust_the_compensation(env)
    assert read.counter("torpor_dead_letters_total", kind="compensate") == 1
    tested("torpor_dead_letters_total")


async def test_a_sweep_records_its_time_duration_suspended_and_failing_steps(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    await env.submit()
    with metrics.tap() as read:
        report = await Sweeper(env.control).sweep_once()
        metrics.sweep(report)  # what the reconciler actor does with the report
    assert read.gauge("torpor_reconciler_last_sweep_timestamp_seconds") == pytest.approx(
        env.clock.now().timestamp()
    )
    assert len(read.observations("torpor_reconciler_sweep_seconds")) == 1
    assert read.gauge("torpor_suspended_sessions") == 1

    async def broken(**_: object) -> list[object]:
        raise RuntimeError("a bug in one step")

    monkeypatch.setattr(env.services.index, "due_deadlines", broken)
    with metrics.tap() as read:
        await Sweeper(env.control).sweep_once()
    assert read.counter("torpor_sweep_step_failures_total", step="deadlines") == 1
    tested(
        "torpor_reconciler_last_sweep_timestamp_seconds",
        "torpor_reconciler_sweep_seconds",
        "torpor_suspended_sessions",
        "torpor_sweep_step_failures_total",
    )


async def test_a_sweep_records_whether_the_object_store_reports_trouble(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process's checkpoint failed its flush: the local folder's log no longer
    checkpoints, /healthz says so among its warnings, and the gauge the alert
    (TorporObjectStoreTrouble) reads goes from 0 to 1 at the next sweep."""
    monkeypatch.setattr(wal, "AGE_POLL_S", 0.05)
    store = env.services.store
    assert isinstance(store, LocalObjectStore)
    with metrics.tap() as read:
        metrics.sweep(await Sweeper(env.control).sweep_once())
    assert read.gauge("torpor_object_store_trouble") == 0
    await asyncio.to_thread(fail_a_checkpoint_in_another_process, store.root)
    await eventually(lambda: store.trouble() is not None, what="the store learns of it")
    with metrics.tap() as read:
        report = await Sweeper(env.control).sweep_once()
        metrics.sweep(report)
    assert report.store_trouble is not None and "not checkpointing" in report.store_trouble
    assert read.gauge("torpor_object_store_trouble") == 1
    tested("torpor_object_store_trouble")


async def test_a_notification_attempt_is_counted_by_outcome(env: Env) -> None:
    hook = Receiver(script=[500, 200])
    try:
        await finished_session(env, hook.url)
        worker = DeliveryWorker(env.services)
        with metrics.tap() as read:
            await worker.due(env.clock.now())
            env.clock.advance(7)
            await worker.due(env.clock.now())
    finally:
        hook.close()
    assert read.counter("torpor_notifications_total", outcome="pending") == 1
    assert read.counter("torpor_notifications_total", outcome="delivered") == 1
    tested("torpor_notifications_total")


async def test_an_activation_over_the_inflight_limit_is_deferred(env: Env) -> None:
    class Never:
        async def request(
            self, session_id: str, *, reason: Reason, agent: str | None = None
        ) -> None:
            raise AssertionError("over the limit nothing is sent")

    coalescer = Coalescer(Never(), max_inflight=0, fallback=Fallback.of(env.services))
    with metrics.tap() as read:
        coalescer.request("s_1", Reason.EVENT, None)
        await coalescer.drain()
    assert read.counter("torpor_activations_deferred_total", reason="backpressure") == 1
    tested("torpor_activations_deferred_total")


# Recorded only where standby session actors run, on a real Ray: read back (started,
# lost, inherited) in tests/ray/test_standby.py.
tested("torpor_standby_actors_total")


def test_every_metric_has_a_test_above() -> None:
    # runs last in this module (pytest keeps file order)
    assert {spec.name for spec in metrics.SPECS.values()} == TESTED
