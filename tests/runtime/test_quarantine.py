"""A snapshot that cannot be decoded is quarantined, visibly, and retried by an operator;
one written by a newer torpor is left for it, retried at the backoff's cap."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
import redis.exceptions

from storage import keys
from storage.codec import SnapshotCodec
from tests.runtime.memory_env import MemEnv, memory_env, plan_agent, reset
from tests.runtime.test_sweeper import Recording
from tests.support.harness import local_env
from torpor.clock import to_ms
from torpor.errors import OutboxEntryNotSendable, PreconditionFailed, StorageUnavailable
from torpor.lifecycle import SessionState
from torpor.models import SCHEMA_VERSION, DispatchStatus, OutboxEntry, OutboxKind
from torpor.ports import Reason, TimerKind
from torpor.service import sweeper_deadlines, sweeper_timers, sweeper_tools
from torpor.service.sessions import SessionService
from torpor.service.sweeper import Sweeper
from torpor.session import ActivationOutcome
from torpor.session.activation import Activation
from torpor.session.heartbeat import Heartbeat

S = SessionState
# The sweep's modules that read its BATCH, each through its own imported name: a patch of
# one of them (or of ``torpor.service.sweeper``) leaves the others at 500.
BATCH_READERS = (sweeper_deadlines, sweeper_timers, sweeper_tools)
PLAN = {
    "steps": [
        {"id": "approve", "calls": [{"tool": "approve", "args": {"doc": "D-1"}}]},
        {"id": "done", "finish": "${results.approve}"},
    ]
}
AGENTS = {"a": plan_agent(PLAN, {"tests.runtime.memory_env:Approve": {}})}
# The same plan, the document from the input: two sessions wait on two business keys.
PER_DOC = {
    "a": plan_agent(
        {
            "steps": [
                {"id": "approve", "calls": [{"tool": "approve", "args": {"doc": "${input}"}}]},
                {"id": "done", "finish": "${results.approve}"},
            ]
        },
        {"tests.runtime.memory_env:Approve": {}},
    )
}
FAR = datetime(2100, 1, 1, tzinfo=UTC)


async def corrupt_body(env: MemEnv, sid: str) -> bytes:
    """Spoil the compressed body, keep the header: the snapshot no longer decodes."""
    key = keys.snapshot(sid)
    good = (await env.services.store.get(key)).data
    await env.services.store.put(key, good[:-16] + b"\x00" * 16)
    return good


async def quarantined(env: MemEnv) -> str:
    """A session its activation set aside: its snapshot does not decode."""
    sid = await env.submit("a")
    await corrupt_body(env, sid)
    await env.runtime.activate(sid, reason=Reason.EVENT)
    return sid


async def test_a_corrupt_snapshot_is_quarantined_not_retried_for_ever() -> None:
    async with memory_env(AGENTS) as env:
        reset()
        sid = await env.submit("a")
        good = await corrupt_body(env, sid)
        result = await env.runtime.activate(sid, reason=Reason.EVENT)
        assert result.outcome is ActivationOutcome.QUARANTINED
        index = env.services.index
        assert (await index.session_states([sid]))[sid] is S.QUARANTINED
        far = env.clock.now() + env.services.config.retry_cap * 10
        assert sid not in await index.due(kind=TimerKind.RETRY, now=far, limit=10)
        # Shown as what it is, with the decode error as the reason.
        shown = await env.control.get(sid, tenant="acme")
        assert shown.state is S.QUARANTINED and shown.quarantine is not None
        assert shown.quarantine.code == "snapshot_corrupt"
        assert shown.quarantine.resume_to is S.SUSPENDED
        # Once it reads again (restored, or an upgrade reads it) the operator retries.
        await env.services.store.put(keys.snapshot(sid), good)
        await env.control.retry(sid, tenant="acme")
        assert (await index.session_states([sid]))[sid] is S.SUSPENDED
        assert (await env.control.get(sid)).state is S.SUSPENDED


async def test_a_poison_retry_whose_activation_is_lost_is_activated_by_the_reconciler() -> None:
    """The operator's retry of a snapshot that did not decode puts its state back in the
    index and asks for an activation. That request is lost (no actor took it, or the
    process died after the index write): the session showed QUARANTINED (its snapshot
    still does not decode) while the index said SUSPENDED, so a second retry was
    refused, and nothing ever activated it to find out. The wake-up timer does."""
    async with memory_env(AGENTS) as env:
        reset()
        sid = await quarantined(env)
        index = env.services.index
        assert (await index.session_states([sid]))[sid] is S.QUARANTINED
        lost = Recording()
        await SessionService(env.services, lost).retry(sid, tenant="acme")
        assert lost.requests == [(sid, Reason.RETRY)]
        assert (await index.session_states([sid]))[sid] is S.SUSPENDED
        env.clock.advance(env.services.settings.reconciler.wake_grace_s + 1)
        assert (await Sweeper(env.control).sweep_once()).woken == 1
        # Activated: its snapshot still does not decode, so it is set aside again, and
        # the operator may retry it once more.
        assert (await index.session_states([sid]))[sid] is S.QUARANTINED


async def test_a_restored_poison_snapshots_activation_puts_its_state_back_in_the_index() -> None:
    """The operator's retry of a snapshot that did not decode died after it armed the
    wake-up (``quarantine.retry_armed``), before it recorded the state; the snapshot was
    restored. The activation the wake-up asks for finds it reads and has nothing to commit:
    the index kept QUARANTINED, for a healthy session, until the next full repair (an hour
    at most), and the deadline loop, taking it for set aside, unbound its due wait instead
    of timing it out. The activation lifts the quarantine; no repair runs here."""
    async with memory_env(AGENTS) as env:
        reset()
        sid = await env.submit("a")
        [wait] = (await env.load(sid)).waits
        good = await corrupt_body(env, sid)
        await env.runtime.activate(sid, reason=Reason.EVENT)
        index = env.services.index
        assert (await index.session_states([sid]))[sid] is S.QUARANTINED
        await env.services.store.put(keys.snapshot(sid), good)  # restored by the operator
        result = await env.runtime.activate(sid, reason=Reason.EVENT)  # the wake-up's
        assert result.outcome is ActivationOutcome.RAN and result.state is S.SUSPENDED
        assert (await index.session_states([sid]))[sid] is S.SUSPENDED
        env.clock.advance((wait.deadline - env.clock.now()).total_seconds() + 1)
        assert await Sweeper(env.control).deadlines_once() == 1  # not taken for set aside
        assert (await env.load(sid)).state is S.TIMED_OUT


async def test_a_poison_snapshot_restored_from_an_older_backup_is_taken_back_by_a_retry() -> None:
    """The operator restores a backup older than the snapshot found undecodable: the
    index's QUARANTINED carries the newer generation its header named. The registry's
    "newest generation wins" refused the retry's record (and the activation's lift, and
    every repair): the retry was accepted and changed nothing, the session listed as set
    aside for good. The retry, the operator's explicit act, takes it back."""
    async with memory_env(AGENTS) as env:
        reset()
        sid = await env.submit("a")
        backup = await env.load(sid)
        old = (await env.services.store.get(keys.snapshot(sid))).data
        # The session moved on (two commits, recorded) before its snapshot was spoiled.
        newer = backup.model_copy(update={"generation": backup.generation + 2})
        await env.services.store.put(keys.snapshot(sid), SnapshotCodec().encode(newer))
        index = env.services.index
        await index.record_session(
            tenant="acme", session_id=sid, state=newer.state, generation=newer.generation
        )
        await corrupt_body(env, sid)
        await env.runtime.activate(sid, reason=Reason.EVENT)
        assert (await index.session_states([sid]))[sid] is S.QUARANTINED
        assert await index.session_generation(sid) == newer.generation
        await env.services.store.put(keys.snapshot(sid), old)  # the older backup
        await env.control.retry(sid, tenant="acme")  # and the activation it asks for
        assert (await index.session_states([sid]))[sid] is S.SUSPENDED
        assert await index.session_generation(sid) == backup.generation
        listed = await index.list_sessions(tenant="acme", state=None, cursor=None, limit=5)
        assert listed.session_ids == [sid]
        assert (await env.control.get(sid)).state is S.SUSPENDED


@pytest.mark.redis
async def test_a_restored_snapshot_whose_header_did_not_read_leaves_no_ghost_in_redis(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    """Not even its header decodes, and the index lost what it knew of the session: the
    activation quarantines it under tenant "" (its tenant unknown). Restored and retried,
    it is recorded under its tenant, and tenant ""'s listings in Redis kept it, QUARANTINED
    there for ever: a ghost that no get, retry or cancel under that tenant could reach."""
    async with local_env(tmp_path, redis_url, redis_prefix) as env:
        sid = await env.submit(doc="PR-G")
        assert (await env.load(sid)).state is S.SUSPENDED
        index, store, key = env.services.index, env.services.store, keys.snapshot(sid)
        good = (await store.get(key)).data
        await index.forget_session(tenant="acme", session_id=sid)  # as a lost index would
        await store.put(key, b"\x00" * 64)  # nothing of it reads, not even the header
        await env.control.activate(sid, reason=Reason.EVENT)
        aside = await index.list_sessions(tenant="", state=S.QUARANTINED, cursor=None, limit=5)
        assert aside.session_ids == [sid]
        await store.put(key, good)  # restored by the operator, who retries
        await env.control.retry(sid, tenant="acme")
        assert (await index.session_states([sid]))[sid] is S.SUSPENDED
        for state in (None, S.QUARANTINED):
            ghost = await index.list_sessions(tenant="", state=state, cursor=None, limit=5)
            assert ghost.session_ids == []
        page = await index.list_sessions(tenant="acme", state=S.SUSPENDED, cursor=None, limit=5)
        assert page.session_ids == [sid]


async def test_an_activation_whose_lease_lapsed_lifts_no_quarantine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past its lease, another holder may have found the snapshot undecodable (again) and
    recorded QUARANTINED at the generation this one read: that record stands."""
    async with memory_env(AGENTS) as env:
        reset()
        sid = await env.submit("a")
        good = await corrupt_body(env, sid)
        await env.runtime.activate(sid, reason=Reason.EVENT)
        await env.services.store.put(keys.snapshot(sid), good)
        monkeypatch.setattr(Heartbeat, "lapsed", lambda self: True)
        result = await env.runtime.activate(sid, reason=Reason.EVENT)
        assert result.outcome is ActivationOutcome.RAN and result.state is S.SUSPENDED
        assert (await env.services.index.session_states([sid]))[sid] is S.QUARANTINED


async def test_a_repair_leaves_a_poison_quarantine_in_the_index() -> None:
    """A snapshot that does not decode is quarantined in the index's registry only. A
    reconciler's full repair (at its start, then periodically) recorded the state its
    header names (SUSPENDED) over it: the session still read QUARANTINED, the operator's
    retry was refused ("is QUARANTINED, not QUARANTINED"), and nothing would ever wake
    it. Repair records what the activation records for it: QUARANTINED."""
    async with memory_env(AGENTS) as env:
        reset()
        sid = await quarantined(env)
        index = env.services.index
        report = await Sweeper(env.control).sweep_once()  # a new reconciler: a full repair
        assert [e.split(":")[0] for e in report.errors] == [f"repair {sid}"]
        assert (await index.session_states([sid]))[sid] is S.QUARANTINED
        assert (await env.control.get(sid)).state is S.QUARANTINED
        await env.control.retry(sid, tenant="acme")  # allowed: it is set aside
        assert (await index.session_states([sid]))[sid] is S.QUARANTINED  # still poison


async def test_a_repair_leaves_a_newer_torpors_session_in_its_state_not_quarantined() -> None:
    """A snapshot a newer torpor wrote (a rolling upgrade) is not poison: the activation
    leaves it to the newer torpor, unrecorded, and a repair must not quarantine it either
    (nothing would take it out but an operator). Repair quarantines a live session it
    lists by its header alone; a newer torpor's is not listed at all (its header does
    not decode here either), and this keeps it so."""
    async with memory_env(AGENTS) as env:
        reset()
        sid = await env.submit("a")
        await env.runtime.activate(sid, reason=Reason.SUBMIT)
        before = await env.load(sid)
        newer = before.model_copy(update={"schema_version": SCHEMA_VERSION + 1})
        await env.services.store.put(keys.snapshot(sid), SnapshotCodec().encode(newer))
        await Sweeper(env.control).sweep_once()  # a new reconciler: a full repair
        assert (await env.services.index.session_states([sid]))[sid] is before.state


async def test_a_snapshot_from_a_newer_torpor_is_left_for_it_at_the_backoff_cap() -> None:
    async with memory_env(AGENTS) as env:
        reset()
        sid = await env.submit("a")
        newer = (await env.load(sid)).model_copy(update={"schema_version": SCHEMA_VERSION + 1})
        await env.services.store.put(keys.snapshot(sid), SnapshotCodec().encode(newer))
        result = await env.runtime.activate(sid, reason=Reason.EVENT)
        assert result.outcome is ActivationOutcome.STOPPED
        # Not every sweep: at the cap of the one backoff (± its jitter).
        index, cap = env.services.index, env.services.config.retry_cap
        assert sid not in await index.due(
            kind=TimerKind.RETRY, now=env.clock.now() + cap * 0.7, limit=9
        )
        assert sid in await index.due(
            kind=TimerKind.RETRY, now=env.clock.now() + cap * 1.3, limit=9
        )


async def test_an_activation_that_keeps_failing_backs_off_then_is_set_aside(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fault on the session's own path (a bug, not the store or the index) was retried
    at the flat retry delay on every sweep, for ever: the session stayed as it was and no
    operator was told. It counts against the retry quota now, with its backoff, and the
    session is set aside with the error once the quota is spent; the operator's retry
    takes it on once the fault is gone."""
    async with memory_env(AGENTS) as env:
        reset()
        sid = await env.submit("a")
        before = await env.load(sid)

        async def fails(self: Activation, reason: Reason) -> None:
            raise RuntimeError("a bug on the path")

        monkeypatch.setattr(Activation, "_drive", fails)
        index, outcomes, delays = env.services.index, [], []
        for _ in range(before.retry.max_attempts + 1):
            await env.control.arm_wake(sid)  # an event came: its wake-up is armed
            result = await env.runtime.activate(sid, reason=Reason.EVENT)
            outcomes.append(result.outcome)
            if result.outcome is ActivationOutcome.STOPPED:
                assert await index.due(kind=TimerKind.RETRY, now=FAR, limit=10) == [sid]
                delays.append(await retry_due_in(env, sid))
                # Only the retry brings it back: a wake-up left armed came every 30 s.
                assert await index.due(kind=TimerKind.WAKE, now=FAR, limit=10) == []
        assert outcomes[-1] is ActivationOutcome.QUARANTINED
        assert outcomes[:-1] == [ActivationOutcome.STOPPED] * before.retry.max_attempts
        assert delays == sorted(delays) and delays[-1] > 2 * delays[0], "backed off"
        shown = await env.control.get(sid, tenant="acme")
        assert shown.state is S.QUARANTINED and shown.quarantine is not None
        assert shown.quarantine.code == "activation_failed"
        assert "RuntimeError: a bug on the path" in shown.quarantine.reason
        assert shown.quarantine.resume_to is S.SUSPENDED
        for kind in (TimerKind.RETRY, TimerKind.WAKE):
            assert await index.due(kind=kind, now=FAR, limit=10) == []
        monkeypatch.undo()  # the fault fixed: the operator takes the session back
        await env.control.retry(sid, tenant="acme")
        assert (await env.control.get(sid)).state is S.SUSPENDED


@pytest.mark.parametrize(
    "trouble",
    [
        StorageUnavailable("the store did not answer"),
        # A conditional write whose answer was lost (it committed): the retry sorts it
        # out. Counted, the chaos run's sessions were set aside.
        PreconditionFailed("the object changed since it was read"),
        # A plugin's client let its transport error out (neither typed nor an OSError):
        # counted, a few seconds of an unreachable service set the session aside.
        httpx.ConnectError("[Errno 111] Connection refused"),
        redis.exceptions.ConnectionError("Error 111 connecting to erp-cache:6379"),
    ],
    ids=["unavailable", "ambiguous-write", "plugin-httpx", "plugin-redis"],
)
async def test_storage_trouble_in_an_activation_is_retried_and_never_counted(
    trouble: Exception,
) -> None:
    """Trouble the store or index reports passes by itself: the plain retry, the quota
    untouched."""
    async with memory_env(AGENTS) as env:
        reset()
        sid = await env.submit("a")

        async def unavailable(self: Activation, reason: Reason) -> None:
            raise trouble

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(Activation, "_drive", unavailable)
            for _ in range(10):
                with pytest.raises(type(trouble)):
                    await env.runtime.activate(sid, reason=Reason.RETRY)
        after = await env.load(sid)
        assert after.state is S.SUSPENDED and after.retry.used == 0
        assert await env.services.index.due(kind=TimerKind.RETRY, now=FAR, limit=10) == [sid]


async def set_aside(env: MemEnv, sid: str) -> None:
    """Activate ``sid`` with a fault on its path until it is QUARANTINED."""

    async def fails(self: Activation, reason: Reason) -> None:
        raise RuntimeError("a bug on the path")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Activation, "_drive", fails)
        for _ in range(10):
            if (await env.load(sid)).state is S.QUARANTINED:
                return
            await env.runtime.activate(sid, reason=Reason.RETRY)
    raise AssertionError(f"{sid} was never set aside")


async def retry_due_in(env: MemEnv, sid: str) -> float:
    """Seconds from now to the session's RETRY timer."""
    timers = env.services.index._timers[TimerKind.RETRY]  # type: ignore[attr-defined]
    return (timers[sid] - to_ms(env.clock.now())) / 1000


async def test_a_session_set_aside_before_its_first_step_starts_afresh_on_retry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Set aside while PENDING, a retry put it back RUNNING: the first step's setup (its
    initial messages, from its input) never ran, and the agent ran on nothing."""
    async with memory_env(AGENTS) as env:
        reset()

        async def fails(self: Activation, reason: Reason) -> None:
            raise RuntimeError("a bug before the first step")

        monkeypatch.setattr(Activation, "_drive", fails)
        sid = await env.submit("a")
        for _ in range(10):
            if (await env.load(sid)).state is S.QUARANTINED:
                break
            await env.runtime.activate(sid, reason=Reason.RETRY)
        aside = await env.load(sid)
        assert aside.quarantine is not None and aside.quarantine.resume_to is S.PENDING
        assert aside.messages == []
        monkeypatch.undo()
        await env.control.retry(sid, tenant="acme")
        ran = await env.load(sid)
        assert ran.state is S.SUSPENDED and ran.messages, "started from its input"


async def test_a_set_aside_sessions_due_deadline_asks_for_nothing() -> None:
    """Its waits stay bound while an operator looks; past their deadline the deadline
    loop asked it to time out four times a second, an activation each, for a week."""
    async with memory_env(AGENTS) as env:
        reset()
        sid = await env.submit("a")
        [wait] = (await env.load(sid)).waits
        await set_aside(env, sid)
        env.clock.advance((wait.deadline - env.clock.now()).total_seconds() + 1)
        sweeper = Sweeper(env.control)
        assert [await sweeper.deadlines_once() for _ in range(3)] == [0, 0, 0]
        assert (await sweeper.sweep_once()).timeouts == 0
        await env.control.retry(sid, tenant="acme")  # the operator: its deadline is past
        assert (await env.load(sid)).state is S.TIMED_OUT


async def test_a_fault_raised_from_a_connection_error_is_retried_and_never_counted() -> None:
    """A plugin's own error raised ``from`` the network's: trouble that passes."""
    async with memory_env(AGENTS) as env:
        reset()
        sid = await env.submit("a")

        async def wrapped(self: Activation, reason: Reason) -> None:
            try:
                raise ConnectionResetError("peer reset")
            except ConnectionResetError as exc:
                raise RuntimeError("the CRM client failed") from exc

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(Activation, "_drive", wrapped)
            for _ in range(5):
                with pytest.raises(RuntimeError):
                    await env.runtime.activate(sid, reason=Reason.RETRY)
        assert (await env.load(sid)).retry.used == 0


async def test_set_aside_sessions_past_their_deadline_hide_no_later_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A set-aside session's due deadline stays first in the SLA set (its waits stay
    bound): a full batch of them (``DEADLINE_BATCH``, ``BATCH``), read first on every
    look, hid every later deadline until their grace ran out, a week later."""
    monkeypatch.setattr(sweeper_deadlines, "DEADLINE_BATCH", 1)
    for module in BATCH_READERS:
        monkeypatch.setattr(module, "BATCH", 1)
    async with memory_env(PER_DOC) as env:
        reset()
        aside = await env.submit("a", "D-1")
        await set_aside(env, aside)
        env.clock.advance(10)
        later = await env.submit("a", "D-2")
        [wait] = (await env.load(later)).waits
        env.clock.advance((wait.deadline - env.clock.now()).total_seconds() + 1)
        sweeper = Sweeper(env.control)
        assert await sweeper.deadlines_once() == 1, "the later deadline is acted on"
        assert (await env.load(later)).state is S.TIMED_OUT
        assert (await env.load(aside)).state is S.QUARANTINED, "left for its operator"
        await env.control.retry(aside, tenant="acme")  # its deadline is past all the same
        assert (await env.load(aside)).state is S.TIMED_OUT


async def test_a_full_sweep_is_not_hidden_behind_set_aside_sessions_either(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for module in BATCH_READERS:
        monkeypatch.setattr(module, "BATCH", 1)
    async with memory_env(PER_DOC) as env:
        reset()
        aside = await env.submit("a", "D-1")
        await set_aside(env, aside)
        env.clock.advance(10)
        later = await env.submit("a", "D-2")
        [wait] = (await env.load(later)).waits
        env.clock.advance((wait.deadline - env.clock.now()).total_seconds() + 1)
        sweeper = Sweeper(env.control)
        reports = [await sweeper.sweep_once() for _ in range(2)]
        assert sum(r.timeouts for r in reports) == 1
        assert (await env.load(later)).state is S.TIMED_OUT


async def test_a_dead_letter_of_a_set_aside_session_is_not_resent_until_it_is_taken_back() -> None:
    """Resent, it was answered as PENDING and left the dead letters, but a set-aside
    session has no timers and no activation sends anything for it: it sat there unsent.
    Refused (409) until the operator retries or cancels the session."""
    async with memory_env(AGENTS) as env:
        reset()
        sid = await env.submit("a")
        await set_aside(env, sid)
        aside = await env.load(sid)
        dead = OutboxEntry(
            entry_id="o_dead",
            kind=OutboxKind.NOTIFY,
            idempotency_key=f"{sid}:resumed:1",
            payload={"event": "resumed"},
            status=DispatchStatus.DEAD,
            created_at=env.clock.now(),
        )
        await env.services.snapshots.save(
            aside.model_copy(update={"outbox": [*aside.outbox, dead]}),
            expected_generation=aside.generation,
        )
        with pytest.raises(OutboxEntryNotSendable):
            await env.control.resend_outbox(sid, "o_dead", tenant="acme")
        [entry] = [e for e in (await env.load(sid)).outbox if e.entry_id == "o_dead"]
        assert entry.status is DispatchStatus.DEAD, "still on the operator's dead letters"
