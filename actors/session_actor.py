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
import logging
import os

import ray
from ray.exceptions import AsyncioActorExit

from actors import metrics
from actors.config_ref import ConfigRef
from actors.observer import RayObserver
from actors.wiring import open_services, session_runtime
from torpor import tracing
from torpor.ports import Reason

log = logging.getLogger(__name__)

ACCEPTED = "accepted"
CLOSING = "closing"


def actor_name(session_id: str) -> str:
    return f"session:{session_id}"


@ray.remote(num_cpus=0, max_restarts=0)
class SessionActor:
    def __init__(self, config: ConfigRef, session_id: str) -> None:
        self._settings = config.load()  # here, not in the caller: no secret in the arguments
        self._session_id = session_id
        self._wanted: list[tuple[Reason, float | None, str | None]] = []
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    async def activate(
        self, reason: str, requested_at: float | None = None, traceparent: str | None = None
    ) -> str:
        if self._closing:
            return CLOSING
        self._wanted.append((Reason(reason), requested_at, traceparent))
        if self._task is None:
            self._task = asyncio.create_task(self._run())
        return ACCEPTED

    async def where(self) -> dict[str, object]:
        """Node and process of this actor (for operators, and for crash tests)."""
        return {"node": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

    async def _run(self) -> None:
        services = open_services(self._settings, observer=RayObserver())
        node = ray.get_runtime_context().get_node_id()[:8]
        runtime = session_runtime(services, owner=f"dedicated:{node}:{self._session_id}")
        try:
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
                            self._session_id, reason=reason, requested_at=requested_at
                        )
                    metrics.activation(result, placement="dedicated")
                except Exception:
                    # Typed storage errors included: the runtime already scheduled a
                    # retry timer; log and go on to exit.
                    log.exception("activation of %s failed", self._session_id)
        finally:
            self._closing = True
            with contextlib.suppress(Exception):
                await services.close()
            del runtime, services
            gc.collect()
            # The exit is scheduled before the exception is raised; suppressing it only
            # keeps "Task exception was never retrieved" out of the logs.
            with contextlib.suppress(AsyncioActorExit):
                ray.actor.exit_actor()  # type: ignore[no-untyped-call]
