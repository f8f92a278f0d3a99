"""The reconciler: a detached, named actor that sweeps on an interval.

``lifetime="detached"`` keeps it alive after the driver that started it exits;
``max_restarts=-1`` brings it back if its process dies; the explicit namespace lets every
driver and the Serve app find the same one. ``ensure_reconciler`` is idempotent: call it
from anywhere, as often as you like; the Serve app calls it from ``ReconcilerStarter``.

Ray re-runs only ``__init__`` when it restarts the actor, so the sweep loop is started
from there (a call the actor makes to itself): a reconciler whose process or node died
sweeps again as soon as Ray has brought it back, without anyone calling ``start``. A
sweep that raises (its services failing to open included) is logged with its traceback
and the loop goes on.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import asdict
from typing import Any

import ray
from ray import serve

from actors import metrics
from actors.config_ref import ConfigRef
from actors.named import get_actor
from actors.observer import RayObserver
from actors.ray_activator import RayActivator
from actors.standby import START_TIMEOUT_S
from actors.wiring import ensure_conditional_writes, open_services
from torpor.errors import CallTimedOut
from torpor.ports.services import Services
from torpor.service.sessions import SessionService
from torpor.service.sweeper import Sweeper
from torpor.settings import Settings

log = logging.getLogger(__name__)

NAME = "torpor-reconciler"
# Opening the services (the store's and the index's clients, tracing, the growth of the
# descriptor table) blocks its thread: done off the loop, and given this long.
OPEN_TIMEOUT_S = 30.0


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class Reconciler:
    def __init__(self, config: ConfigRef) -> None:
        self._config = config
        self._settings = config.load()  # here: no secret in the arguments
        self._services: Services | None = None
        self._opening: asyncio.Future[Services] | None = None  # the open under way
        self._sweeper: Sweeper | None = None
        self._activator: RayActivator | None = None
        self._loop: asyncio.Task[None] | None = None
        self._deadline_loop: asyncio.Task[None] | None = None
        self._sweeps = 0
        self._failures = 0
        self._last: dict[str, Any] = {}
        # Each step's last error and when (the console shows it), kept across sweeps
        # that succeed: an operator wants to see the failure that just went away too.
        self._step_errors: dict[str, dict[str, str]] = {}
        self._ensuring = asyncio.Lock()
        # __init__ runs outside the actor's event loop: the loop is started by a call to
        # ourselves, which Ray runs right after __init__, on every (re)start.
        ray.get_runtime_context().current_actor.start.remote()

    async def _ensure(self) -> Sweeper:
        # One at a time: the sweep and the deadline loops both ask, and each would make
        # an activator (and start a standby set) of its own.
        async with self._ensuring:
            if self._sweeper is None:
                if self._services is None:  # kept when what follows fails: opened once
                    self._services = await self._open()
                # ``made``: its storage check counts the cluster's nodes off the loop
                # (embedded storage only), with the lookups' deadline. ``ray.nodes()``
                # blocks until the GCS answers (Ray's deadline: 60 s), and made here on
                # the loop it held the deadline loop, and ``status``, that long.
                # Its standbys named after it: when Ray restarts it, the new incarnation
                # takes over the free ones the dead one kept, instead of starting anew.
                self._activator = activator = await RayActivator.made(
                    self._services, self._config, holder=NAME
                )
                activator.start_standbys()
                control = SessionService(self._services, activator, background=True)
                self._sweeper = Sweeper(control)
            return self._sweeper

    async def _open(self) -> Services:
        """The services, opened in a thread: ``open_services`` blocks (files, sockets,
        the descriptor table's growth), and opened on the loop it held the sweep and
        deadline loops and ``status`` for as long. Past ``OPEN_TIMEOUT_S`` this call
        fails (``CallTimedOut``, retryable: a failed sweep) and the open goes on; the
        next call waits for that same open instead of starting another beside it (a
        thread cannot be stopped), and keeps it if it finished meanwhile. One that
        failed is tried afresh by the next call."""
        opening = self._opening
        if opening is None:
            opening = self._opening = asyncio.ensure_future(
                asyncio.to_thread(open_services, self._settings, observer=RayObserver())
            )
        # ``wait``, not ``wait_for``: it neither cancels the open at the deadline nor
        # reads a TimeoutError the open raised itself as the deadline passing.
        done, _ = await asyncio.wait({opening}, timeout=OPEN_TIMEOUT_S)
        if not done:
            raise CallTimedOut(
                f"opening the reconciler's services did not finish within {OPEN_TIMEOUT_S:g} s",
                timeout_s=OPEN_TIMEOUT_S,
            )
        if opening.exception() is not None and self._opening is opening:
            self._opening = None
        return opening.result()

    async def start(self) -> bool:
        """Start sweeping if not already; True if this call started it. The services
        open in the loops, inside their ``try``: an open that failed here (a secret not
        in the environment of the node Ray restarted it on, a store it could not reach)
        raised out of the one call a restart makes, and the reconciler never swept
        again. It is now a failed sweep, tried again at the next."""
        if self._loop is not None and not self._loop.done():
            return False
        self._loop = asyncio.create_task(self._run())
        self._deadline_loop = asyncio.create_task(self._run_deadlines())
        return True

    async def _run(self) -> None:
        while True:
            try:
                await self.sweep_once()
            except Exception:  # the index or store is down: say so, and sweep again later
                self._failures += 1
                log.exception("sweep failed")
            await asyncio.sleep(self._settings.reconciler.interval_s)

    async def _run_deadlines(self) -> None:
        while True:
            await asyncio.sleep(self._settings.reconciler.deadline_interval_s)
            try:
                await (await self._ensure()).deadlines_once()
            except Exception:  # the whole sweep reports failures; this loop just goes on
                log.debug("deadline lookup failed", exc_info=True)

    async def sweep_once(self) -> dict[str, Any]:
        sweeper = await self._ensure()
        assert self._services is not None
        # Never sweep (rewrite snapshots, bind, time out) on a store that overwrites blindly.
        await ensure_conditional_writes(self._services)
        at = self._services.clock.now().isoformat()
        report = await sweeper.sweep_once()
        for line in report.errors:
            step, _, error = line.partition(": ")
            self._step_errors[step] = {"at": at, "error": error}
        await sweeper.sessions.drain()
        self._sweeps += 1
        metrics.sweep(report)
        self._last = asdict(report)
        return self._last

    async def status(self) -> dict[str, Any]:
        running = self._loop is not None and not self._loop.done()
        return {
            "sweeps": self._sweeps,
            "failures": self._failures,
            "running": running,
            "last": self._last,
            "step_errors": self._step_errors,
            "standbys": self._standbys(),
        }

    def _standbys(self) -> dict[str, int] | None:
        """Its standby session actors: ready now, and started, lost and taken over
        (from the incarnation before it) by this incarnation."""
        standby = self._activator.standby if self._activator is not None else None
        if standby is None:
            return None
        return {
            "ready": standby.ready,
            "started": standby.started,
            "lost": standby.lost,
            "inherited": standby.inherited,
        }

    async def pid(self) -> int:
        """The process this incarnation runs in (for operators, and for crash tests)."""
        return os.getpid()


async def reconciler_status(namespace: str) -> dict[str, Any] | None:
    """The running reconciler's counters and last sweep report (None if there is none);
    the operator console shows each step's last error from it. The caller bounds it."""
    try:
        handle = await get_actor(NAME, namespace)
    except ValueError:  # no such actor
        return None
    status: dict[str, Any] = await handle.status.remote()
    return status


def ensure_reconciler(settings: Settings | ConfigRef) -> Any:
    """The namespace's reconciler, made if there is none, and sweeping. (``torpor
    reconcile`` only looks one up: made there, it swept on after the command.)"""
    config = ConfigRef.of(settings)
    namespace = (settings if isinstance(settings, Settings) else config.load()).namespace
    handle = Reconciler.options(  # type: ignore[attr-defined]
        name=NAME,
        namespace=namespace,
        lifetime="detached",
        get_if_exists=True,
    ).remote(config)
    # With the time a process start may take on a busy node, and no more: a driver's
    # ``Client()`` and the Serve app's starter wait here in their constructors, and a
    # reconciler whose node is gone (not yet declared dead) held them for ever.
    ray.get(handle.start.remote(), timeout=START_TIMEOUT_S)
    return handle


@serve.deployment(num_replicas=1, max_ongoing_requests=1, ray_actor_options={"num_cpus": 0})
class ReconcilerStarter:
    """Starts the reconciler once per Serve application, not once per ingress replica.

    Serve keeps exactly one replica of it (and replaces it if it dies); starting is
    idempotent, so a replacement finds the running reconciler and leaves it be.
    """

    def __init__(self, config: ConfigRef) -> None:
        ensure_reconciler(config)
