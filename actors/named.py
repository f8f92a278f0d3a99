"""Named actors, looked up, listed and made off the event loop, each call with a deadline.

Sessions (``session:<id>``), standbys (``session-standby:<holder>:<hex>``), work watchers
(``work:<id>``) and the reconciler are found by their names. ``ray.get_actor`` and
``ray.util.list_named_actors`` are synchronous calls to the GCS, bounded only by Ray's
own deadline (``gcs_server_request_timeout_seconds``, 60 s): made on an event loop, a
slow GCS stalled every other coroutine of the process for that long (a Serve replica's
webhooks, a pool host's activations, a watcher's progress writes). They run here in
threads of their own (``torpor.threads``), and a call with no answer within
``LOOKUP_TIMEOUT_S`` fails that one operation with ``ClusterUnavailable``; its thread
is left to end within Ray's deadline.

Ray allows both from any thread: its core worker's API is thread-safe (Ray's own Serve
starts its controller from ``asyncio.to_thread`` for that reason), both calls let go of
the GIL while they wait for the GCS, and an async actor's loop already runs on a thread
that is not its process's main one. The one hazard is a thread still inside a Ray call
when its process tears Ray down (ray#47864): the pool's threads are joined at exit
before Ray's own exit hook runs. A lookup given up while still queued is never made,
and one given up during its call ends within Ray's deadline; a kill given up is still
made, so a process exiting with kills queued makes them first (each bounded by Ray's
own deadline; one per actor, ``_killing``).

``list_named_actors`` has no namespace-and-prefix query of its own: it lists every named
actor the GCS knows, and ``named_actors`` filters here.

Making a named actor is a GCS call too: ``.options(name=..., get_if_exists=True)`` looks
the name up first (``ray.get_actor``), and Ray registers a new actor's name with the GCS
before ``.remote()`` returns (a taken name is reported there and then). ``create_named``
makes that call in the same threads, with the same deadline.

Killing an actor is one as well: ``ray.kill`` waits, in its calling thread, for the
actor's registration with the GCS to finish, and raises Ray's errors. ``kill`` makes it
in threads of its own (``KILLS``), waits for it with the same deadline, and never
raises; a kill not made by then is made later, not dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any, TypeVar

import ray

from torpor.errors import ClusterUnavailable, TorporError
from torpor.threads import ProcessPool

T = TypeVar("T")

log = logging.getLogger(__name__)

# A lookup answers in milliseconds from a GCS that works; this is a GCS failing over or
# swamped, well before Ray's own 60 s, and soon enough for a caller to try again.
LOOKUP_TIMEOUT_S = 10.0
# Not asyncio's default executor (shared with sync tools and everything else): lookups
# stuck on a GCS that does not answer hold these threads, and only these.
LOOKUPS = ProcessPool(8, "torpor-ray-lookup")
# Kills, apart from the lookups: a keeping round kills every silent standby at once, and
# with a slow GCS those filled the lookups' threads; a webhook's lookup queued behind
# them, its deadline counting the wait, and failed with ``ClusterUnavailable``. Kills
# queue behind each other instead, and one still queued at its caller's deadline is
# made when a thread frees (``kill``). Four: half the lookups' width, so a round of
# silent standbys (a set is a few) is killed at once rather than mostly queued.
KILLS = ProcessPool(4, "torpor-ray-kill")


class _Own(Exception):
    """Carries a ``TimeoutError`` that ``fn`` raised itself out of the pool's thread, past
    our deadline's ``except``: asyncio hands a plain one back as a new ``TimeoutError``
    (its traceback gone), and caught there it read as our deadline passing."""

    def __init__(self, error: TimeoutError) -> None:
        super().__init__(error)
        self.error = error


def _carried(fn: Callable[[], T]) -> Callable[[], T]:
    def call() -> T:
        try:
            return fn()
        except TimeoutError as exc:
            raise _Own(exc) from None

    return call


async def gcs_call(
    fn: Callable[[], T],
    what: str,
    *,
    timeout_s: float | None = None,
    pool: ProcessPool | None = None,
) -> T:
    """``fn()``, a blocking call to the GCS, in ``pool``'s threads (default: ``LOOKUPS``):
    its answer, its error (a ``TimeoutError`` of its own too: Ray's ``GetTimeoutError``,
    a socket's, raised as it was), or ``ClusterUnavailable`` past ``timeout_s`` (default:
    ``LOOKUP_TIMEOUT_S``). Every caller reads any ``TimeoutError`` as "not known gone"
    or "try again", so the call's own needs no wrapper of ours; relabelled as our
    deadline, it named a deadline that had not passed and hid why the call failed."""
    timeout_s = LOOKUP_TIMEOUT_S if timeout_s is None else timeout_s
    try:
        # The wait for a free thread counts too: a queued lookup given up is never made.
        async with asyncio.timeout(timeout_s):
            return await (LOOKUPS if pool is None else pool).run(_carried(fn))
    except _Own as own:
        error = own.error
    except TimeoutError:
        raise ClusterUnavailable(
            f"{what}: the GCS did not answer within {timeout_s:g} s", timeout_s=timeout_s
        ) from None
    raise error  # out of the ``except``: no carrier in its context


@contextlib.contextmanager
def typed_timeouts(what: str) -> Iterator[None]:
    """Around the ``gcs_call``s of a path whose callers read errors by their type (an
    activation's): a ``TimeoutError`` the call raised itself (Ray's ``GetTimeoutError``,
    a socket's) becomes ``ClusterUnavailable``, retryable (503 with Retry-After at an
    edge), raised from it: its message and traceback stay, as the cause. Ours, and any
    other typed error, passes as it is. The GCS did not answer either way; raised bare,
    Ray's own was an untyped error (a 500 to any edge it reached) where ours was a
    retryable one, and a dedicated activation read ``GetTimeoutError`` as an actor dying
    and asked the GCS again, up to ``MAX_ATTEMPTS`` times."""
    try:
        yield
    except TorporError:
        raise
    except TimeoutError as exc:
        raise ClusterUnavailable(
            f"{what}: the GCS call timed out in Ray: {type(exc).__name__}: {exc}"[:1000]
        ) from exc


async def get_actor(name: str, namespace: str | None, *, timeout_s: float | None = None) -> Any:
    """``ray.get_actor(name, namespace=namespace)`` off the loop: ``ValueError`` when no
    actor has that name (as Ray's), ``ClusterUnavailable`` past ``timeout_s`` (default:
    ``LOOKUP_TIMEOUT_S``)."""
    return await gcs_call(
        lambda: ray.get_actor(name, namespace=namespace),
        f"looking up actor {name!r}",
        timeout_s=timeout_s,
    )


def _filtered(namespace: str, prefix: str) -> list[str]:
    named: list[dict[str, str]] = ray.util.list_named_actors(all_namespaces=True)
    return [
        actor["name"]
        for actor in named
        if actor.get("namespace") == namespace and actor["name"].startswith(prefix)
    ]


async def named_actors(namespace: str, prefix: str, *, timeout_s: float | None = None) -> list[str]:
    """The names in ``namespace`` that start with ``prefix``: one GCS call, off the loop,
    ``ClusterUnavailable`` past ``timeout_s`` (default: ``LOOKUP_TIMEOUT_S``)."""
    return await gcs_call(
        lambda: _filtered(namespace, prefix), f"listing the {prefix!r} actors", timeout_s=timeout_s
    )


class _Handover:
    """An actor handle made in a pool thread goes to its caller or, once the caller has
    stopped waiting (its deadline, or cancelled), to ``abandoned``: never dropped between
    the two. The lock makes "made" and "given up" one order: without it a handle made
    just as its caller gave up reached neither."""

    def __init__(self, abandoned: Callable[[Any], object] | None) -> None:
        self._lock = threading.Lock()
        self._abandoned = abandoned
        self._given_up = False
        self._handle: Any = None

    def made(self, handle: Any) -> None:
        """In the thread that made it."""
        with self._lock:
            if not self._given_up:
                self._handle = handle  # held here until the caller takes it (ray#6265)
                return
        if self._abandoned is not None:
            self._abandoned(handle)

    def taken(self) -> Any:
        with self._lock:
            handle, self._handle = self._handle, None
        return handle

    def give_up(self) -> None:
        with self._lock:
            self._given_up = True
            handle, self._handle = self._handle, None
        if handle is not None and self._abandoned is not None:
            self._abandoned(handle)


async def create_named(
    actor_class: Any,
    /,
    *args: Any,
    name: str,
    namespace: str,
    abandoned: Callable[[Any], object] | None = None,
    timeout_s: float | None = None,
    **options: Any,
) -> Any:
    """``actor_class.options(name=name, namespace=namespace, **options).remote(*args)``
    off the loop: the actor's handle, Ray's own errors, or ``ClusterUnavailable`` past
    ``timeout_s`` (default: ``LOOKUP_TIMEOUT_S``). With ``get_if_exists=True`` in
    ``options``, the live actor of that name if there is one.

    An actor the GCS makes after its caller gave up (its deadline, or cancelled) is
    handed to ``abandoned`` (in whichever thread it is then in). Without one it is left
    to run: fit for an actor a later call finds by its name (a session's, a pool host's,
    a work's watcher), never for one nobody can (a standby's name is random)."""
    handover = _Handover(abandoned)

    def make() -> None:
        handover.made(actor_class.options(name=name, namespace=namespace, **options).remote(*args))

    try:
        await gcs_call(make, f"making actor {name!r}", timeout_s=timeout_s)
    except BaseException:
        handover.give_up()
        raise
    return handover.taken()


def kill_now(handle: Any) -> bool:
    """``ray.kill(handle, no_restart=True)`` in the calling thread (an ``abandoned`` of
    ``create_named``'s, in a pool thread): True once Ray took it. An error of Ray's (the
    actor gone already, a handle of another session, the GCS failing) is logged and
    False: a kill frees a process or a name, and whoever asked for it goes on either way."""
    try:
        ray.kill(handle, no_restart=True)
    except Exception:
        log.warning("killing an actor failed", exc_info=True)
        return False
    return True


async def kill(handle: Any, what: str, *, timeout_s: float | None = None) -> bool:
    """``kill_now(handle)`` in ``KILLS``, with a deadline (``timeout_s``, default:
    ``LOOKUP_TIMEOUT_S``) on the wait for it: True once Ray took it, False (logged) when
    it failed, or was not made in time (queued behind other kills, or the GCS slow): it
    is still made then. Raises neither Ray's errors nor the deadline's: a kill is the
    clean-up after a failure, and its own error (or a silent GCS) raised in place of
    that failure's outcome hid it from the caller, untyped. Made on the loop, a GCS slow
    to confirm an actor's registration stalled every other coroutine of the process;
    it is made there only once the interpreter is exiting (the threads take no more
    work), bounded by Ray's own deadline, not ``timeout_s``."""
    timeout_s = LOOKUP_TIMEOUT_S if timeout_s is None else timeout_s
    made = asyncio.wrap_future(_killing(handle))
    try:
        async with asyncio.timeout(timeout_s):
            # Shielded: the caller giving up (its deadline, or cancelled) leaves the kill
            # to be made. Dropped, as ``gcs_call`` drops a queued lookup, the silent actor
            # it was for lived on: a standby until its idle time, a session's actor until
            # an activation found it, waited out its silence and asked for its kill again.
            return await asyncio.shield(made)
    except TimeoutError:
        log.warning(
            "%s: not made within %g s (queued behind other kills, or the GCS is slow);"
            " it is still made",
            what,
            timeout_s,
        )
        return False


# The kills queued or under way, by actor (a handle hashes and compares by its actor's
# id): asked again for one while it waits (an activation retried while the GCS is
# down), the actor is killed once, not queued again behind its own kill each time.
_KILLING: dict[Any, Future[bool]] = {}
_KILLING_LOCK = threading.Lock()


def _killing(handle: Any) -> Future[bool]:
    with _KILLING_LOCK:
        made = _KILLING.get(handle)
        if made is not None:
            return made
        made = _KILLING[handle] = Future()
        # Running: nobody can cancel it (a kill once asked is made), so it is settled
        # only by ``_settle`` or below, and its record is dropped only when it is.
        made.set_running_or_notify_cancel()
    # Outside the lock: a kill done already calls back in this thread, and one made in
    # this thread (the interpreter exiting, ``ProcessPool.submit``) waits for the GCS.
    made.add_done_callback(functools.partial(_killed, handle))
    try:
        queued = KILLS.submit(kill_now, handle)
    except BaseException as error:
        # No thread could start (or an interrupt came while one started): reported as a
        # kill not made, and forgotten, so a later ask queues it again. Left unsettled,
        # every later ask for this actor waited on it and none was made.
        made.set_result(False)
        if not isinstance(error, Exception):
            raise
        log.warning("a kill could not be queued (it may still be made)", exc_info=True)
        return made
    queued.add_done_callback(functools.partial(_settle, made))
    return made


def _settle(made: Future[bool], queued: Future[bool]) -> None:
    """``made`` settled as the kill ``queued`` was (``kill_now`` raises nothing of its own)."""
    error = None if queued.cancelled() else queued.exception()
    if error is not None:
        made.set_exception(error)
    else:
        made.set_result(False if queued.cancelled() else queued.result())


def _killed(handle: Any, made: Future[bool]) -> None:
    with _KILLING_LOCK:
        if _KILLING.get(handle) is made:
            del _KILLING[handle]


def _forked() -> None:
    # A child's kill threads are its own (``ProcessPool``): the parent's queue is not.
    global _KILLING_LOCK
    _KILLING_LOCK = threading.Lock()
    _KILLING.clear()


os.register_at_fork(after_in_child=_forked)
