"""Dedicated placement: one named Ray actor per live session, gone while it sleeps.

The actor runs activations for its session until nothing more is asked of it, then drops
every reference and exits with ``ray.actor.exit_actor()``. While a session waits, no actor
of it exists: its whole state is the snapshot in object storage.

Requests are coalesced: a request while an activation runs only marks "run once more".
Once the actor has decided to exit it answers ``closing``, and the requester retries
until Ray hands it a fresh actor of the same name (ray#44083: a lookup right after an
exit can still return the dying one).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
import logging
import os
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import AsyncioActorExit

if TYPE_CHECKING:
    from actors.config_ref import ConfigRef
    from torpor.ports import Reason
    from torpor.ports.services import Services

log = logging.getLogger(__name__)

ACCEPTED = "accepted"
CLOSING = "closing"
# How long an exiting actor waits for its services to close: the agents' and tools' own
# ``close`` run in there. One that hangs must not keep the actor (and its session's name,
# which answers ``closing`` to every request) alive for ever; the process exit frees the rest.
CLOSE_TIMEOUT_S = 10.0


def actor_name(session_id: str) -> str:
    return f"session:{session_id}"


@ray.remote(num_cpus=0, max_restarts=0)
class SessionActor:
    def __init__(
        self, config: ConfigRef, session_id: str | None = None, idle_s: float | None = None
    ) -> None:
        self._settings = config.load()  # here, not in the caller: no secret in the arguments
        self._session_id = session_id
        self._wanted: list[tuple[Reason, float | None, str | None]] = []
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._done = asyncio.Event()
        self._idle_s = idle_s
        self._idle: asyncio.Task[None] | None = None
        self._warming: asyncio.Task[None] | None = None
        # A standby opens its storage now, before any session waits for it.
        self._services: Services | None = None if session_id else self._open()
        if session_id is None:
            # Its idle time starts from here, not from its holder's first ``ready``: a
            # holder that died before this actor was up never calls it, and the standby
            # would wait for ever. (__init__ runs outside the actor's event loop; Ray
            # runs this call right after it.)
            ray.get_runtime_context().current_actor.ready.remote()

    def _open(self) -> Services:
        from actors.observer import RayObserver
        from actors.wiring import open_services

        return open_services(self._settings, observer=RayObserver())

    async def ready(self) -> int:
        """Answers once constructed and warmed up (the standby set awaits it); the pid.
        A standby's first call starts its idle time and its warm-up, which every call
        then awaits (its own, and its holder's)."""
        if self._session_id is None:
            if self._idle is None and self._idle_s:
                self._idle = asyncio.create_task(self._expire(self._idle_s))
            if self._warming is None and self._services is not None:
                self._warming = asyncio.create_task(self._warm_up(self._services))
        if self._warming is not None:
            await asyncio.shield(self._warming)
        return os.getpid()

    async def keep(self) -> bool:
        """The activator holding this standby lives: its idle time starts again. False
        once it has a session or is closing (its holder then drops it)."""
        if self._session_id is not None or self._closing:
            return False
        if self._idle is not None and self._idle_s:
            self._idle.cancel()
            self._idle = asyncio.create_task(self._expire(self._idle_s))
        return True

    async def inheritable(self, salt: bytes, key: str) -> str:
        """Asked by a holder that took its predecessor's place (``StandbySet.inherit``):
        ``free`` (and kept from now on, as by ``keep``), ``taken`` (it has a session, or
        is on its way out), or ``other`` (it runs other settings or code than ``key``
        names: a holder replaced with new ones must not hand it sessions)."""
        from actors.standby_inheritance import Standing, inheritance_key

        if self._session_id is not None or self._closing:
            return Standing.TAKEN.value
        mine = (await inheritance_key(self._settings, salt)).hex()
        if self._session_id is not None or self._closing:  # adopted meanwhile
            return Standing.TAKEN.value
        if not hmac.compare_digest(mine, key):
            return Standing.OTHER.value
        await self.keep()
        return Standing.FREE.value

    async def retire(self) -> bool:
        """Exit now unless it has a session (which it then runs, as ever): what a holder
        with no place for a standby, or closing, asks. Decided here, on the actor's own
        loop, so no adoption can slip in between the check and the exit."""
        if self._session_id is not None:
            return False
        self._closing = True
        if self._idle is not None:
            self._idle.cancel()
        self._exit()
        return True

    async def _warm_up(self, services: Services) -> None:
        """What the first activation would do anyway, done before any session waits for
        it: load the dedicated agents with their tools, connect to the index. A failure
        here is the activation's to report, not the standby's."""
        from torpor.settings import Placement

        for name, agent in self._settings.agents.items():
            if agent.placement is Placement.DEDICATED:
                with contextlib.suppress(Exception):
                    services.plugins.agent(name)
        with contextlib.suppress(Exception):
            await services.index.ping()

    async def adopt(
        self,
        session_id: str,
        reason: str,
        requested_at: float | None = None,
        traceparent: str | None = None,
    ) -> str:
        """A standby takes ``session_id`` (it runs no other); ``closing`` if it is taken.
        ``traceparent``: the requester's trace, which the activation continues."""
        if self._session_id is None and not self._closing:
            self._session_id = session_id
            if self._idle is not None:
                self._idle.cancel()
        if self._session_id != session_id:
            return CLOSING
        return await self.activate(reason, requested_at, traceparent)

    async def activate(
        self, reason: str, requested_at: float | None = None, traceparent: str | None = None
    ) -> str:
        from torpor.ports import Reason

        if self._closing or self._session_id is None:
            return CLOSING
        self._wanted.append((Reason(reason), requested_at, traceparent))
        if self._task is None:
            self._task = asyncio.create_task(self._run(self._session_id))
        return ACCEPTED

    async def finished(self) -> None:
        """Answers when the session has gone to sleep (or the actor dies under the call)."""
        await self._done.wait()

    async def where(self) -> dict[str, object]:
        """Node and process of this actor (for operators, and for crash tests)."""
        return {"node": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

    async def _expire(self, idle_s: float) -> None:
        """Nobody adopted this standby nor kept it for ``idle_s`` (its activator is gone,
        or was for that long): free the process."""
        await asyncio.sleep(idle_s)
        self._idle = None  # this task: ``retire`` must not cancel it on its way out
        await self.retire()

    async def _run(self, session_id: str) -> None:
        # Its first step runs before the answer to the ``activate`` that made it goes out
        # (Ray sends it from a callback queued behind this task), and the imports and the
        # services' open below hold the loop: 0.8 s on an idle machine, past a loaded
        # one's activation deadline, and the activator took the actor for silent and
        # killed it, again and again. One turn of the loop (in the ``try`` below) lets
        # the answer go first.
        services: Services | None = None
        runtime: Any = None
        try:
            await asyncio.sleep(0)  # inside: a cancel here still ends in ``finally``
            from actors import metrics
            from actors.wiring import session_runtime
            from torpor import tracing

            # Inside the ``try``: a named actor opens its services only now, and one whose
            # open failed (a secret missing from its environment, a store it cannot reach)
            # must still exit. It stayed, its task dead, answering every request
            # "accepted" and running none, under the session's name for ever. The requests
            # it drops are the wake timers' to bring back, to a new actor.
            services = self._services or self._open()
            self._services = None
            node = ray.get_runtime_context().get_node_id()[:8]
            runtime = session_runtime(services, owner=f"dedicated:{node}:{session_id}")
            while True:
                if not self._wanted:
                    # Decided synchronously, with no await in between: a request that comes
                    # after this line is told "closing" and retries on a fresh actor.
                    self._closing = True
                    break
                reason, requested_at, traceparent = self._wanted[0]
                self._wanted.clear()  # one activation serves every request made so far
                try:
                    with tracing.continued(traceparent):
                        result = await runtime.activate(
                            session_id, reason=reason, requested_at=requested_at
                        )
                    metrics.activation(result, placement="dedicated")
                except Exception:
                    # Typed storage errors included: the runtime already scheduled a
                    # retry timer; log and go on to exit.
                    log.exception("activation of %s failed", session_id)
        except Exception:
            log.exception("the actor of %s could not start its session", session_id)
        finally:
            self._closing = True
            with contextlib.suppress(Exception):  # TimeoutError included
                async with asyncio.timeout(CLOSE_TIMEOUT_S):
                    if services is not None:
                        await services.close()
            del runtime, services
            gc.collect()
            self._done.set()
            await asyncio.sleep(0)  # let the answer to ``finished`` go out first
            self._exit()

    def _exit(self) -> None:
        from actors import exit_deadline, metrics

        # First, so that a flush or a call that blocks from here on cannot hold it back.
        exit_deadline.end_by(self._settings.runtime.actor_exit_grace_s, "session actor")
        metrics.flush()  # the counters summed since the last hand-over go with it
        # The exit is scheduled before the exception is raised; suppressing it only
        # keeps "Task exception was never retrieved" out of the logs.
        with contextlib.suppress(AsyncioActorExit):
            ray.actor.exit_actor()  # type: ignore[no-untyped-call]
