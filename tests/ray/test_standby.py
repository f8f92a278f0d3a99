"""Dedicated placement with standby session actors, on a real local Ray.

A standby is a pre-started session actor: an activation hands it the session (no
process starts on the request's path), the set is refilled behind it, the actor exits
when its session sleeps, a dead standby is skipped, and the session's lease still lets
only one actor run it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

from actors import metrics, ray_activator
from actors.config_ref import ConfigRef
from actors.ray_activator import RayActivator
from actors.reconciler import NAME as RECONCILER
from actors.reconciler import ensure_reconciler
from actors.session_actor import SessionActor
from actors.standby import StandbySet, standby_prefix
from actors.standby_inheritance import ask_to_retire, standby_name
from actors.wiring import open_services
from tests.conftest import eventually
from tests.ray.conftest import RayEnv, ray_settings, session_actors
from tests.support.s3_server import S3TestServer
from tests.support.tools import World
from torpor.clock import SystemClock
from torpor.lifecycle import SessionState
from torpor.ports import Reason
from torpor.service.sessions import SessionService
from torpor.service.sweeper import Sweeper
from torpor.settings import Settings

S = SessionState
SIZE = 2
STANDBYS = "torpor_standby_actors_total"
# A standby's idle time in the tests of its expiry: long enough for an actor's call to
# come back on a loaded machine, short enough to wait out a few times.
IDLE_S = 4.0


def with_standby(settings: Settings, idle_s: float = 120.0) -> Settings:
    runtime = settings.runtime.model_copy(
        update={"standby_session_actors": SIZE, "standby_idle_s": idle_s}
    )
    return settings.model_copy(update={"runtime": runtime})


@pytest.fixture
def make_env(ray_cluster: None, s3_server: S3TestServer, redis_url: str, redis_prefix: str) -> Any:
    @asynccontextmanager
    async def make(idle_s: float = 120.0, **approval: Any) -> AsyncIterator[RayEnv]:
        settings = with_standby(
            ray_settings(s3_server, redis_url, redis_prefix, placement="dedicated", **approval),
            idle_s,
        )
        services = open_services(settings, clock=SystemClock())
        activator = RayActivator(services)
        assert activator.standby is not None
        await activator.standby.filled()
        env = RayEnv(
            services,
            SessionService(services, activator),
            World(redis_url, redis_prefix),
            SystemClock(),
        )  # type: ignore[arg-type]
        env.sweeper = Sweeper(env.control)
        env.settings = settings
        try:
            yield env
        finally:
            await activator.close()
            await env.world.close()
            await services.close()

    return make


def activator_of(env: RayEnv) -> RayActivator:
    activator = env.control.activator
    # Batch admission wraps every activator (torpor.service.admission): the Ray one is inside.
    activator = getattr(activator, "inner", activator)
    assert isinstance(activator, RayActivator) and activator.standby is not None
    return activator


async def ready_pids(activator: RayActivator) -> list[int]:
    assert activator.standby is not None
    return [await h.ready.remote() for h in activator.standby._ready]


async def reach(env: RayEnv, sid: str, state: SessionState) -> None:
    async def check() -> bool:
        return (await env.load(sid)).state is state

    await eventually(check, timeout_s=30, what=f"{sid} reaches {state}")


async def exited(handle: Any) -> bool:
    """Whether the actor is gone. A call to one that is exiting can go unanswered (it
    hung a CI run until pytest's 300 s timeout): asked with a deadline, and silence is
    "not yet", so the caller's ``eventually`` asks again and its own deadline bounds it."""
    try:
        await asyncio.wait_for(handle.where.remote(), timeout=5)
    except ActorUnavailableError:  # a RayActorError, said of one exiting too: not yet gone
        return False
    except RayActorError:
        return True
    except TimeoutError:
        return False
    return False


async def test_activation_adopts_a_standby_and_the_set_is_refilled(make_env: Any) -> None:
    async with make_env() as env:
        activator = activator_of(env)
        standby = activator.standby
        assert standby is not None
        before = list(standby._ready)
        pids = await ready_pids(activator)
        assert standby.started == SIZE
        sid = await env.submit(doc="PR-A")
        # Taken from the prepared set: the actor running the session is a standby that
        # was up before the request, so no process started for it.
        adopted = activator._adopted[sid]
        assert adopted is before[0]
        assert (await adopted.where.remote())["pid"] == pids[0]
        await reach(env, sid, S.SUSPENDED)
        await eventually(lambda: exited(adopted), what="the actor exits once its session sleeps")
        await standby.filled()
        assert standby.ready == SIZE and standby.started == SIZE + 1  # one refill per adoption
        assert session_actors(env.settings.namespace) == []  # no named actor was started
        # The wake-up is adopted by the next standby, and it too exits afterwards.
        second = standby._ready[0]
        await env.answer(sid, {"status": "approved"})
        await reach(env, sid, S.COMPLETED)
        await eventually(lambda: exited(second), what="the second actor exits")
        await standby.filled()
        assert standby.started == SIZE + 2


class NoActivation:
    """Makes the session, activates nothing: the test asks the activator itself."""

    async def request(self, session_id: str, *, reason: Reason, agent: str | None = None) -> None:
        return None


async def test_requests_at_once_for_one_session_take_one_standby(make_env: Any) -> None:
    """The deadline loop and a sweep can ask for one session together: one standby adopts
    it and the other requests go to that actor (each took a standby of its own, which
    found the session leased and exited: a process start spent for nothing)."""
    async with make_env(hold="extract") as env:
        activator = activator_of(env)
        standby = activator.standby
        assert standby is not None
        await standby.filled()
        ready = list(standby._ready)
        created = await SessionService(env.services, NoActivation()).submit(
            tenant="acme", agent="purchase", input={"doc": "PR-T", "amount": 100.0}
        )
        sid = created.session_id
        await asyncio.gather(
            *(activator.request(sid, reason=Reason.EVENT, agent="purchase") for _ in range(3))
        )
        taken = [h for h in ready if h not in standby._ready]
        assert len(taken) == 1, f"{len(taken)} standbys taken for one session"
        assert activator._adopted.get(sid) is taken[0]

        async def held() -> bool:
            return "PR-T" in await env.world.entries("held")

        await eventually(held, what="the adopted standby runs the session, held in a tool")
        await env.world.open_gate("extract")
        await reach(env, sid, S.SUSPENDED)
        assert list((await env.world.counts("extract")).values()) == [1]


async def test_a_dead_standby_does_not_lose_the_activation(make_env: Any) -> None:
    async with make_env() as env:
        activator = activator_of(env)
        doomed = activator.standby._ready[0]  # type: ignore[union-attr]
        os.kill((await doomed.where.remote())["pid"], signal.SIGKILL)
        await eventually(lambda: exited(doomed), what="the standby is dead")
        sid = await env.submit(doc="PR-K")
        await reach(env, sid, S.SUSPENDED)
        assert activator._adopted.get(sid) is not doomed


async def test_an_adopted_actor_that_does_not_answer_is_killed_and_replaced(
    make_env: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A paused process (or a node gone but not declared dead) holds its session's
    adoption: the next request waits for it, then kills it (as the named path does) and
    hands the session to another standby, instead of leaving it to wake later."""
    monkeypatch.setattr(ray_activator, "ACTIVATE_TIMEOUT_S", 2.0)
    async with make_env(hold="extract") as env:
        sid = await env.submit(doc="PR-Q")

        async def held() -> bool:
            return "PR-Q" in await env.world.entries("held")

        await eventually(held, what="the adopted actor runs the session, held in a tool")
        activator = activator_of(env)
        silent = activator._adopted[sid]
        pid = (await silent.where.remote())["pid"]
        os.kill(pid, signal.SIGSTOP)
        try:
            await activator.request(sid, reason=Reason.EVENT, agent="purchase")
            await eventually(lambda: answers_not(silent), what="the silent actor is killed")
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        assert activator._adopted.get(sid) is not silent


async def answers_not(handle: Any) -> bool:
    """Dead to Ray (a paused actor neither answers nor is dead: False)."""
    try:
        await asyncio.wait_for(handle.where.remote(), timeout=1.0)
    except RayActorError:
        return True
    except TimeoutError:
        return False
    return False


async def test_two_actors_for_one_session_never_run_it_at_once(make_env: Any) -> None:
    async with make_env(hold="extract") as env:
        sid = await env.submit(doc="PR-L")

        async def held() -> bool:
            return "PR-L" in await env.world.entries("held")

        await eventually(held, what="the first actor runs the session, held in a tool")
        # A second activator (another replica) hands the same session to its own standby:
        # the lease keeps it out while the first runs.
        other = RayActivator(env.services)
        assert other.standby is not None
        await other.standby.filled()
        try:
            rival = other.standby._ready[0]
            await other.request(sid, reason=Reason.EVENT, agent="purchase")
            await eventually(lambda: exited(rival), what="the rival found the session busy")
        finally:
            await other.close()
        await env.world.open_gate("extract")
        await reach(env, sid, S.SUSPENDED)
        assert list((await env.world.counts("extract")).values()) == [1]


async def test_a_quiet_spell_longer_than_the_idle_time_keeps_the_set_ready(
    make_env: Any,
) -> None:
    """Nobody adopts a standby for longer than ``standby_idle_s``: while their activator
    lives, it keeps them (each told so well within the idle time), so the first
    activation after a quiet night is still adopted by a standby started before it, and
    no process starts for it. (They exited, and the next activation tried each dead one
    before starting a named actor, a process start on the request's path.)"""
    async with make_env(idle_s=IDLE_S) as env:
        activator = activator_of(env)
        standby = activator.standby
        assert standby is not None
        before = list(standby._ready)
        pids = await ready_pids(activator)
        # The quiet spell itself is what is tested: time must pass, nothing is awaited.
        await asyncio.sleep(2.5 * IDLE_S)
        assert await ready_pids(activator) == pids, "the same standbys, alive"
        sid = await env.submit(doc="PR-Q")
        assert activator._adopted[sid] is before[0]
        await reach(env, sid, S.SUSPENDED)
        # The replacement's process is made off the loop (``create_named``), so it is
        # counted once the set is whole again, not the moment the standby is taken.
        await standby.filled()
        assert standby.started == SIZE + 1  # the adopted one's replacement only
        assert session_actors(env.settings.namespace) == []


async def test_the_standbys_of_an_activator_that_is_gone_exit_after_their_idle_time(
    make_env: Any,
) -> None:
    """A set nobody keeps (its activator died: no call comes to say otherwise) frees its
    processes after ``standby_idle_s``, and so does a standby whose holder died before
    it was up (nobody ever asked it whether it is ready)."""
    async with make_env(idle_s=IDLE_S) as env:
        activator = activator_of(env)
        orphans = StandbySet(SIZE, activator._spawn_standby)  # as an activator that died
        await orphans.filled()
        unasked = await activator._spawn_standby()
        handles = [*orphans._ready, unasked]

        async def all_exited() -> bool:
            return all([await exited(h) for h in handles])

        await eventually(all_exited, timeout_s=60, what="the orphaned standbys exit")
        assert all([not await exited(h) for h in activator.standby._ready])  # type: ignore[union-attr]


@pytest.mark.parametrize("idle_s", [IDLE_S, 0.0], ids=["idling", "never-idle"])
async def test_a_ready_standby_that_dies_is_replaced_before_any_activation_needs_it(
    make_env: Any, idle_s: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its activator notices when keeping it (no answer) and starts another: the set is
    whole again before an activation would have tried the dead one. Standbys that never
    idle out (``standby_idle_s = 0``) are looked at too, if less often."""
    monkeypatch.setattr(ray_activator, "CHECK_EVERY_S", IDLE_S / 4)
    async with make_env(idle_s=idle_s) as env:
        activator = activator_of(env)
        standby = activator.standby
        assert standby is not None
        doomed = standby._ready[0]
        with metrics.tap() as read:
            os.kill((await doomed.where.remote())["pid"], signal.SIGKILL)

            async def replaced() -> bool:
                return standby.lost == 1 and standby.ready == SIZE

            await eventually(replaced, timeout_s=30, what="the dead standby is replaced")
        assert doomed not in standby._ready and standby.started == SIZE + 1
        assert read.counter(STANDBYS, event="lost") == 1
        assert read.counter(STANDBYS, event="started") == 1


async def test_a_long_lived_activator_fills_its_set_before_any_activation(
    make_env: Any,
) -> None:
    """A Serve replica's or the reconciler's activator starts its standbys when it is
    made (``start_standbys``), not when the first activation finds none ready; one made
    for a single delivery keeps none."""
    async with make_env(idle_s=IDLE_S) as env:
        assert RayActivator(env.services, standbys=False).standby is None
        other = RayActivator(env.services)
        try:
            standby = other.standby
            assert standby is not None and standby.started == 0
            other.start_standbys()

            async def full() -> bool:
                return standby.ready == SIZE

            await eventually(full, timeout_s=60, what="the new activator's set is filled")
        finally:
            await other.close()


def named_standbys(namespace: str, holder: str) -> list[str]:
    from ray.util import list_named_actors

    prefix = standby_prefix(holder)
    return sorted(
        a["name"]
        for a in list_named_actors(all_namespaces=True)
        if a["namespace"] == namespace and a["name"].startswith(prefix)
    )


async def test_a_restarted_holder_takes_over_the_free_standbys_its_predecessor_left(
    make_env: Any,
) -> None:
    """A holder with a stable name names its standbys after itself; its next incarnation
    finds them and keeps them as its own set (no process started), where it started a
    whole new set while the old one idled out. A set already full stops what it finds
    past its size; a holder restarted on other settings stops what it finds and starts
    its own (a standby runs sessions on the settings it was started with)."""
    async with make_env() as env, incarnations(env) as holder:
        first = holder.incarnation()
        left = list((await filled_from_start(first))._ready)
        names = named_standbys(env.settings.namespace, holder.name)
        assert len(names) == SIZE
        abandon(first)  # its holder dies: nothing keeps the set, the actors live on
        with metrics.tap() as read:
            second = holder.incarnation()
            standby = await filled_from_start(second)
        assert standby.inherited == SIZE and standby.started == 0
        assert set(standby._ready) == set(left)
        assert named_standbys(env.settings.namespace, holder.name) == names
        assert read.counter(STANDBYS, event="inherited") == SIZE
        assert read.counter(STANDBYS, event="started") == 0
        # A set with one slot takes one of what it finds and stops the other.
        small = StandbySet(1, second._spawn_standby)

        async def found() -> list[Any]:
            return left

        assert await small.inherit(found, env.settings) == 1
        stopped = [h for h in left if h not in small._ready]
        await eventually(lambda: exited(stopped[0]), what="the one past the size stops")
        # Restarted on other settings: what it finds is stopped, not handed sessions.
        abandon(second)
        runtime = env.settings.runtime.model_copy(update={"standby_idle_s": 300.0})
        changed = env.settings.model_copy(update={"runtime": runtime})
        third = holder.incarnation(ConfigRef.of(changed))
        renewed = await filled_from_start(third)
        assert renewed.inherited == 0 and renewed.started == SIZE
        assert not set(renewed._ready) & set(left)

        async def all_left_exited() -> bool:
            return all([await exited(h) for h in left])

        # Each look asks every one with a 5 s deadline (silence, an actor busy exiting on
        # a loaded machine, is "not yet"): a few looks need more than the usual 20 s.
        await eventually(
            all_left_exited, timeout_s=60, what="the standbys on the old settings stop"
        )
        # Restarted with no standby set at all: it stops what it finds, and starts none.
        abandon(third)
        left = list(renewed._ready)
        runtime = env.settings.runtime.model_copy(update={"standby_session_actors": 0})
        none = env.settings.model_copy(update={"runtime": runtime})
        fourth = holder.incarnation(ConfigRef.of(none), settings=none)
        fourth.start_standbys()
        assert fourth.standby is None
        assert fourth._predecessor is not None
        # Its start ends once each it found has answered that it goes (or been asked its
        # last time): then they exit.
        await asyncio.wait_for(fourth._predecessor, timeout=60)
        await eventually(
            all_left_exited, timeout_s=60, what="a holder with no set stops what it finds"
        )
        assert named_standbys(env.settings.namespace, holder.name) == []


async def test_a_retired_standby_held_by_a_call_that_never_ends_still_exits(
    make_env: Any,
) -> None:
    """Ray lets an async actor that called ``exit_actor`` go only once every call it runs
    has ended, and answers none meanwhile: a retired standby with a call that never ends
    (here ``finished``, which waits for a session it was never handed) stayed alive and
    silent for ever, and its retire was "not answered" (a CI run's holder saw this). Its
    process now ends ``runtime.actor_exit_grace_s`` after its exit."""
    async with make_env() as env:
        runtime = env.settings.runtime.model_copy(update={"actor_exit_grace_s": 1.0})
        settings = env.settings.model_copy(update={"runtime": runtime})
        handle = SessionActor.options(  # type: ignore[attr-defined]
            name=standby_name(f"t-held-{uuid.uuid4().hex[:8]}"),
            namespace=settings.namespace,
            lifetime="detached",
        ).remote(ConfigRef.of(settings), None, 0)
        try:
            await asyncio.wait_for(handle.ready.remote(), timeout=60)
            never = handle.finished.remote()  # runs until a session it never gets ends
            assert await ask_to_retire(handle, grace_s=1.0) is True, "the retire was not answered"
            await eventually(lambda: exited(handle), timeout_s=30, what="the standby exits")
            with pytest.raises(RayActorError):
                await asyncio.wait_for(never, timeout=30)
        finally:
            with contextlib.suppress(Exception):
                ray.kill(handle, no_restart=True)


async def test_a_restarted_holder_leaves_a_standby_with_a_session_to_run_it(
    make_env: Any,
) -> None:
    """A standby the dead holder handed a session is neither taken into the new set nor
    retired: it runs its session to its sleep, once."""
    async with make_env(hold="extract") as env, incarnations(env) as holder:
        first = holder.incarnation()
        runner = (await filled_from_start(first))._ready[0]
        submitted = await SessionService(env.services, first).submit(
            tenant="acme", agent="purchase", input={"doc": "PR-H", "amount": 100.0}
        )
        sid = submitted.session_id
        assert first._adopted[sid] is runner

        async def held() -> bool:
            return "PR-H" in await env.world.entries("held")

        await eventually(held, what="the standby runs the session, held in a tool")
        abandon(first)
        second = holder.incarnation()
        standby = await filled_from_start(second)
        assert runner not in standby._ready and not await exited(runner)
        await env.world.open_gate("extract")
        await reach(env, sid, S.SUSPENDED)
        assert list((await env.world.counts("extract")).values()) == [1]


class Incarnations:
    """One holder with a stable name, and the activators that were it in turn (each as
    if Ray had restarted it: the standbys of the one before live on)."""

    def __init__(self, env: RayEnv) -> None:
        self.env = env
        self.name = f"t-holder-{uuid.uuid4().hex[:8]}"
        self.made: list[RayActivator] = []

    def incarnation(
        self, config: ConfigRef | None = None, *, settings: Settings | None = None
    ) -> RayActivator:
        services = self.env.services
        if settings is not None:  # what the activator itself reads (its set's size)
            services = dataclasses.replace(services, settings=settings)
        activator = RayActivator(services, config, holder=self.name)
        self.made.append(activator)
        return activator


@asynccontextmanager
async def incarnations(env: RayEnv) -> AsyncIterator[Incarnations]:
    holder = Incarnations(env)
    try:
        yield holder
    finally:
        for activator in holder.made:
            await activator.close()


def abandon(activator: RayActivator) -> None:
    """As if the activator's process died: its keeping and starting stop, its standby
    actors live on (``close`` would stop them)."""
    assert activator.standby is not None
    for task in list(activator.standby._tasks):
        task.cancel()


async def filled_from_start(activator: RayActivator) -> StandbySet:
    activator.start_standbys()
    standby = activator.standby
    assert standby is not None

    async def full() -> bool:
        return standby.ready == SIZE

    await eventually(full, timeout_s=60, what="the set is filled")
    return standby


async def test_a_killed_reconciler_takes_over_the_standbys_it_kept(make_env: Any) -> None:
    """The reconciler (Ray restarts it when its process dies) keeps a standby set of its
    own. Killed (SIGKILL), its next incarnation keeps the same standby actors: no
    process start, none left over to idle out for ``standby_idle_s``."""
    async with make_env() as env:
        namespace = env.settings.namespace
        handle = ensure_reconciler(env.settings)
        try:

            def standbys() -> dict[str, int] | None:
                try:
                    status = ray.get(handle.status.remote(), timeout=5)
                except (GetTimeoutError, RayActorError):  # restarting
                    return None
                found: dict[str, int] | None = status.get("standbys")
                return found

            def full() -> bool:
                return (standbys() or {}).get("ready") == SIZE

            await eventually(full, timeout_s=90, interval_s=0.5, what="its set is filled")
            names = named_standbys(namespace, RECONCILER)
            assert len(names) == SIZE
            pid = ray.get(handle.pid.remote(), timeout=10)
            os.kill(pid, signal.SIGKILL)

            def restarted_and_full() -> bool:
                try:
                    if ray.get(handle.pid.remote(), timeout=5) == pid:
                        return False
                except (GetTimeoutError, RayActorError):
                    return False
                return full()

            await eventually(
                restarted_and_full, timeout_s=120, interval_s=0.5, what="the new incarnation"
            )
            assert standbys() == {"ready": SIZE, "started": 0, "lost": 0, "inherited": SIZE}
            assert named_standbys(namespace, RECONCILER) == names
        finally:
            ray.kill(handle, no_restart=True)
            for name in named_standbys(namespace, RECONCILER):
                with contextlib.suppress(ValueError):
                    ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
