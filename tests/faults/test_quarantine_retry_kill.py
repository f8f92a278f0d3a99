"""kill -9 of the process taking an operator's retry of a session quarantined because its
snapshot does not decode (``torpor.service.quarantine.retry``).

The retry arms a restored snapshot's wait timers (a sweep dropped them while the session
was set aside) and the session's wake timer, puts the state the snapshot holds back in
the index's registry, and asks for an activation. A real child process (``local_env``: the
local folder store and the test Redis) takes the retry and dies by SIGKILL after the
timer (``quarantine.retry_armed``) or after the registry's record
(``quarantine.retry_recorded``): no activation is ever asked. The reconciler, running
in the test's process throughout, wakes the session by its timer, once: one activation,
which finds the snapshot as it is now (still undecodable: set aside again, and the
operator may retry; restored: back where it was, in the registry too, without waiting for
a full repair), and a later sweep wakes nothing.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from storage import keys
from storage.codec import SnapshotCodec
from tests.support.crash import run_killed_at
from tests.support.harness import Env, local_env
from torpor.faults import CrashPoint
from torpor.lifecycle import SessionState
from torpor.ports import Reason, TimerKind
from torpor.service.sweeper import Sweeper, SweepReport
from torpor.session.suspend import poll_member

pytestmark = pytest.mark.redis
FAR = timedelta(days=365)

RETRY_IN_CHILD = """
import asyncio, sys
from datetime import datetime
from pathlib import Path
from tests.support.harness import local_env

async def main() -> None:
    async with local_env(Path(sys.argv[1]), sys.argv[2], sys.argv[3]) as env:
        # The test's clock, not this process's start: its timer is armed by that.
        env.clock.advance((datetime.fromisoformat(sys.argv[5]) - env.clock.now()).total_seconds())
        await env.control.retry(sys.argv[4], tenant="acme")
    print("survived", flush=True)

asyncio.run(main())
"""

POINTS = [CrashPoint.QUARANTINE_RETRY_ARMED, CrashPoint.QUARANTINE_RETRY_RECORDED]


async def quarantined(env: Env) -> tuple[str, bytes]:
    """A SUSPENDED session whose snapshot no longer decodes, set aside by the activation
    that found it so (QUARANTINED in the index only); its good snapshot."""
    sid = await env.submit(doc="PR-Q")
    assert (await env.load(sid)).state is SessionState.SUSPENDED
    store, key = env.services.store, keys.snapshot(sid)
    good = (await store.get(key)).data
    await store.put(key, good[:-16] + b"\x00" * 16)  # the body spoiled, the header whole
    await env.control.activate(sid, reason=Reason.EVENT)
    assert (await env.services.index.session_states([sid]))[sid] is SessionState.QUARANTINED
    shown = await env.control.get(sid, tenant="acme")
    assert shown.quarantine is not None and shown.quarantine.code == "snapshot_corrupt"
    return sid, good


async def wakes(env: Env, sweeper: Sweeper) -> int:
    """One sweep past the wake grace (the session's only way back now): how many
    activation timers fired."""
    env.clock.advance(env.services.settings.reconciler.wake_grace_s + 1)
    report = await sweeper.sweep_once()
    assert report.errors == []
    return report.woken


@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("restored", [False, True], ids=["still-corrupt", "restored"])
async def test_a_poison_retry_killed_before_its_activation_is_woken_once_by_the_sweeper(
    tmp_path: Path, redis_url: str, redis_prefix: str, point: CrashPoint, restored: bool
) -> None:
    """The reconciler runs all along (its full repair made at its start, before the
    retry): only the wake timer brings the session round."""
    async with local_env(tmp_path, redis_url, redis_prefix) as env:
        sid, good = await quarantined(env)
        sweeper = Sweeper(env.control)
        first = await sweeper.sweep_once()  # the reconciler's start: a full repair
        assert [e.split(":")[0] for e in first.errors] == [f"repair {sid}"], "unreadable"
        index = env.services.index
        assert (await index.session_states([sid]))[sid] is SessionState.QUARANTINED
        [wait] = SnapshotCodec().decode(good).waits
        poll = poll_member(sid, wait.correlation_id)
        if restored:  # the operator restored the object, then retried
            await env.services.store.put(keys.snapshot(sid), good)
            # As a sweep drops it while the session is set aside (``_drop_set_aside``).
            await index.unschedule(kind=TimerKind.POLL, member=poll)
        now = env.clock.now().isoformat()
        run_killed_at(point, RETRY_IN_CHILD, str(tmp_path), redis_url, redis_prefix, sid, now)

        told = point is CrashPoint.QUARANTINE_RETRY_RECORDED
        registered = SessionState.SUSPENDED if told else SessionState.QUARANTINED
        assert (await index.session_states([sid]))[sid] is registered
        grace = timedelta(seconds=env.services.settings.reconciler.wake_grace_s)
        later = env.clock.now() + 2 * grace
        assert sid in await index.due(kind=TimerKind.WAKE, now=later, limit=10), "armed"
        if restored:  # the wait's timers are armed before the wake-up, the first kill point
            assert poll in await index.due(kind=TimerKind.POLL, now=later + FAR, limit=10)

        assert await wakes(env, sweeper) == 1
        after = SessionState.SUSPENDED if restored else SessionState.QUARANTINED
        assert (await env.control.get(sid, tenant="acme")).state is after
        # No full repair since the retry: the activation itself put the state back. Killed
        # at ``retry_armed`` with the snapshot restored, it found it reads and had nothing
        # to commit; the QUARANTINED the dead retry never replaced is lifted with its
        # lease's release, not kept for a healthy session until the next repair.
        assert (await index.session_states([sid]))[sid] is after
        listed = await index.list_sessions(tenant="acme", state=after, cursor=None, limit=10)
        assert sid in listed.session_ids
        assert await wakes(env, sweeper) == 0, "woken once: the activation took its timer"
        await sweeper.repair(env.clock.now(), SweepReport())  # the periodic full repair
        assert (await index.session_states([sid]))[sid] is after
        assert await wakes(env, sweeper) == 0
        if not restored:  # set aside again: the operator may retry once more
            await env.control.retry(sid, tenant="acme")
            assert (await index.session_states([sid]))[sid] is SessionState.QUARANTINED


async def test_an_older_backups_retry_killed_once_armed_is_lifted_by_its_activation(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    """The operator restores a backup older than the snapshot found undecodable (the
    index's QUARANTINED carries the newer generation its header named) and retries; the
    retry dies once it armed the wake-up, before its own lift over any generation. The
    activation the wake-up asks for finds the backup reads and has nothing to commit: its
    lift, "no newer", was refused by the quarantine's newer generation, and the session
    stayed set aside in the index until the operator retried once more."""
    async with local_env(tmp_path, redis_url, redis_prefix) as env:
        sid = await env.submit(doc="PR-B")
        backup = await env.load(sid)
        store, key, index = env.services.store, keys.snapshot(sid), env.services.index
        old = (await store.get(key)).data
        # The session moved on (two commits, recorded) before its snapshot was spoiled.
        newer = backup.model_copy(update={"generation": backup.generation + 2})
        await index.record_session(
            tenant="acme", session_id=sid, state=newer.state, generation=newer.generation
        )
        spoiled = SnapshotCodec().encode(newer)
        await store.put(key, spoiled[:-16] + b"\x00" * 16)  # the body spoiled, the header whole
        await env.control.activate(sid, reason=Reason.EVENT)
        assert (await index.session_states([sid]))[sid] is SessionState.QUARANTINED
        assert await index.session_generation(sid) == newer.generation
        sweeper = Sweeper(env.control)
        await sweeper.sweep_once()  # the reconciler's start: a full repair
        await store.put(key, old)  # the older backup, restored by the operator, who retries
        now = env.clock.now().isoformat()
        point = CrashPoint.QUARANTINE_RETRY_ARMED
        run_killed_at(point, RETRY_IN_CHILD, str(tmp_path), redis_url, redis_prefix, sid, now)
        assert (await index.session_states([sid]))[sid] is SessionState.QUARANTINED

        assert await wakes(env, sweeper) == 1
        assert (await env.control.get(sid, tenant="acme")).state is SessionState.SUSPENDED
        assert (await index.session_states([sid]))[sid] is SessionState.SUSPENDED
        assert await index.session_generation(sid) == backup.generation
        listed = await index.list_sessions(
            tenant="acme", state=SessionState.SUSPENDED, cursor=None, limit=10
        )
        assert sid in listed.session_ids
        assert await wakes(env, sweeper) == 0, "woken once: the activation took its timer"
