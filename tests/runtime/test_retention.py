"""Retention: a session that ended longer ago than ``storage.retention_s`` is deleted
with every record of its own, by the sweep, and nothing a window still needs goes early.

Real Redis for the index, a local folder for objects, a manual clock for the 30 days."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from storage import audit, audit_archive, keys, retention, submit_keys
from storage.listing import all_keys
from storage.work import ObjectProgress, WorkRecords
from tests.faults.index_loss import flush_index
from tests.runtime.test_gateway import JSON, SECRET, SOURCES, body
from tests.support.harness import Env, local_env
from tests.support.receiver import Receiver
from torpor.errors import ConfigError, SessionNotFound
from torpor.events import EventKind, InboxEvent
from torpor.ids import business_idempotency_key, new_correlation_id, new_trace_id
from torpor.lifecycle import SessionState
from torpor.ports import TimerKind
from torpor.service.gateway import WebhookGateway
from torpor.service.sweeper import Sweeper
from torpor.session.runtime import lease_name
from torpor.settings import Settings
from torpor.webhooks.signing import Scheme, sign
from torpor.work import Progress, WorkOrder, work_id

DAY = 24 * 3600.0


@pytest.fixture
async def env(tmp_path: Path, redis_url: str, redis_prefix: str) -> AsyncIterator[Env]:
    async with local_env(tmp_path, redis_url, redis_prefix) as env:
        yield env


async def every_key(env: Env) -> list[str]:
    return await all_keys(env.services.store, "")


def late_callback(env: Env, sid: str, cid: str, event_id: str, digest: str) -> InboxEvent:
    """An OA answer to the closed wait ``cid``, as the gateway stores one routed CLOSED."""
    return InboxEvent.new(
        kind=EventKind.CALLBACK,
        session_id=sid,
        source="oa",
        event_id=event_id,
        type="oa.approval.decided",
        received_at=env.clock.now(),
        correlation_id=cid,
    ).model_copy(update={"content_digest": digest})


async def ended_session(env: Env, hook: Receiver) -> tuple[str, str]:
    """A completed session whose notification was delivered, with a late webhook answer
    (its replay marker too) in its inbox. Returns (session id, correlation id)."""
    sid = await env.submit(doc="PR-R", callback_url=hook.url)
    cid = (await env.load(sid)).waits[0].correlation_id
    await env.answer(sid, {"status": "approved"})
    assert (await env.load(sid)).state is SessionState.COMPLETED
    await env.control.deliver(late_callback(env, sid, cid, "evt-late", "d" * 64))
    await env.services.inbox.remember_accepted(source="oa", content_digest="d" * 64)
    swept = Sweeper(env.control)
    await swept.sweep_once()
    await swept.deliveries.drain()
    assert len(hook.received) == 1
    return sid, cid


async def test_an_ended_session_and_all_its_records_go_after_the_retention_period(
    env: Env,
) -> None:
    hook = Receiver()
    try:
        sid, cid = await ended_session(env, hook)
        sleeping = await env.submit(doc="PR-S")  # a live session: not purged
        mine = [k for k in await every_key(env) if sid in k or cid in k]
        assert {keys.snapshot(sid), keys.correlation(cid)} <= set(mine)
        assert any(k.startswith(keys.inbox_prefix(sid)) for k in mine)
        [ref] = [k for k in mine if k.startswith(keys.refs_prefix(sid) + "d/")]
        delivery_id = ref.rsplit("/", 1)[1]
        assert keys.delivery("acme", delivery_id) in await every_key(env)

        env.clock.advance(29 * DAY)
        assert (await Sweeper(env.control).sweep_once()).purged == 0
        assert (await env.load(sid)).state is SessionState.COMPLETED

        env.clock.advance(2 * DAY)
        report = await Sweeper(env.control).sweep_once()
        assert report.purged == 1 and report.errors == []
        with pytest.raises(SessionNotFound):
            await env.load(sid)
        left = [k for k in await every_key(env) if sid in k or cid in k or delivery_id in k]
        assert left == [k for k in left if k.startswith(keys.ENDED)]  # for a window more
        env.clock.advance(2 * DAY)
        await Sweeper(env.control).sweep_once()
        left = [k for k in await every_key(env) if sid in k or cid in k or delivery_id in k]
        assert left == []
        assert not await env.services.inbox.was_accepted(source="oa", content_digest="d" * 64)
        assert await env.services.correlations.lookup(cid) is None
        assert await env.services.index.session_states([sid]) == {}
        # Nor its lease's fencing counter, an index key kept for every session ever
        # leased; a live session's stays.
        fences = env.services.settings.storage.redis_prefix + "lf:"
        redis = aioredis.Redis.from_url(env.services.settings.storage.index_url)
        try:
            assert not await redis.exists(fences + lease_name(sid))
            assert await redis.exists(fences + lease_name(sleeping))
        finally:
            await redis.aclose()
        # Its one-hour SLA passed four weeks ago (no sweep ran): timed out by the sweeps
        # above, so ended only now, and kept.
        assert (await env.load(sleeping)).state is SessionState.TIMED_OUT
        assert await env.services.index.session_states([sleeping]) != {}
    finally:
        hook.close()


async def test_a_sessions_submit_key_record_goes_with_it_unless_a_later_session_took_the_key(
    env: Env, redis_url: str, redis_prefix: str
) -> None:
    """The durable record of an Idempotency-Key (what a retry after an index loss is
    answered from) is the session's record: it goes with the session. Once the key was
    used again (after a day) it names the later session, and stays."""
    digest = submit_keys.key_digest("order-1")
    record = keys.submit_key("acme", digest)
    first = await env.submit(doc="PR-I", idempotency_key="order-1")
    other = await env.submit(doc="PR-J", idempotency_key="order-2")
    for sid in (first, other):
        await env.answer(sid, {"status": "approved"})
    assert record in await all_keys(env.services.store, "")
    env.clock.advance(2 * DAY)
    await flush_index(redis_url, redis_prefix)  # the key's index claim is gone: the record decides
    later = await env.submit(doc="PR-I", idempotency_key="order-2")
    assert later != other  # a day on, the key made a new session
    env.clock.advance(31 * DAY)
    report = await Sweeper(env.control).sweep_once()
    assert report.purged == 2 and report.errors == []
    left = await all_keys(env.services.store, "")
    assert record not in left
    # The refs too; the ended markers stay a window more (late callbacks).
    assert [k for k in left if (first in k or other in k) and not k.startswith(keys.ENDED)] == []
    assert keys.submit_key("acme", submit_keys.key_digest("order-2")) in left  # later's


async def test_a_webhook_inside_the_replay_window_keeps_its_session(env: Env) -> None:
    hook = Receiver()
    try:
        sid, cid = await ended_session(env, hook)
        env.clock.advance(31 * DAY)
        recent = InboxEvent.new(
            kind=EventKind.CALLBACK,
            session_id=sid,
            source="oa",
            event_id="evt-recent",
            type="oa.approval.decided",
            received_at=env.clock.now() - timedelta(hours=1),
            correlation_id=cid,
        ).model_copy(update={"content_digest": "e" * 64})
        await env.services.inbox.deliver(recent)
        await env.services.inbox.remember_accepted(source="oa", content_digest="e" * 64)
        retention = env.services.retention
        assert retention is not None
        windows = timedelta(hours=24)
        keep = timedelta(days=30)
        now = env.clock.now()
        report = await retention.sweep(now=now, keep=keep, windows=windows, limit=10)
        assert report.purged == [] and report.kept == 1
        assert await env.services.inbox.was_accepted(source="oa", content_digest="e" * 64)

        later = now + timedelta(hours=24)
        report = await retention.sweep(now=later, keep=keep, windows=windows, limit=10)
        assert report.purged == [("acme", sid)]
        assert not await env.services.inbox.was_accepted(source="oa", content_digest="e" * 64)
    finally:
        hook.close()


@pytest.mark.parametrize("refs", [True, False], ids=["refs", "stored-by-0.2"])
async def test_a_delivery_still_being_attempted_keeps_its_session(env: Env, refs: bool) -> None:
    dead = Receiver()
    url = dead.url
    dead.close()  # nobody answers: the delivery stays pending, with retries ahead
    sid = await env.submit(doc="PR-D", callback_url=url)
    await env.answer(sid, {"status": "approved"})
    if not refs:  # 0.2 wrote none: the delivery is found through the snapshot's outbox
        for ref in [k for k in await every_key(env) if k.startswith(keys.refs_prefix(sid))]:
            await env.services.store.delete(ref)
    retention = env.services.retention
    assert retention is not None
    now = env.clock.now() + timedelta(days=31)
    week, day = timedelta(days=30), timedelta(hours=24)
    report = await retention.sweep(now=now, keep=week, windows=day, limit=10)
    assert report.purged == [] and report.kept == 1
    assert (await env.load(sid)).state is SessionState.COMPLETED


def test_retention_shorter_than_the_24_hour_windows_is_refused() -> None:
    with pytest.raises(ConfigError, match="86400"):
        Settings.build({"storage": {"retention_s": 3600}})
    assert Settings.build({}).storage.retention_s == 30 * 24 * 3600


def test_a_retention_period_past_a_century_is_refused() -> None:
    """A period the sweep cannot subtract from its clock (``now - keep`` before year 1)
    was accepted, and every sweep then failed with OverflowError: nothing was purged."""
    with pytest.raises(ConfigError, match="retention_s"):
        Settings.build({"storage": {"retention_s": 1e12}})
    assert Settings.build({"storage": {"retention_s": 100 * 365 * DAY}}).storage.retention_s


def test_a_retention_page_past_ten_thousand_sessions_is_refused() -> None:
    """A sweep is one step of the reconciler's loop (the deadlines fire in it too): a
    page of a billion sessions was accepted, and one pass then purged without end."""
    with pytest.raises(ConfigError, match="retention_per_sweep"):
        Settings.build({"storage": {"retention_per_sweep": 10**9}})
    assert Settings.build({"storage": {"retention_per_sweep": 10_000}}).storage


def work_order(sid: str, *, deadline: datetime, call: str = "call_w1") -> WorkOrder:
    """The order a work tool's dispatch records, for a call of session ``sid``."""
    key = business_idempotency_key("acme", f"crunch:{sid}:{call}", 1)
    return WorkOrder(
        work_id=work_id(key),
        idempotency_key=key,
        tool_name="crunch",
        session_id=sid,
        tenant="acme",
        correlation_id=new_correlation_id(),
        epoch=1,
        request={"n": 1},
        deadline=deadline,
        trace_id=new_trace_id(),
    )


async def test_an_ended_session_goes_with_its_work_records_and_progress(env: Env) -> None:
    hook = Receiver()
    try:
        sid, _ = await ended_session(env, hook)
        store = env.services.store
        records, progress = WorkRecords(store), ObjectProgress(store)
        order = work_order(sid, deadline=env.clock.now() + timedelta(hours=1))
        await records.save_order(order)  # what the runner does before it starts the work
        assert await records.claim_run(order.work_id, 1, by="pid-1")
        await records.put_result(order.work_id, b"x" * 100)
        await records.record_outcome(order.work_id, {"status": "ok", "result": 1})
        await records.record_lost(order.work_id, 2, "node died")
        # A second work whose last progress report stayed behind (it was stopped).
        stopped = work_order(sid, deadline=env.clock.now(), call="call_w2")
        await records.save_order(stopped)
        await records.stop(stopped.work_id, "cancelled")
        report = Progress(
            work_id=stopped.work_id, tool_name="crunch", fraction=0.5, at=env.clock.now()
        )
        await progress.report(sid, report)
        work_keys = [
            k for k in await every_key(env) if k.startswith(("work/", keys.progress_prefix(sid)))
        ]
        assert len(work_keys) == 8  # 5 + 2 work records, 1 progress report

        env.clock.advance(31 * DAY)
        swept = await Sweeper(env.control).sweep_once()
        assert swept.purged == 1 and swept.errors == []
        left = await every_key(env)
        assert [k for k in left if k.startswith(("work/", "progress/", "refs/"))] == []
    finally:
        hook.close()


async def test_work_that_may_still_run_keeps_its_ended_session(env: Env) -> None:
    """No outcome and no stop: the session failed with the work's wait open, which nothing
    compensates. It waits until the work's deadline is a retention period behind."""
    hook = Receiver()
    try:
        sid, _ = await ended_session(env, hook)
        order = work_order(sid, deadline=env.clock.now() + timedelta(days=10))
        await WorkRecords(env.services.store).save_order(order)
        retention = env.services.retention
        assert retention is not None
        keep, windows = timedelta(days=30), timedelta(hours=24)
        now = env.clock.now() + timedelta(days=31)
        report = await retention.sweep(now=now, keep=keep, windows=windows, limit=10)
        assert report.purged == [] and report.kept == 1
        assert keys.work_order(order.work_id) in await every_key(env)

        later = env.clock.now() + timedelta(days=41)
        report = await retention.sweep(now=later, keep=keep, windows=windows, limit=10)
        assert report.purged == [("acme", sid)]
        assert [k for k in await every_key(env) if k.startswith("work/")] == []
    finally:
        hook.close()


async def test_a_session_stored_by_0_2_goes_with_its_correlation_record_and_business_key(
    env: Env,
) -> None:
    """0.2 wrote correlation records and business-key pointers without refs: they are
    found through the snapshot's outbox and business keys, and the inbox."""
    hook = Receiver()
    try:
        sid, cid = await ended_session(env, hook)
        pointer = keys.business_key("acme", "PR-R")
        refs = [k for k in await every_key(env) if k.startswith(keys.refs_prefix(sid))]
        [delivery_id] = [r.rsplit("/", 1)[1] for r in refs if "/d/" in r]
        for ref in refs:
            await env.services.store.delete(ref)  # as 0.2 left it: no refs at all
        assert {keys.correlation(cid), pointer, keys.delivery("acme", delivery_id)} <= set(
            await every_key(env)
        )

        env.clock.advance(31 * DAY)
        report = await Sweeper(env.control).sweep_once()
        assert report.purged == 1 and report.errors == []
        left = await every_key(env)
        assert keys.correlation(cid) not in left and pointer not in left
        assert keys.delivery("acme", delivery_id) not in left
        assert await env.services.correlations.lookup(cid) is None
    finally:
        hook.close()


async def test_a_0_2_business_key_now_held_by_another_session_stays(env: Env) -> None:
    hook = Receiver()
    try:
        sid, cid = await ended_session(env, hook)
        for ref in [k for k in await every_key(env) if k.startswith(keys.refs_prefix(sid))]:
            await env.services.store.delete(ref)
        later = await env.submit(doc="PR-R")  # takes the business key over
        held = (await env.load(later)).waits[0].correlation_id
        pointer = keys.business_key("acme", "PR-R")
        assert (await env.services.store.get(pointer)).data == held.encode()

        env.clock.advance(31 * DAY)
        retention = env.services.retention
        assert retention is not None
        now = env.clock.now()
        week, day = timedelta(days=30), timedelta(hours=24)
        report = await retention.sweep(now=now, keep=week, windows=day, limit=10)
        assert report.purged == [("acme", sid)]
        assert await env.services.correlations.lookup(cid) is None
        assert (await env.services.store.get(pointer)).data == held.encode()
        assert await env.services.correlations.lookup(held) is not None
    finally:
        hook.close()


async def test_a_callback_landing_mid_purge_leaves_nothing_behind(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The OA system resends its decision while the purge runs: after the inbox was
    listed, before the correlation record the gateway routes it through went. Its inbox
    event and replay marker stayed for good (nothing lists the inbox once the snapshot
    and the markers are gone), and its wake-up found no session at every sweep."""
    sid = await env.submit(doc="PR-LATE")
    cid = (await env.load(sid)).waits[0].correlation_id
    await env.answer(sid, {"status": "approved"})
    assert (await env.load(sid)).state is SessionState.COMPLETED
    env.clock.advance(31 * DAY)
    digest = "e" * 64
    real = retention.ObjectRetention._delete
    resent = False

    async def delete(self: retention.ObjectRetention, doomed: list[str]) -> None:
        nonlocal resent
        if not resent and any(k.startswith("correlations/") for k in doomed):
            resent = True
            late = late_callback(env, sid, cid, "evt-resent", digest)
            assert await env.services.inbox.deliver(late)
            await env.control.arm_wake(sid)
            await env.services.inbox.remember_accepted(source="oa", content_digest=digest)
        await real(self, doomed)

    monkeypatch.setattr(retention.ObjectRetention, "_delete", delete)
    sweeper = Sweeper(env.control)
    assert (await sweeper.sweep_once()).purged == 1 and resent
    monkeypatch.undo()
    env.clock.advance(DAY)
    await sweeper.sweep_once()  # the wake-up's activation finds no session
    left = [k for k in await every_key(env) if sid in k or digest in k]
    assert left == []
    later = env.clock.now() + timedelta(days=365)
    assert sid not in await env.services.index.due(kind=TimerKind.WAKE, now=later, limit=100)


async def test_the_replay_marker_of_a_resent_duplicate_goes_too(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    """A sender resends an answer already stored, signed afresh (a new timestamp): the
    request is a duplicate (200) and is remembered by its own replay marker, which no
    inbox event names. It goes after the retention period, as the stored one's does."""
    async with local_env(tmp_path, redis_url, redis_prefix, extra={"sources": SOURCES}) as env:
        gateway = WebhookGateway(env.control)
        sid = await env.submit(doc="PR-DUP")
        cid = (await env.load(sid)).waits[0].correlation_id
        now = env.clock.now()
        for later_s, status in [(0, 202), (1, 200)]:
            raw = body(cid, "e1")
            at = now + timedelta(seconds=later_s)
            headers = {**sign(Scheme.TORPOR, raw, SECRET, now=at), "Content-Type": JSON}
            assert (await gateway.receive("oa", raw, headers, now=now)).status == status
        assert (await env.load(sid)).state is SessionState.COMPLETED
        assert len(await all_keys(env.services.store, keys.REPLAYS)) == 2
        sweeper = Sweeper(env.control)
        env.clock.advance(29 * DAY)
        await sweeper.sweep_once()
        assert len(await all_keys(env.services.store, keys.REPLAYS)) == 2  # inside the period
        env.clock.advance(2 * DAY)
        assert (await sweeper.sweep_once()).purged == 1
        env.clock.advance(2 * DAY)
        await sweeper.sweep_once()
        assert await all_keys(env.services.store, keys.REPLAYS) == []


# The audit log: one stream per writer process (``storage.audit``), each record a link
# of its hash chain. A purged session's records stay in it, as evidence (compacted into
# archives, never deleted: a deleted record or stream breaks or cuts the chain).
AUDIT_LOG = (keys.AUDIT, audit.MANIFEST, audit.CHECKPOINTS, audit_archive.ARCHIVES)


async def test_a_purged_session_leaves_nothing_behind_under_any_prefix_but_the_audit_log(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    """Everything its life wrote, through the real paths: its submit's Idempotency-Key
    record, snapshot, chunks, live and ended markers, correlation record and business-key
    pointer, the webhook that answered it (inbox event, replay marker and its due entry)
    and a resend of it signed afresh (a marker no event names), its notification's
    delivery, and the refs naming them. Once purged and the windows past, the store holds
    what it held before the session, and the audit log's records of its webhooks."""
    async with local_env(tmp_path, redis_url, redis_prefix, extra={"sources": SOURCES}) as env:
        hook = Receiver()
        try:
            sweeper = Sweeper(env.control)
            await sweeper.sweep_once()  # a store's own markers, made once
            before = set(await every_key(env))
            sid = await env.submit(doc="PR-ALL", callback_url=hook.url, idempotency_key="o-1")
            cid = (await env.load(sid)).waits[0].correlation_id
            now = env.clock.now()
            gateway = WebhookGateway(env.control)
            for later_s, status in [(0, 202), (1, 200)]:  # the answer, then a resend
                raw = body(cid, "e1")
                signed = sign(Scheme.TORPOR, raw, SECRET, now=now + timedelta(seconds=later_s))
                headers = {**signed, "Content-Type": JSON}
                assert (await gateway.receive("oa", raw, headers, now=now)).status == status
            assert (await env.load(sid)).state is SessionState.COMPLETED
            await sweeper.sweep_once()
            await sweeper.deliveries.drain()
            assert len(hook.received) == 1
            written = set(await every_key(env)) - before
            made = {k.split("/", 1)[0] + "/" for k in written if not k.startswith(AUDIT_LOG)}
            assert {keys.SNAPSHOTS, keys.SUBMIT_KEYS, keys.REPLAYS, keys.REPLAYS_DUE} <= made
            assert {"inbox/", "correlations/", "business-keys/", "deliveries/"} <= made
            # The resend's marker alone is listed by its hour: the answer's, named by its
            # inbox event, goes with the session.
            assert len([k for k in written if k.startswith(keys.REPLAYS_DUE)]) == 1

            env.clock.advance(31 * DAY)
            assert (await sweeper.sweep_once()).purged == 1
            env.clock.advance(2 * DAY)  # the ended marker's window
            await sweeper.sweep_once()
            left = set(await every_key(env)) - before
            assert sorted(k for k in left if not k.startswith(AUDIT_LOG)) == []
            assert await env.services.index.session_states([sid]) == {}
        finally:
            hook.close()
