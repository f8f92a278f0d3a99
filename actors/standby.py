"""A few pre-started session actors, each waiting to adopt one session.

Starting a Ray actor costs a worker process (about a second of CPU here, most of it
``import ray``), which is what made a dedicated activation slow: the process started
after the request. A standby actor has started, loaded its settings and opened its
storage before any session needs it; an activation hands it a session id and it runs
that session exactly like a named session actor, then exits when the session sleeps.
The set is refilled in the background after every adoption, so the process start is
paid off the request's path.

A standby is detached (an adopted one must outlive the activator that handed it its
session) and exits by itself when nobody adopts or keeps it for ``idle_s`` seconds, so
the standbys of an activator that died do not linger. The set keeps its own: every
``keep_every_s`` each ready standby is told its holder lives (its idle time starts
again), and one that does not answer (its process or node is gone) is replaced. Without
that, a quiet spell longer than ``idle_s`` emptied the set, and the next activation
tried each dead handle before starting a process on the request's path.

A holder with a stable name (the reconciler, one per namespace, which Ray restarts when
its process dies) names its standbys after itself, and a restarted holder takes over the
free ones its predecessor left (``inherit``): no process starts, and none lingers unkept
for its idle time, after a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import ray
from ray.exceptions import (
    ActorDiedError,
    ActorUnavailableError,
    GetTimeoutError,
    RayActorError,
    RayError,
)

from actors import metrics
from actors.config_ref import settings_digest
from torpor import __version__
from torpor.settings import Settings

log = logging.getLogger(__name__)

_DEAD = (RayActorError, ActorDiedError, ActorUnavailableError, GetTimeoutError)
# A start is slow, not stuck, on a loaded node (Ray starts a few workers at a time and
# queues the rest): give up only on one that is clearly never coming.
START_TIMEOUT_S = 600.0
STANDBY_PREFIX = "session-standby:"
# Replacements started at once. A burst of adoptions must not start a process for each
# at the same moment: ten ``import ray``s at once took the CPU the adopted sessions needed
# (9.3 activations/s in a burst of ten; one start at a time leaves them the cores).
STARTS_AT_ONCE = 1
# How long a ready standby may take to answer that it lives before it is replaced, at
# most (and at most one keeping period: a round never waits past the next one's time).
KEEP_TIMEOUT_S = 20.0


# A standby's answers to a holder that would inherit it (``SessionActor.inheritable``).
FREE, TAKEN, OTHER = "free", "taken", "other"


def inheritance_key(settings: Settings) -> str:
    """What a standby runs, as a key a holder compares with its own before inheriting
    it: the settings (their digest), torpor's version, and the code Ray started the
    process with (its runtime environment: a job's ``working_dir`` is part of it). A
    holder replaced with new settings or new code must not hand sessions to a standby
    that runs the old ones. Compared over Ray calls only; never logged."""
    runtime_env: str = ray.get_runtime_context().get_runtime_env_string()  # type: ignore[no-untyped-call]
    return f"{settings_digest(settings)}:{__version__}:{runtime_env}"


def standby_prefix(holder: str | None = None) -> str:
    """The names of a holder's standbys start with this (every standby's with
    ``STANDBY_PREFIX``). A stable holder's name lets its next incarnation find them."""
    return f"{STANDBY_PREFIX}{holder}:" if holder else STANDBY_PREFIX


def standby_name(holder: str | None = None) -> str:
    return f"{standby_prefix(holder)}{uuid.uuid4().hex}"


class StandbySet:
    """Up to ``size`` ready actors; ``take`` hands one out and starts its replacement.

    ``spawn`` creates one actor (a Ray handle whose ``ready`` method answers once its
    constructor has run, and whose ``keep`` restarts its idle time). With
    ``keep_every_s``, the ready ones are kept alive from the first ``refill`` on. Counts
    what it started, lost and inherited (exported as ``torpor_standby_actors_total``)."""

    def __init__(
        self, size: int, spawn: Callable[[], Any], *, keep_every_s: float | None = None
    ) -> None:
        self.size = size
        self._spawn = spawn
        self._keep_every_s = keep_every_s
        self._ready: deque[Any] = deque()
        self._starting = 0
        self._pending: set[Any] = set()  # spawned, not yet ready
        self._tasks: set[asyncio.Task[None]] = set()
        self._keeper: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()
        self._closing = False
        self.started = 0
        self.lost = 0  # ready standbys that stopped answering, replaced
        self.inherited = 0  # free standbys a predecessor left, taken over

    @property
    def ready(self) -> int:
        return len(self._ready)

    def take(self) -> Any | None:
        """A ready actor (None if none is), and its replacement set starting."""
        handle = self._ready.popleft() if self._ready else None
        self.refill()
        return handle

    def refill(self) -> None:
        if self._closing:
            return  # nothing started after ``close`` (nobody would free it)
        if self._keep_every_s and (self._keeper is None or self._keeper.done()):
            self._keeper = asyncio.create_task(self._keep(self._keep_every_s))
            self._tasks.add(self._keeper)
        while len(self._ready) + self._starting < self.size and self._starting < STARTS_AT_ONCE:
            self._starting += 1
            task = asyncio.create_task(self._start())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def filled(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until every slot holds a ready actor (benchmarks and tests start from here)."""
        self.refill()
        async with asyncio.timeout(timeout_s):
            while len(self._ready) < self.size:
                self._changed.clear()
                await self._changed.wait()
                self.refill()  # a start that failed leaves its slot to fill again

    async def _start(self) -> None:
        handle, ready = None, False
        try:
            handle = self._spawn()
            self._pending.add(handle)
            self.started += 1
            metrics.inc("standbys", {"event": "started"})
            await asyncio.wait_for(handle.ready.remote(), timeout=START_TIMEOUT_S)
            self._ready.append(handle)
            self._pending.discard(handle)
            handle, ready = None, True
        except (*_DEAD, TimeoutError):
            # Not fatal: the next take starts another.
            log.warning("a standby session actor did not start")
        finally:
            if handle is not None:  # silent, dead or cancelled (close): free its process
                self._pending.discard(handle)
                with contextlib.suppress(Exception):
                    ray.kill(handle, no_restart=True)
            self._starting -= 1
            self._changed.set()
            if ready and not self._closing:
                self.refill()  # the next replacement, one at a time (a failed start waits
                # for the next take or keeping round, not a loop of failing process starts)

    async def _keep(self, every_s: float) -> None:
        """Tell each ready standby, every ``every_s``, that its holder lives; drop and
        replace those that do not answer so, and start what a failed start left short.
        A keep waits at most ``every_s`` for its answer, so a standby that answers hears
        from its holder at least every ``2 * every_s`` (half its idle time)."""
        timeout_s = min(KEEP_TIMEOUT_S, every_s)
        while True:
            await asyncio.sleep(every_s)
            try:
                await self._keep_once(timeout_s)
            except Exception:  # a round that failed is not the end of keeping them
                log.exception("keeping the standby session actors failed")
            self.refill()

    async def _keep_once(self, timeout_s: float) -> None:
        handles = list(self._ready)
        answers = await asyncio.gather(*(self._kept(h, timeout_s) for h in handles))
        # Only one still in the set: a standby taken meanwhile answers False (it has a
        # session now) and is its adopter's, never killed here.
        lost = [h for h, ok in zip(handles, answers, strict=True) if not ok and h in self._ready]
        for handle in lost:
            self._ready.remove(handle)
            self.lost += 1
            metrics.inc("standbys", {"event": "lost"})
            with contextlib.suppress(Exception):
                ray.kill(handle, no_restart=True)
        if lost:
            log.warning("%d standby session actors stopped answering; replacing them", len(lost))

    @staticmethod
    async def _kept(handle: Any, timeout_s: float) -> bool:
        """Whether the standby answered that it is still free to adopt a session: any
        failure to (dead, unreachable, too slow, another error of Ray's) is a no."""
        try:
            return bool(await asyncio.wait_for(handle.keep.remote(), timeout=timeout_s))
        except (RayError, TimeoutError):  # ``_DEAD``'s errors are Ray's too
            return False

    async def inherit(
        self, handles: Sequence[Any], key: str, timeout_s: float = KEEP_TIMEOUT_S
    ) -> int:
        """Take over the standbys a predecessor of this holder left (its process died):
        each that answers it is free and runs what ``key`` names (``inheritance_key``)
        joins the set, up to its size, and is kept from now on; free ones past the
        size, and free ones that run other settings or code (the holder was replaced
        with new ones), are stopped. One that has a session is left to run it; one that
        does not answer is left to its own idle time. Returns how many joined. Best
        before the first ``refill``: a slot it fills is not started again, but a start
        already under way goes on."""
        answers = await asyncio.gather(*(self._asked(h, key, timeout_s) for h in handles))
        joined = 0
        for handle, answer in zip(handles, answers, strict=True):
            if answer not in (FREE, OTHER) or handle in self._ready or handle in self._pending:
                continue  # taken, silent, or this set's own (a listing sees those too)
            if answer == OTHER or self._closing or len(self._ready) + self._starting >= self.size:
                with contextlib.suppress(Exception):
                    ray.kill(handle, no_restart=True)
                continue
            self._ready.append(handle)
            joined += 1
        self.inherited += joined
        if joined:
            metrics.inc("standbys", {"event": "inherited"}, joined)
            self._changed.set()
        return joined

    @staticmethod
    async def _asked(handle: Any, key: str, timeout_s: float) -> str | None:
        """A left standby's answer to whether it may be inherited (None: no answer)."""
        try:
            answer: str = await asyncio.wait_for(handle.inheritable.remote(key), timeout=timeout_s)
        except (RayError, TimeoutError):
            return None
        return answer

    async def close(self) -> None:
        """Stop the starts under way and the actors nobody adopted."""
        self._closing = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        while self._ready:
            with contextlib.suppress(Exception):
                ray.kill(self._ready.popleft(), no_restart=True)
