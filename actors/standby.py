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
for its idle time, after a restart (``actors.standby_inheritance``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from ray.exceptions import (
    ActorDiedError,
    ActorUnavailableError,
    GetTimeoutError,
    RayActorError,
    RayError,
)

from actors import metrics
from actors.named import kill
from actors.standby_inheritance import (
    STANDBY_PREFIX,
    Standing,
    ask_to_retire,
    inheritance_key,
    left_by,
    standby_name,
    standby_prefix,
)
from torpor.settings import Settings

# What a holder finds of its predecessor's standbys lives in ``standby_inheritance``;
# its names are imported from here too.
__all__ = [
    "KEEP_TIMEOUT_S",
    "STANDBY_PREFIX",
    "START_TIMEOUT_S",
    "StandbySet",
    "Standing",
    "ask_to_retire",
    "inheritance_key",
    "left_by",
    "standby_name",
    "standby_prefix",
]

log = logging.getLogger(__name__)

_DEAD = (RayActorError, ActorDiedError, ActorUnavailableError, GetTimeoutError)
# A start is slow, not stuck, on a loaded node (Ray starts a few workers at a time and
# queues the rest): give up only on one that is clearly never coming.
START_TIMEOUT_S = 600.0
# Replacements started at once. A burst of adoptions must not start a process for each
# at the same moment: ten ``import ray``s at once took the CPU the adopted sessions needed
# (9.3 activations/s in a burst of ten; one start at a time leaves them the cores).
STARTS_AT_ONCE = 1
# How long a ready standby may take to answer that it lives before it is replaced, at
# most (and at most one keeping period: a round never waits past the next one's time).
KEEP_TIMEOUT_S = 20.0


class StandbySet:
    """Up to ``size`` ready actors; ``take`` hands one out and starts its replacement.

    ``spawn`` creates one actor (a Ray handle whose ``ready`` method answers once its
    constructor has run, and whose ``keep`` restarts its idle time), awaited: making a
    named actor is a GCS call, made off the loop (``actors.named.create_named``). With
    ``keep_every_s``, the ready ones are kept alive from the first ``refill`` on. Counts
    what it started, lost and inherited (exported as ``torpor_standby_actors_total``)."""

    def __init__(
        self,
        size: int,
        spawn: Callable[[], Awaitable[Any]],
        *,
        keep_every_s: float | None = None,
    ) -> None:
        self.size = size
        self._spawn = spawn
        self._keep_every_s = keep_every_s
        self._ready: deque[Any] = deque()
        self._starting = 0
        self._pending: set[Any] = set()  # spawned, not yet ready
        self._tasks: set[asyncio.Task[None]] = set()
        # The asks to left standbys to go (``inherit``), under way: held here so none is
        # garbage-collected mid-ask, and so ``retired`` can wait for them.
        self._retiring: set[asyncio.Task[None]] = set()
        self._keeper: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()
        self._closing = False
        # While a predecessor's standbys are looked for, nothing is started: one started
        # meanwhile under the same name would be listed as the predecessor's.
        self._inheriting = False
        self.started = 0
        self.lost = 0  # ready standbys that stopped answering, replaced
        self.inherited = 0  # free standbys a predecessor left, taken over
        # Asked for one with none ready: that activation starts a process on its path.
        self.missed = 0

    @property
    def ready(self) -> int:
        return len(self._ready)

    def take(self) -> Any | None:
        """A ready actor (None if none is), and its replacement set starting."""
        handle = self._ready.popleft() if self._ready else None
        if handle is None:
            self.missed += 1
        self.refill()
        return handle

    def refill(self) -> None:
        if self._closing or self._inheriting:
            return  # nothing started after ``close`` (nobody would free it), or yet
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
            handle = await self._spawn()
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
            self._starting -= 1
            self._changed.set()
            if ready and not self._closing:
                self.refill()  # the next replacement, one at a time (a failed start waits
                # for the next take or keeping round, not a loop of failing process starts)
            if handle is not None:
                # Off the loop, with a deadline (``kill``), and last: the count above is
                # right even if this wait is cut short (a second cancel).
                await kill(handle, "killing a standby session actor that did not start")

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
        silent: list[Any] = []
        for handle, answer in zip(handles, answers, strict=True):
            if answer or handle not in self._ready:
                continue  # kept; or taken from this set meanwhile (its adopter's)
            self._ready.remove(handle)
            if answer is None:  # no answer: dead, unreachable or stuck; replaced
                self.lost += 1
                metrics.inc("standbys", {"event": "lost"})
                silent.append(handle)
                log.warning("a standby session actor stopped answering; replacing it")
            # else it has a session another holder gave it (two incarnations of a holder
            # alive at once both inherited it): it runs that session and goes, untouched.
        # Off the loop, each with a deadline (``kill``): on it, a GCS slow to take them
        # held every other coroutine of the holder's process (a replica's webhooks).
        what = "killing a standby session actor that stopped answering"
        await asyncio.gather(*(kill(handle, what) for handle in silent))

    @staticmethod
    async def _kept(handle: Any, timeout_s: float) -> bool | None:
        """True: the standby is kept, still free; False: it has a session or is on its
        way out; None: no answer (dead, unreachable, too slow, an error of Ray's)."""
        try:
            return bool(await asyncio.wait_for(handle.keep.remote(), timeout=timeout_s))
        except (RayError, TimeoutError):  # ``_DEAD``'s errors are Ray's too
            return None

    async def inherit(
        self,
        find: Callable[[], Awaitable[Sequence[Any]]],
        settings: Settings,
        timeout_s: float = KEEP_TIMEOUT_S,
    ) -> int:
        """Take over the standbys a predecessor of this holder left (its process died),
        as ``find`` lists them; call it before the first ``refill``, which it holds back
        until it is done (a standby this set started would be listed too). Each that is
        free and runs what ``settings`` and this code make (``inheritance_key``) joins
        the set, up to its size, and is kept from now on; one free past the size,
        running other settings or code, or not answering, is retired (it exits unless a
        session reached it first), in the background: ``retired`` waits for that. One
        that has a session is left to run it. Returns how many joined."""
        grace_s = settings.runtime.actor_exit_grace_s
        self._inheriting = True
        try:
            handles = await find()
            try:
                salt = os.urandom(16)
                key = (await inheritance_key(settings, salt)).hex()  # slow on purpose
                answers = await asyncio.gather(
                    *(self._asked(h, salt, key, timeout_s) for h in handles)
                )
            except asyncio.CancelledError:
                # The holder closing while it asked: none found is kept, and one left
                # unasked runs on to its idle time (with ``standby_idle_s = 0``, for
                # ever). Each is asked to go (one with a session runs it), shielded
                # from a second cancel, before the cancel goes on.
                found = [h for h in handles if h not in self._ready and h not in self._pending]
                await asyncio.shield(self._retire_all(found, grace_s))
                raise
        finally:
            self._inheriting = False
        joined = 0
        going: list[Any] = []
        for handle, answer in zip(handles, answers, strict=True):
            if handle in self._ready or handle in self._pending:
                continue  # this set's own, started before it was asked to inherit
            room = len(self._ready) + self._starting < self.size
            if answer is Standing.FREE and not self._closing and room:
                self._ready.append(handle)
                joined += 1
            elif answer is not Standing.TAKEN:
                # Free past the size, on other settings or code, or no answer (too busy
                # to answer in time, or dead): asked to go, never killed: it exits unless
                # it has a session by then. One that did not answer was left to its idle
                # time, which with ``standby_idle_s = 0`` never comes: a process for ever.
                going.append(handle)
        if going and self._closing:
            # ``close`` cancelled and awaited the set's tasks already: one made now would
            # be neither (a task nobody ends), so these are asked here, and awaited.
            await self._retire_all(going, grace_s)
        elif going:
            # Behind the holder's start, not in it: a silent standby is asked for up to
            # ``RETIRE_ATTEMPTS`` x ``RETIRE_TIMEOUT_S`` (or its exit's grace), and the
            # holder's first refill waited for all of it, its activations starting
            # processes on their path.
            task = asyncio.create_task(self._retire_all(going, grace_s))
            self._tasks.add(task)  # awaited by ``close``, not cancelled (see there)
            self._retiring.add(task)
            task.add_done_callback(self._retire_done)
        self.inherited += joined
        if joined:
            metrics.inc("standbys", {"event": "inherited"}, joined)
            self._changed.set()
        return joined

    async def retired(self) -> None:
        """Until every left standby ``inherit`` asked to go has answered, or been asked
        its last time."""
        while under_way := {task for task in self._retiring if not task.done()}:
            await asyncio.wait(under_way)

    @staticmethod
    async def _retire_all(going: list[Any], grace_s: float) -> None:
        answers = await asyncio.gather(
            *(ask_to_retire(h, grace_s=grace_s) for h in going), return_exceptions=True
        )
        for answer in answers:
            if isinstance(answer, BaseException):  # one failed ask does not hide the rest
                log.warning("asking a left standby session actor to go failed", exc_info=answer)

    def _retire_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._retiring.discard(task)
        if not task.cancelled() and (failed := task.exception()) is not None:
            log.warning("asking the left standby session actors to go failed", exc_info=failed)

    @staticmethod
    async def _asked(handle: Any, salt: bytes, key: str, timeout_s: float) -> Standing | None:
        """A left standby's answer to whether it may be inherited (None: no answer, or
        one this code does not know: it is retired)."""
        try:
            answer = await asyncio.wait_for(handle.inheritable.remote(salt, key), timeout=timeout_s)
            return Standing(answer)
        except Exception:  # dead, silent, or older code without ``inheritable``
            return None

    async def close(self) -> None:
        """Stop the starts under way and the actors nobody adopted."""
        self._closing = True
        for task in list(self._tasks - self._retiring):
            task.cancel()
        # The asks to left standbys to go are let finish (each is bounded: at most
        # ``RETIRE_ATTEMPTS`` x ``RETIRE_TIMEOUT_S``, or the exit's grace, at most a
        # minute, and that timeout): cancelled, a left standby ran on to its idle time,
        # and with ``standby_idle_s = 0`` for ever.
        await asyncio.gather(*self._tasks, return_exceptions=True)
        # Retired, not killed: a standby another holder inherited too may have a session
        # by now (it runs it); one that does not answer is killed.
        ready, self._ready = list(self._ready), deque()
        await asyncio.gather(*(_retire(h) for h in ready))


async def _retire(handle: Any, timeout_s: float = 5.0) -> None:
    """The standby exits now unless it has a session; killed if it does not answer."""
    try:
        # A RayActorError too means it exited under the call, as asked.
        with contextlib.suppress(RayError):
            await asyncio.wait_for(handle.retire.remote(), timeout=timeout_s)
    except TimeoutError:
        await kill(handle, "killing a standby session actor that did not answer its retire")
