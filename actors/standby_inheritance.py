"""How a holder's standbys outlive it, and how its next incarnation finds them.

A holder with a stable name (the reconciler, one per namespace, which Ray restarts when
its process dies) names its standbys after itself (``standby_name``). Its restarted
self lists them (``left_by``) and asks each whether it may take it over
(``SessionActor.inheritable``, answered with a ``Standing`` after comparing an
``inheritance_key``); those it does not take are asked to go (``ask_to_retire``).
``StandbySet.inherit`` (``actors.standby``) puts these together.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import uuid
from enum import StrEnum
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, RayError

from actors import named
from actors.config_ref import settings_digest
from actors.named import get_actor, named_actors
from torpor import __version__
from torpor.settings import Settings

log = logging.getLogger(__name__)

STANDBY_PREFIX = "session-standby:"
# How long a left standby may take to answer that it goes, and how often it is asked (at
# the least: asked on until its exit's grace has passed, ``ask_to_retire``).
RETIRE_TIMEOUT_S = 5.0
RETIRE_ATTEMPTS = 3
# The pause before asking again one that Ray said is unavailable (it may say so at once).
RETIRE_PAUSE_S = 1.0


# How much a guess at the settings behind an inheritance key costs: the key travels in a
# Ray call and the settings may hold inline secrets.
KEY_ROUNDS = 100_000


class Standing(StrEnum):
    """A standby's answer to a holder that would inherit it (``SessionActor.inheritable``)."""

    FREE = "free"  # no session: it joins the set (and is kept from now on)
    TAKEN = "taken"  # it runs a session, or is on its way out: left alone
    OTHER = "other"  # it runs other settings or code: retired, never handed a session


async def inheritance_key(settings: Settings, salt: bytes) -> bytes:
    """What a process runs, as a key a holder and a standby compare before the standby
    is inherited: the settings (every field, secrets as written), torpor's version and
    the code Ray started the process with (its runtime environment string, the same in
    an actor and the actors it starts without a ``runtime_env`` of their own). A holder
    replaced with new settings or new code must not hand sessions to a standby running
    the old ones. Salted per round and slow to compute (``KEY_ROUNDS``): it travels in a
    Ray call, and must not make a weak inline secret cheap to guess. Never logged."""
    runtime_env: str = ray.get_runtime_context().get_runtime_env_string()  # type: ignore[no-untyped-call]
    runs = f"{settings_digest(settings)}:{__version__}:{runtime_env}".encode()
    # The hashing leaves the loop's thread: a tenth of a second of CPU, on purpose.
    return await asyncio.to_thread(hashlib.pbkdf2_hmac, "sha256", runs, salt, KEY_ROUNDS)


async def left_by(holder: str, namespace: str, *, timeout_s: float | None = None) -> list[Any]:
    """The standbys named after ``holder`` in ``namespace`` (its predecessor's, when a
    holder was restarted and has started none of its own yet): a listing, then a lookup
    per name, all at once, once per holder's start. Each call is off the loop with a
    deadline (``actors.named``: on the loop, a slow GCS held the holder's every other
    coroutine, the reconciler's sweeps among them); a listing past it fails the search
    with ``ClusterUnavailable``. The lookups share one deadline, ``timeout_s`` (default:
    ``named.LOOKUP_TIMEOUT_S``, each one's own): one after another, N names took up to
    N x ``LOOKUP_TIMEOUT_S`` before the holder's first refill.

    A lookup that does not answer in time is unknown, not gone, and is left out: its
    standby (if it lives) is neither inherited nor asked to go, and goes at the end of
    its idle time, or is found by the holder's next start (its name stays). Failing the
    whole search for it instead left every standby that *was* found unkept as well."""
    deadline_s = named.LOOKUP_TIMEOUT_S if timeout_s is None else timeout_s
    names = await named_actors(namespace, standby_prefix(holder))
    if not names:
        return []
    lookups = [asyncio.create_task(get_actor(name, namespace)) for name in names]
    try:
        await asyncio.wait(lookups, timeout=deadline_s)
    finally:  # past the deadline, or cancelled: none is left running unread
        for lookup in lookups:
            lookup.cancel()  # its thread ends within Ray's own deadline (``named``)
        await asyncio.gather(*lookups, return_exceptions=True)
    found: list[Any] = []
    unknown = 0
    for lookup in lookups:  # in the listing's order
        if lookup.cancelled():
            unknown += 1
            continue
        error = lookup.exception()
        if error is None:
            found.append(lookup.result())
        elif isinstance(error, TimeoutError):
            # Ours (``ClusterUnavailable``) or the call's own (Ray's ``GetTimeoutError``,
            # raised as itself by ``named``): unknown either way, not a failed search.
            unknown += 1
        elif not isinstance(error, ValueError):  # ValueError: gone since the listing
            raise error
    if unknown:
        log.warning(
            "%d of the %d standby session actors left by the last holder were not found"
            " in time; they are left to their idle time",
            unknown,
            len(names),
        )
    return found


def standby_prefix(holder: str | None = None) -> str:
    """The names of a holder's standbys start with this (every standby's with
    ``STANDBY_PREFIX``). A stable holder's name lets its next incarnation find them."""
    return f"{STANDBY_PREFIX}{holder}:" if holder else STANDBY_PREFIX


def standby_name(holder: str | None = None) -> str:
    return f"{standby_prefix(holder)}{uuid.uuid4().hex}"


async def ask_to_retire(handle: Any, *, grace_s: float) -> bool:
    """Ask a standby another holder left to exit (it does unless it has a session), and
    wait for its answer; asked again while it does not answer, never killed (it may be
    running a session its dead holder handed it). True once it answered, or is gone.

    Asked for ``RETIRE_ATTEMPTS`` x ``RETIRE_TIMEOUT_S``, and at least until ``grace_s``
    has passed (the asking holder's ``runtime.actor_exit_grace_s``, a standby's own when
    it runs the same settings): a standby exiting while calls it runs hold it answers
    nothing until its grace ends its process (``actors.exit_deadline``).

    Awaited, not sent and forgotten: the handle is one just looked up by name, and a
    call on it whose reference and handle were dropped at once went unanswered under
    load (the standby waited on for ever with ``standby_idle_s = 0``; a CI run's holder
    with no standby set left its predecessor's running past a minute)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + max(RETIRE_ATTEMPTS * RETIRE_TIMEOUT_S, grace_s + RETIRE_TIMEOUT_S)
    while (left := deadline - loop.time()) > 0:
        try:
            await asyncio.wait_for(handle.retire.remote(), timeout=min(RETIRE_TIMEOUT_S, left))
            return True
        except ActorUnavailableError:
            # Unreachable for now (a network blip), or exiting while calls it runs hold
            # it: asked again after a pause (Ray may say so at once, every time).
            await asyncio.sleep(min(RETIRE_PAUSE_S, max(0.0, deadline - loop.time())))
        except RayError:  # it exited under the call, as asked, or was gone already
            return True
        except TimeoutError:
            continue  # busy, or the request was lost: asked again
    log.warning("a standby session actor left by the last holder did not answer its retire")
    return False
