"""Pooled placement: a few long-lived host actors run activations routed by session id.

Starting a Ray actor costs a process (~0.4 s on this machine), which caps dedicated
placement at a few activations per second per node. A pooled host is already running: an
activation is one coroutine in it. Each activation still rehydrates from storage and the
host keeps nothing about a session once it suspends, so a host can die at any moment
and lose nothing (``max_restarts=-1`` brings it back; the lease/reconciler path recovers
whatever it was running).

Requests reach a host through its channel in the index's Redis when there is one
(``ActivationQueue``): the host blocks on it from the moment it starts (and again after
every restart), so a request costs the sender one Redis round trip and wakes the host at
once, where a Ray actor call took milliseconds more on this machine and CPU on both sides
(``bench/bench_ingress.py``). Without one (SQLite) the activator calls ``activate``.
"""

from __future__ import annotations

import asyncio
import logging
import os

import ray

from actors import metrics
from actors.config_ref import ConfigRef
from actors.heap import settle_heap
from actors.observer import RayObserver
from actors.wiring import open_services, session_runtime, warm_services
from torpor import tracing
from torpor.backoff import Backoff
from torpor.faults import CrashPoint, crash_point
from torpor.ports import Reason
from torpor.ports.services import Services
from torpor.session import SessionRuntime

log = logging.getLogger(__name__)

LISTEN_WAIT_S = 2.0  # one blocking pop; the loop then asks again
LISTEN_BACKOFF = Backoff(base_s=0.1, cap_s=5.0, jitter=0.2)  # Redis down: ask less often


def host_name(slot: int) -> str:
    return f"torpor-pool-{slot}"


def pool_channel(namespace: str, slot: int) -> str:
    """The channel of the host ``slot`` of the Ray namespace: its activation requests."""
    return f"pool.{namespace}.{slot}"


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
        # An async actor's __init__ runs on the loop its methods will run on: listening
        # starts with the actor, so a restarted host takes its channel up by itself.
        self._listener = asyncio.get_running_loop().create_task(self._listen())

    def _ensure(self) -> SessionRuntime:
        if self._runtime is None:
            self._services = open_services(self._settings, observer=RayObserver())
            node = ray.get_runtime_context().get_node_id()[:8]
            self._runtime = session_runtime(self._services, owner=f"pool:{node}:{self._slot}")
            settle_heap()  # started: what lives for the host's life leaves the collector
        return self._runtime

    async def activate(
        self,
        session_id: str,
        reason: str,
        requested_at: float | None = None,
        traceparent: str | None = None,
    ) -> str:
        self._want(session_id, Reason(reason), requested_at, traceparent)
        return "accepted"

    def _want(
        self, session_id: str, reason: Reason, requested_at: float | None, traceparent: str | None
    ) -> None:
        self._ensure()
        self._wanted.setdefault(session_id, []).append((reason, requested_at, traceparent))
        if session_id not in self._tasks:
            self._tasks[session_id] = asyncio.create_task(self._run(session_id))

    async def _listen(self) -> None:
        """Take the requests on this host's channel for as long as the host lives."""
        services = await self._opened()
        # Before the first request on the channel (one sent as a Ray call meanwhile may
        # run beside it: nothing is held back for the readying). It never raises.
        await warm_services(services)
        queue = services.activations
        if queue is None:
            return  # no channel here: requests come as Ray calls (``activate``)
        channel = pool_channel(self._settings.namespace, self._slot)
        failures = 0
        while True:
            try:
                found = await queue.pop(channel, wait_s=LISTEN_WAIT_S)
            except Exception:
                # Requests wait in Redis meanwhile, and any lost are brought back by
                # their timers: keep listening, less often.
                log.warning("pool host %s cannot read its channel", self._slot, exc_info=True)
                await asyncio.sleep(LISTEN_BACKOFF.delay_s(failures))
                failures += 1
                continue
            failures = 0
            for wanted in found:
                crash_point(f"{CrashPoint.POOL_TAKEN}.{wanted.reason.value}")
                self._want(
                    wanted.session_id, wanted.reason, wanted.requested_at, wanted.traceparent
                )

    async def _opened(self) -> Services:
        """The host's services, opened again (less often) until they open. A failed
        open (a secret not in this node's environment yet, a store it cannot reach)
        ended the listener before its loop: the host then took nothing from its channel
        until an activator found it stalled, ``STALLED_CHANNEL`` requests later."""
        failures = 0
        while True:
            try:
                self._ensure()
            except Exception:
                log.warning("pool host %s cannot open its services", self._slot, exc_info=True)
            else:
                assert self._services is not None
                return self._services
            await asyncio.sleep(LISTEN_BACKOFF.delay_s(failures))
            failures += 1

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

    async def listen(self) -> bool:
        """Make sure this host takes its channel's requests (an activator asks when they
        pile up); True if the listener had to be started again."""
        if not self._listener.done():
            return False
        failed = None if self._listener.cancelled() else self._listener.exception()
        if failed is not None:
            log.error("pool host %s stopped listening", self._slot, exc_info=failed)
        self._listener = asyncio.get_running_loop().create_task(self._listen())
        return True

    async def where(self) -> dict[str, object]:
        return {"node": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

    async def stats(self) -> dict[str, int]:
        return {"running": len(self._tasks), "activations": self.activations}
