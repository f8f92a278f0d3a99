"""An activation that finds a restored older backup readable lifts the quarantine whose
generation is newer (the undecodable snapshot's), as its retry would have, whether it had
nothing to commit or committed a state whose record that quarantine refused; and not when
what it read may no longer be what the store holds or the lease was not its own."""

from __future__ import annotations

import inspect
from datetime import timedelta
from typing import Any

import pytest

from storage import keys
from storage.codec import SnapshotCodec
from tests.runtime.memory_env import MemEnv, memory_env, reset
from tests.runtime.test_quarantine import AGENTS, corrupt_body
from tests.support.harness import deliver_cancel
from torpor.errors import SnapshotCorrupt, StorageUnavailable
from torpor.lifecycle import SessionState
from torpor.models import SessionSnapshot
from torpor.ports import Reason, SessionEntry
from torpor.session import ActivationOutcome

S = SessionState


async def older_backup_restored(env: MemEnv, ahead: int = 2) -> tuple[str, SessionSnapshot, int]:
    """A session set aside at a newer generation than the backup restored since (``ahead``
    of it): its id, the backup, the quarantine's generation."""
    sid = await env.submit("a")
    backup = await env.load(sid)
    store, key, index = env.services.store, keys.snapshot(sid), env.services.index
    old = (await store.get(key)).data
    newer = backup.model_copy(update={"generation": backup.generation + ahead})
    await store.put(key, SnapshotCodec().encode(newer))
    await index.record_session(
        tenant="acme", session_id=sid, state=newer.state, generation=newer.generation
    )
    await corrupt_body(env, sid)
    await env.runtime.activate(sid, reason=Reason.EVENT)
    assert (await index.session_states([sid]))[sid] is S.QUARANTINED
    await store.put(key, old)  # restored; the operator's retry died before its lift
    return sid, backup, newer.generation


async def test_the_activation_lifts_a_newer_quarantine_over_a_restored_older_backup() -> None:
    async with memory_env(AGENTS) as env:
        reset()
        sid, backup, _ = await older_backup_restored(env)
        result = await env.runtime.activate(sid, reason=Reason.EVENT)
        assert result.outcome is ActivationOutcome.RAN and result.state is S.SUSPENDED
        assert (await env.services.index.session_states([sid]))[sid] is S.SUSPENDED
        assert await env.services.index.session_generation(sid) == backup.generation


async def test_an_activation_committing_over_an_older_backup_lifts_a_newer_quarantine() -> None:
    """The activation has work to do (a cancel waits in the inbox) and commits a state:
    each commit's record, older than the quarantine's generation, is refused ("newest
    wins"). Counted as recorded all the same, it sent no lift with the lease's release,
    and the index listed the cancelled session QUARANTINED until its generation passed
    the quarantine's, or the operator retried again."""
    async with memory_env(AGENTS) as env:
        reset()
        sid, backup, quarantined_at = await older_backup_restored(env, ahead=10)
        index = env.services.index
        await deliver_cancel(env.services, sid, at=env.clock.now())
        result = await env.runtime.activate(sid, reason=Reason.EVENT)
        assert result.outcome is ActivationOutcome.RAN and result.state is S.CANCELLED
        committed = await env.load(sid)
        assert committed.state is S.CANCELLED
        assert backup.generation < committed.generation < quarantined_at  # every record refused
        assert await index.session_entry(sid) == SessionEntry(
            "acme", S.CANCELLED, committed.generation
        )
        listed = await index.list_sessions(tenant="acme", state=S.CANCELLED, cursor=None, limit=5)
        assert listed.session_ids == [sid]


@pytest.mark.parametrize("doubt", ["spoiled-again", "lease-not-ours", "store-unavailable"])
async def test_a_newer_quarantine_stands_when_the_read_may_be_stale(
    doubt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``spoiled-again``: the store's header no longer reads once the activation ends (the
    quarantine may be true again). ``lease-not-ours``: the release found the lease another
    holder's (this one stalled past it unaware), who may have recorded the quarantine.
    ``store-unavailable``: the header's read fails, after the activation's work is done:
    the lift is let be, never raised over the activation's outcome (it was, from the
    ``finally`` that lets the session go)."""
    async with memory_env(AGENTS) as env:
        reset()
        sid, _, quarantined_at = await older_backup_restored(env)
        index, snapshots = env.services.index, env.services.snapshots
        if doubt == "spoiled-again":

            async def unreadable(session_id: str) -> Any:
                raise SnapshotCorrupt(f"header of {session_id} does not decode")

            monkeypatch.setattr(snapshots, "header", unreadable)
        elif doubt == "store-unavailable":
            real = snapshots.header

            async def unavailable(session_id: str) -> Any:
                if "_past_restore" in {f.function for f in inspect.stack()}:  # its read only
                    raise StorageUnavailable("the object store does not answer")
                return await real(session_id)

            monkeypatch.setattr(snapshots, "header", unavailable)
        else:

            async def taken(lease: Any) -> bool:
                return False

            monkeypatch.setattr(index, "release_lease", taken)
        result = await env.runtime.activate(sid, reason=Reason.EVENT)
        assert result.outcome is ActivationOutcome.RAN
        assert (await index.session_states([sid]))[sid] is S.QUARANTINED
        assert await index.session_generation(sid) == quarantined_at


@pytest.mark.parametrize("cancel", [False, True], ids=["nothing-to-commit", "commits"])
async def test_a_taken_over_lease_over_an_older_backup_lifts_a_newer_quarantine(
    cancel: bool,
) -> None:
    """The holder before this activation died holding the lease (``taken_over``): its
    record of the snapshot's state is refused by the newer quarantine, as a commit's is.
    Counted as recorded, no lift went with the release, and the index kept the session
    QUARANTINED at the undecodable snapshot's generation."""
    async with memory_env(AGENTS) as env:
        reset()
        sid, backup, quarantined_at = await older_backup_restored(env, ahead=10)
        index = env.services.index
        if cancel:
            await deliver_cancel(env.services, sid, at=env.clock.now())
        dead = await index.acquire_lease(
            name=f"session:{sid}", owner="dead-host", ttl=timedelta(seconds=1), now=env.clock.now()
        )
        assert dead is not None
        env.clock.advance(5)  # it expires unreleased
        result = await env.runtime.activate(sid, reason=Reason.RECOVER)
        assert result.outcome is ActivationOutcome.RAN
        now = await env.load(sid)
        assert now.generation < quarantined_at and now.state is (
            S.CANCELLED if cancel else backup.state
        )
        assert await index.session_entry(sid) == SessionEntry("acme", now.state, now.generation)
