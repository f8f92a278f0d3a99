"""Pooled placement: a few long-lived host actors run activations routed by session id.

Starting a Ray actor costs a process (~0.4 s on this machine), which caps dedicated
placement at a few activations per second per node. A pooled host is already running: an
activation is one coroutine in it. Each activation still rehydrates from storage and the
host keeps nothing about a session once it suspends, so a host can die at any moment
and lose nothing (``max_restarts=-1`` brings it back; the lease/reconciler path recovers
whatever it was running).
"""

from __future__ import annotations

import asyncio
import logging
import os

import ray

from actors import metrics
from actors.config_ref import ConfigRef
from actors.observer import RayObserver
from actors.wiring import open_services, session_runtime
from torpor import tracing
from torpor.ports import Reason
from torpor.ports.services import Services
from torpor.session import SessionRuntime

log = logging.getLogger(__name__)


def host_name(slot: int) -> str:
    return f"torpor-pool-{slot}"


@ray.remote(num_cpus=0, max_restarts=-1)
class PoolHost:
    def __init__(self, config: ConfigRef, slot: int) -> None:
        self._settings = settings = config.load()  # here: no secret in the arguments
        self._slot = slot
        self._services: Services | None = None
        self._runtime: SessionRuntime | None = None
        self._wanted: dict[str, list[tuple[Reason, float | None, str | None]]] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._gate = asyncio.Semaphore(settings.pool.max_concurrency)
        self.activations = 0

    def _ensure(self) -> SessionRuntime:
        if self._runtime is None:
            self._services = open_services(self._settings, observer=RayObserver())
            node = ray.get_runtime_context().get_node_id()[:8]
            self._runtime = session_runtime(self._services, owner=f"pool:{node}:{self._slot}")
        return self._runtime

    async def activate(
        self,
        session_id: str,
        reason: str,
        requested_at: float | None = None,
        traceparent: str | None = None,
    ) -> str:
        self._ensure()
        wanted = (Reason(reason), requested_at, traceparent)
        self._wanted.setdefault(session_id, []).append(wanted)
        if session_id not in self._tasks:
            self._tasks[session_id] = asyncio.create_task(self._run(session_id))
        return "accepted"

    async def _run(self, session_id: str) -> None:
        runtime = self._ensure()
        try:
            while wanted := self._wanted.get(session_id):
                reason, requested_at, traceparent = wanted[0]
                self._wanted[session_id] = []  # one activation serves every request so far
                async with self._gate:
                    try:
                        with tracing.continued(traceparent):
                            result = await runtime.activate(
                                session_id, reason=reason, requested_at=requested_at
                            )
                        metrics.activation(result, placement="pooled")
                        self.activations += 1
                    except Exception:
                        log.exception("activation of %s failed", session_id)
        finally:
            # No await between the loop's last check and here: a request either saw this
            # task running (and its request was taken) or starts a new one.
            self._wanted.pop(session_id, None)
            self._tasks.pop(session_id, None)

    async def where(self) -> dict[str, object]:
        return {"node": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

    async def stats(self) -> dict[str, int]:
        return {"running": len(self._tasks), "activations": self.activations}
