"""Get a session activated on Ray, in its agent's placement.

Dedicated: race-safe get-or-create of the session's named actor, then an activation
request. Ray may hand back an actor that has just decided to exit (ray#44083); it answers
``closing`` or dies under the call, and we retry until a fresh one takes the request.
Pooled: an activation request to the host that ``hash(session_id)`` selects, through its
channel in the index's Redis (``actors.pool``), or as a Ray call where there is none
(``actors.pool_hosts``).

With ``runtime.standby_session_actors`` set, a dedicated activation first hands the
session to a pre-started standby actor (``actors.standby``), which runs it and exits
when it sleeps, as a named one does. This activator remembers which actor it gave a
session, so a second request while it runs goes to the same actor. Another activator
may hand the same session to another actor at the same time; the session's lease lets
only one of them run it (the other finds it busy, and the runner re-reads the inbox
after it lets the lease go). With no standby ready, the named get-or-create below runs.

Dedicated actors cost a process each (``num_cpus=0`` puts no bound on them), so an
activator admits at most ``max_live_session_actors`` live ones it started. A request past
the cap is deferred, never dropped: it leaves a RETRY timer, and the reconciler asks again.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import ray

from actors import named
from actors.activation_calls import (
    ACTIVATE_TIMEOUT_S,
    DEDICATED_BACKOFF,
    MAX_ATTEMPTS,
    RETRYABLE,
)
from actors.admission import Admission
from actors.config_ref import ConfigRef
from actors.named import create_named, gcs_call, kill, kill_now, named_actors, typed_timeouts
from actors.pool_hosts import PoolHosts, pool_slot
from actors.session_actor import ACCEPTED, SessionActor, actor_name
from actors.standby import START_TIMEOUT_S, StandbySet
from actors.standby_inheritance import ask_to_retire, left_by, standby_name
from storage.factory import check_embedded_allowed
from torpor import tracing
from torpor.backoff import Backoff
from torpor.errors import ActivationUnavailable, SessionNotFound
from torpor.ports import Reason, TimerKind
from torpor.ports.services import Services
from torpor.settings import Placement, Settings

# ``Admission`` and ``pool_slot`` live in modules of their own; imported from here too.
__all__ = ["Admission", "RayActivator", "alive_nodes", "check_storage", "pool_slot"]

log = logging.getLogger(__name__)

# How often standbys with no idle time (``standby_idle_s = 0``) are checked for life.
CHECK_EVERY_S = 30.0
# The whole of a dedicated activation, a standby's adoption and every attempt after it:
# what one attempt is given, a process start on a loaded node and the answer after it.
# A first start that needs all of it is not cut short (a burst of slow starts, each
# killed before it answered, ran no session at all), and the retries after an actor that
# died under the call (one that had just decided to exit, ray#44083) take milliseconds
# each and fit in what is left. Past it the request fails, typed and retryable, and its
# caller's retry timer brings it round: retrying on inside one request made it last
# hours (40 attempts of a start, an answer and a kill each) while it held a coalescer's
# slot or a sweep. Not ``runtime.activation_max_s``: that bounds a session's run, which
# starts only once an actor took the request. The kill of a silent actor keeps its own
# deadline after this one (see there).
DEDICATED_DEADLINE_S = START_TIMEOUT_S + ACTIVATE_TIMEOUT_S


def alive_nodes() -> int:
    """The cluster's live nodes: one blocking GCS call (``RayActivator.made`` makes it
    off the loop)."""
    nodes: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]
    return len([node for node in nodes if node.get("Alive")])


def check_storage(settings: Settings, nodes: int | None) -> None:
    """``check_embedded_allowed`` for an activator; ``nodes``: the live nodes, counted
    already (off the loop), or None to count them here. They decide only for embedded
    storage (memory storage is refused anywhere, and any other is shared across hosts):
    for that storage alone is the GCS asked, on every activator made, as before."""
    if nodes is None:
        nodes = alive_nodes() if settings.embedded else 1  # 1: not read for that storage
    check_embedded_allowed(settings, alive_nodes=nodes)


@dataclass
class _Turn:
    """Requests for one session taking their turn at its adoption."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    waiting: int = 0


class RayActivator:
    def __init__(
        self,
        services: Services,
        config: ConfigRef | None = None,
        *,
        standbys: bool = True,
        holder: str | None = None,
        nodes: int | None = None,
    ) -> None:
        """``standbys``: whether this activator keeps the standby session actors the
        settings ask for. An activator made for one request (a work outcome's delivery)
        must not: each would start processes that nobody adopts. ``holder``: a name
        that outlives this process (the reconciler's; one holder per namespace), under
        which the standbys are named: a restarted holder's ``start_standbys`` takes over
        the free ones its predecessor left. ``nodes``: the cluster's live nodes, when
        the caller counted them already (``made``, on an event loop); counted here
        otherwise, with a blocking GCS call, and only for embedded storage
        (``check_storage``)."""
        self.services = services
        self.settings: Settings = services.settings
        # What the session actors are handed: never the resolved settings (see config_ref).
        self.config = config or ConfigRef.of(services.settings)
        self.namespace = self.settings.namespace
        check_storage(self.settings, nodes)
        self._placements: OrderedDict[str, Placement] = OrderedDict()
        self.pool_hosts = PoolHosts(
            self.config,
            namespace=self.namespace,
            size=self.settings.pool.size,
            services=services,
        )
        self.admission = Admission(
            self.settings.runtime.max_live_session_actors, alive=self._live_sessions
        )
        size, idle_s = (
            self.settings.runtime.standby_session_actors,
            self.settings.runtime.standby_idle_s,
        )
        # Kept well within their idle time (``StandbySet._keep``: at least every half of
        # it while the activator lives). Standbys that never idle out are still looked at
        # now and then: a dead one would otherwise be found only by the activation that
        # takes it, a process start on that activation's path.
        keep_every_s = idle_s / 4 if idle_s > 0 else CHECK_EVERY_S
        self.standby = (
            StandbySet(size, self._spawn_standby, keep_every_s=keep_every_s)
            if size > 0 and standbys
            else None
        )
        self._holder = holder
        # What the holder's predecessor left: taken over (``_inherit_then_fill``), or
        # retired when this one keeps no set (``_retire_left``).
        self._predecessor: asyncio.Task[None] | None = None
        # Sessions this activator handed to an actor (a standby, or a named one while it
        # keeps standbys), until their actor is done.
        self._adopted: dict[str, Any] = {}
        self._adopting: dict[str, _Turn] = {}  # a session's adoption under way
        self._watchers: set[asyncio.Task[None]] = set()

    @classmethod
    async def made(
        cls,
        services: Services,
        config: ConfigRef | None = None,
        *,
        standbys: bool = True,
        holder: str | None = None,
    ) -> RayActivator:
        """As the constructor, for a caller on an event loop (a watcher delivering an
        outcome makes one per delivery): the nodes its storage check counts are counted
        off the loop, with the lookups' deadline (``ClusterUnavailable`` past it, as
        retryable as the delivery). ``ray.nodes()`` blocks until the GCS answers (Ray's
        deadline: 60 s), and the watcher's loop (its progress reports, its stop) waited."""
        nodes = None
        if services.settings.embedded:
            nodes = await gcs_call(alive_nodes, "counting the cluster's nodes")
        return cls(services, config, standbys=standbys, holder=holder, nodes=nodes)

    async def request(
        self,
        session_id: str,
        *,
        reason: Reason,
        agent: str | None = None,
        requested_at: float | None = None,
    ) -> None:
        requested_at = time.time() if requested_at is None else requested_at
        placement = await self._placement(session_id, agent)
        if placement is Placement.POOLED:
            await self.pool_hosts.request(session_id, reason, requested_at)
        elif await self.admission.admit(session_id):
            await self._dedicated(session_id, reason, requested_at)
        else:
            await self._defer(session_id)

    async def _defer(self, session_id: str) -> None:
        """Past the cap: the request waits durably as a RETRY timer (jittered, so a
        backlog comes back spread out), and the reconciler asks again."""
        config = self.services.config
        delay = Backoff(
            base_s=config.retry_delay.total_seconds(), cap_s=3600.0, jitter=0.2
        ).delay_s(0)
        at = self.services.clock.now() + timedelta(seconds=delay)
        await self.services.index.schedule(kind=TimerKind.RETRY, member=session_id, at=at)

    async def _live_sessions(self) -> set[str]:
        prefix = actor_name("")
        with typed_timeouts("counting the live session actors"):
            named = await named_actors(self.namespace, prefix)
        return {name.removeprefix(prefix) for name in named} | set(self._adopted)

    async def _placement(self, session_id: str, agent: str | None) -> Placement:
        if agent is None and session_id in self._placements:
            return self._placements[session_id]
        if agent is None:
            try:
                agent = (await self.services.snapshots.header(session_id)).agent
            except SessionNotFound:
                agent = ""
        config = self.settings.agents.get(agent)
        placement = config.placement if config else Placement.DEDICATED
        self._placements[session_id] = placement
        if len(self._placements) > 10_000:
            self._placements.popitem(last=False)
        return placement

    async def _spawn_standby(self) -> Any:
        return await create_named(
            SessionActor,
            self.config,
            None,
            self.settings.runtime.standby_idle_s,
            name=standby_name(self._holder),
            # No ``runtime_env`` of its own: it runs the holder's (``inheritance_key``).
            namespace=self.namespace,
            lifetime="detached",  # an adopted one outlives this activator
            scheduling_strategy="SPREAD",
            # Made after its start was given up (the set closed, or the GCS answered
            # late): nobody knows its random name, and with ``standby_idle_s = 0`` it
            # waited for a session for ever.
            abandoned=kill_now,
        )

    async def _adopt(
        self,
        session_id: str,
        reason: Reason,
        requested_at: float,
        *,
        deadline: float | None = None,
    ) -> bool:
        """The session's request taken by its adopted actor, or by a fresh standby.
        False when no standby is ready (the caller starts a named actor instead).
        ``ActivationUnavailable`` (retryable) when ``deadline`` (loop time; default:
        ``DEDICATED_DEADLINE_S`` from now) cut short a wait for an actor's answer.

        One at a time for a session: a second request while the first's adoption is
        still out (the deadline loop and a sweep ask the same activator at once) took a
        second standby, which found the session leased and exited: a process spent.
        After its turn it finds the adopted actor and hands the request to it."""
        if deadline is None:
            deadline = asyncio.get_running_loop().time() + DEDICATED_DEADLINE_S
        turn = self._adopting.get(session_id)
        if turn is None:
            turn = self._adopting[session_id] = _Turn()
        turn.waiting += 1
        try:
            async with turn.lock:
                return await self._adopt_now(session_id, reason, requested_at, deadline)
        finally:
            turn.waiting -= 1
            if not turn.waiting:
                del self._adopting[session_id]

    async def _adopt_now(
        self, session_id: str, reason: Reason, requested_at: float, deadline: float
    ) -> bool:
        assert self.standby is not None
        loop = asyncio.get_running_loop()
        running = self._adopted.get(session_id)
        if running is not None:
            wait_s = min(ACTIVATE_TIMEOUT_S, deadline - loop.time())
            if wait_s <= 0:  # its turn took the time: asked when the retry timer is due
                raise ActivationUnavailable(f"no time left to ask the actor running {session_id}")
            try:
                answer = await asyncio.wait_for(
                    running.activate.remote(reason.value, requested_at, tracing.traceparent()),
                    timeout=wait_s,
                )
                if answer == ACCEPTED:
                    return True
            except RETRYABLE:
                pass  # gone or going: the session needs a new actor
            except TimeoutError as silent:
                if wait_s < ACTIVATE_TIMEOUT_S:
                    # Cut short by the activation's deadline, not shown silent: kept as
                    # the session's, so the next request gives it its whole time (and no
                    # other actor is given the session meanwhile).
                    raise ActivationUnavailable(
                        f"the actor running {session_id} did not answer by the deadline"
                    ) from silent
                # It answers at once when alive, as on the named path: silence is a node
                # gone but not yet declared dead, or a paused process. Killed, so it
                # cannot wake later and run on beside the next (its lease and the
                # generation compare-and-swap would stop it, at the cost of its work).
                await kill(running, f"killing the silent actor running {session_id}")
            if self._adopted.get(session_id) is running:
                del self._adopted[session_id]
        while loop.time() < deadline and (handle := self.standby.take()) is not None:
            wait_s = min(ACTIVATE_TIMEOUT_S, deadline - loop.time())
            try:
                answer = await asyncio.wait_for(
                    # the caller's trace crosses into the standby, as into a named actor
                    handle.adopt.remote(
                        session_id, reason.value, requested_at, tracing.traceparent()
                    ),
                    timeout=wait_s,
                )
            except RETRYABLE:
                continue  # this standby died while it waited: the next one
            except TimeoutError as silent:
                # Killed even when the deadline cut its time short: taken from the set,
                # it is known to nobody else, and a silent one was a process for ever.
                await kill(handle, f"killing a silent standby given {session_id}")
                if wait_s < ACTIVATE_TIMEOUT_S:
                    raise ActivationUnavailable(
                        f"no standby given {session_id} answered by the deadline"
                    ) from silent
                continue
            if answer == ACCEPTED:
                self._running(session_id, handle)
                return True
        return False

    def _running(self, session_id: str, handle: Any) -> None:
        """``handle`` runs the session: this activator's next requests for it go there,
        until it is done."""
        self._adopted[session_id] = handle
        watcher = asyncio.create_task(self._forget_when_done(session_id, handle))
        self._watchers.add(watcher)
        watcher.add_done_callback(self._watchers.discard)

    async def _forget_when_done(self, session_id: str, handle: Any) -> None:
        with contextlib.suppress(*RETRYABLE):
            await handle.finished.remote()
        if self._adopted.get(session_id) is handle:
            del self._adopted[session_id]

    def start_standbys(self) -> None:
        """Start filling the standby set now (in an event loop), not at the first
        activation, which would start its own process on the request's path: what a
        long-lived activator does when it is made (a Serve replica's, the reconciler's)."""
        if self.standby is None:
            none_wanted = self.settings.runtime.standby_session_actors == 0
            if none_wanted and self._holder is not None and self._predecessor is None:
                self._predecessor = asyncio.create_task(self._retire_left(self._holder))
            return
        if self._holder is None:
            self.standby.refill()
        elif self._predecessor is None:
            self._predecessor = asyncio.create_task(self._inherit_then_fill(self.standby))

    async def _inherit_then_fill(self, standby: StandbySet) -> None:
        """A stable holder's first fill: the free standbys its predecessor left (Ray
        restarted the holder after its process died), then new ones for what is short.
        Without it each restart started a whole set while the old one idled out. The
        left ones not taken are asked to go behind the fill (``StandbySet.retired``)."""
        assert self._holder is not None
        try:
            # What the standbys run on is what they load from ``config``, as this would.
            joined = await standby.inherit(
                functools.partial(left_by, self._holder, self.namespace), self.config.load()
            )
            if joined:
                log.info("took over %d standby session actors left by the last holder", joined)
        except Exception:  # nothing to take over is not fatal: the set is filled anew
            log.warning("taking over the standby session actors left failed", exc_info=True)
        standby.refill()  # not when cancelled (``close``)

    async def _retire_left(self, holder: str) -> None:
        """A stable holder that keeps no standbys now (``standby_session_actors`` = 0)
        retires the free ones its predecessor left: nothing would keep them, and they
        wait for sessions on the settings they were started with."""
        try:
            left = await left_by(holder, self.namespace)
            # Asked, never killed (as ``StandbySet.inherit``): one running a session
            # declines and runs it, and one too busy to answer is asked again.
            grace_s = self.settings.runtime.actor_exit_grace_s
            answered = await asyncio.gather(*(ask_to_retire(h, grace_s=grace_s) for h in left))
            if left:
                log.info(
                    "asked %d standby session actors left by the last holder to go (%d answered)",
                    len(left),
                    sum(answered),
                )
        except Exception:  # they still exit at the end of their idle time
            log.warning("retiring the standby session actors left failed", exc_info=True)

    async def close(self) -> None:
        """Free the standby actors nobody adopted (adopted ones finish their session)."""
        if self._predecessor is not None:
            self._predecessor.cancel()
            await asyncio.gather(self._predecessor, return_exceptions=True)
        for watcher in list(self._watchers):
            watcher.cancel()
        await self.pool_hosts.close()
        if self.standby is not None:
            await self.standby.close()

    async def _dedicated(self, session_id: str, reason: Reason, requested_at: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DEDICATED_DEADLINE_S  # the whole activation's, adoption too
        if self.standby is not None and await self._adopt(
            session_id, reason, requested_at, deadline=deadline
        ):
            return
        # Why the last attempt failed, for the error raised after it: its own error (the
        # actor died under the call, or was silent), kept as the cause, or its answer.
        last: Exception | None = None
        answer: object = None
        attempts = 0
        while attempts < MAX_ATTEMPTS and loop.time() < deadline:
            attempts += 1
            last = answer = None
            try:
                # Off the loop (a lookup, then the name's registration: GCS calls a
                # replica's webhooks waited behind). Past its deadline, ours or Ray's
                # own, the request fails with ``ClusterUnavailable`` (not retried here:
                # ``RETRYABLE`` holds ``GetTimeoutError``) and its timer brings it
                # round; an actor the GCS makes after that is found by its name then.
                with typed_timeouts(f"making actor {actor_name(session_id)!r}"):
                    handle = await create_named(
                        SessionActor,
                        self.config,
                        session_id,
                        name=actor_name(session_id),
                        namespace=self.namespace,
                        get_if_exists=True,
                        lifetime="detached",
                        # Spread sessions over the cluster: losing a node then costs a
                        # slice of the running sessions, not all of them.
                        scheduling_strategy="SPREAD",
                        timeout_s=min(named.LOOKUP_TIMEOUT_S, deadline - loop.time()),
                    )
                try:
                    # Started first, with the time a process start may take: the answer's
                    # deadline below counted it too, and a burst of starts on a busy node
                    # (each longer than that) killed every actor before it answered and
                    # made it again: no session ever ran. One that runs answers at once.
                    # Neither wait outlasts the activation's deadline.
                    wait_s = min(START_TIMEOUT_S, deadline - loop.time())
                    cut_short = wait_s < START_TIMEOUT_S
                    await asyncio.wait_for(handle.ready.remote(), timeout=wait_s)
                    wait_s = min(ACTIVATE_TIMEOUT_S, deadline - loop.time())
                    cut_short = wait_s < ACTIVATE_TIMEOUT_S
                    answer = await asyncio.wait_for(
                        # the caller's trace crosses into the actor as a traceparent
                        handle.activate.remote(reason.value, requested_at, tracing.traceparent()),
                        timeout=wait_s,
                    )
                except TimeoutError as silent:
                    last = silent
                    if cut_short:
                        # The activation's deadline, not the actor's own: not shown
                        # silent (a start on a loaded node, an answer on its way), it
                        # keeps its name, and the request the retry timer brings round
                        # finds it and gives it its whole time (killed then if silent).
                        break
                    # An activation request answers at once; silence means the actor's
                    # node is gone but not yet declared dead. Free the name: the session is
                    # safe (its lease and the generation CAS), and the next attempt starts
                    # afresh. Off the loop, and its own failure (logged) is not the
                    # request's: raised here, it replaced the attempts left, untyped.
                    # Its own deadline even past the activation's: a kill cut short left
                    # the silent actor its name, and the request that the retry timer
                    # brings round found it again and waited on it again.
                    await kill(handle, f"killing silent actor {actor_name(session_id)!r}")
                    continue
                if answer == ACCEPTED:
                    if self.standby is not None:
                        # Remembered as an adopted one is: a request while it runs went
                        # to a fresh standby (none was ready for the first, one is now),
                        # which found the session leased and exited, a process started
                        # per request for nothing.
                        self._running(session_id, handle)
                    return
            except RETRYABLE as died:
                last = died  # the actor died between lookup and call: make a new one
            pause = DEDICATED_BACKOFF.delay_s(attempts - 1)
            if loop.time() + pause >= deadline:
                break  # no time for another attempt: the caller's retry timer makes it
            await asyncio.sleep(pause)
        if not attempts:  # its turn at adoption took the time
            raise ActivationUnavailable(
                f"no time left for {session_id}'s request ({DEDICATED_DEADLINE_S:g} s at most)"
            )
        answered = f" (the last answered {answer!r})" if last is None else ""
        raise ActivationUnavailable(
            f"no session actor for {session_id} took the request in {attempts} attempts"
            f" ({DEDICATED_DEADLINE_S:g} s at most){answered}"
        ) from last

    async def warm(self) -> None:
        """Start every pool host and wait until each answers (``PoolHosts.warm``)."""
        await self.pool_hosts.warm()
