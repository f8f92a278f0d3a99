"""The pool hosts' handles, one per slot, and a pooled session's activation request.

A pooled session runs on the long-lived host ``hash(session_id)`` selects (``pool_slot``).
Its request is pushed to that host's channel in the index's Redis (``actors.pool``), or
sent as a Ray call where there is none. The handles are cached: every pooled request
passes here, and a known host costs it no thread and no GCS call. A channel that grows
long means its host may be gone for good: it is checked behind the request
(``STALLED_CHANNEL``).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import time
from typing import Any

from actors.activation_calls import ACTIVATE_TIMEOUT_S, MAX_ATTEMPTS, POOLED_BACKOFF, RETRYABLE
from actors.config_ref import ConfigRef
from actors.named import LOOKUP_TIMEOUT_S, create_named, typed_timeouts
from actors.pool import PoolHost, host_name, pool_channel
from torpor import tracing
from torpor.errors import ActivationUnavailable
from torpor.ports import Reason, Wanted
from torpor.ports.services import Services

log = logging.getLogger(__name__)

# A host's channel this long means the host is not taking its requests (a listening one
# keeps it near 1): check it, at most once per HOST_CHECK_S.
STALLED_CHANNEL = 256
HOST_CHECK_S = 5.0
# The whole of a pooled request sent as a Ray call, every attempt in it: a host's make
# or lookup (``LOOKUP_TIMEOUT_S``), its first answer, and one more whole answer after a
# retry. A pool host is made once and runs for good, so most requests wait only for an
# answer it gives at once (it only queues the session). The first answer may count the
# start of a host just made: a process with ``num_cpus=0``, so it needs no free CPU and
# is placed on any live node, and ready in seconds (not the dedicated path's
# ``START_TIMEOUT_S`` for a start on a loaded node). The second covers a host whose node
# went silent: Ray declares the node dead and restarts the host (``max_restarts=-1``)
# meanwhile, and the lookup after finds it. The pauses (``POOLED_BACKOFF``, a second at
# most) fit in what is left. A host slower than that to start on a cold cluster (a node
# still joining, the job's runtime_env set up on it) is not lost: it is detached and
# never killed here, so it starts on, and the request its retry timer brings round finds
# it. Past this the request fails, typed and retryable: retrying on inside it
# (``MAX_ATTEMPTS`` x a lookup, an answer and a pause: some 20 minutes) held a
# coalescer's slot or a sweep all that while.
# A host's check (``_check_host``) is given as long.
POOLED_DEADLINE_S = LOOKUP_TIMEOUT_S + 2 * ACTIVATE_TIMEOUT_S


def pool_slot(session_id: str, size: int) -> int:
    digest = hashlib.sha256(session_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") % size


class PoolHosts:
    """The ``size`` pool hosts of ``namespace``, run on ``config``, as an activator sees
    them: their handles (got or made by name), their checks, and the requests sent to
    them (through their channels, ``services.activations``, when there is one)."""

    def __init__(
        self,
        config: ConfigRef,
        *,
        namespace: str,
        size: int,
        services: Services,
    ) -> None:
        self.config = config
        self.namespace = namespace
        self.size = size
        self._services = services
        self._hosts: dict[int, Any] = {}
        self._making_hosts: dict[int, asyncio.Task[Any]] = {}  # slot -> its get-or-create
        self._host_checked: dict[int, float] = {}  # slot -> monotonic time of the last check
        self._host_checks: dict[int, asyncio.Task[None]] = {}  # slot -> its check under way

    async def warm(self) -> None:
        """Start every pool host and wait until each answers (it listens on its channel
        from then on). A host's start (a process, imports, its services: seconds on a busy
        node) is then paid here, once, instead of by every request routed to it meanwhile;
        hosts are detached, so this is a no-op wait once they run."""

        async def answered(slot: int) -> Any:
            host = await self._host(slot)  # held while it is called (ray#6265)
            return await host.where.remote()

        slots = range(self.size)
        await asyncio.wait_for(asyncio.gather(*map(answered, slots)), ACTIVATE_TIMEOUT_S)

    async def _host(self, slot: int) -> Any:
        """Pool host ``slot``'s handle, got or made by name off the loop (GCS calls,
        ``create_named``; ``ClusterUnavailable`` past their deadline). Kept once known:
        every pooled request passes here, and a known host costs it no thread and no
        GCS call. Requests that find none yet share one get-or-create: a burst at a
        cold replica sent one each to the GCS."""
        host = self._hosts.get(slot)
        if host is not None:
            return host
        making = self._making_hosts.get(slot)
        if making is None:
            making = asyncio.create_task(self._make_host(slot))
            self._making_hosts[slot] = making
            making.add_done_callback(functools.partial(self._host_made, slot))
        # Shielded: a request cancelled while it waits does not cancel the others' make.
        return await asyncio.shield(making)

    async def _make_host(self, slot: int) -> Any:
        # Ray's own timeout typed as ours (``typed_timeouts``): a pooled request's caller
        # reads the same ``ClusterUnavailable`` as a dedicated one's.
        with typed_timeouts(f"making pool host {host_name(slot)!r}"):
            host = await create_named(
                PoolHost,
                self.config,
                slot,
                name=host_name(slot),
                namespace=self.namespace,
                get_if_exists=True,
                lifetime="detached",
                scheduling_strategy="SPREAD",
            )
        self._hosts[slot] = host
        return host

    def _host_made(self, slot: int, making: asyncio.Task[Any]) -> None:
        if self._making_hosts.get(slot) is making:
            del self._making_hosts[slot]
        if not making.cancelled():
            making.exception()  # its waiters' to raise; read here when none is left

    def _forget_host(self, slot: int, host: Any) -> None:
        """Drop ``host``, one that failed, from the cache, only if it is still what the
        slot holds: another request that saw it fail may have found or made its
        successor already, and dropping that sent the next request to the GCS again."""
        if self._hosts.get(slot) is host:
            del self._hosts[slot]

    def _host_checked_out(self, slot: int, check: asyncio.Task[None]) -> None:
        self._host_checks.pop(slot, None)
        if not check.cancelled() and (failed := check.exception()) is not None:
            log.warning("checking pool host %s failed", slot, exc_info=failed)

    async def _check_host(self, slot: int) -> None:
        """Requests pile up on a host's channel: it may be gone for good (killed without
        a restart), and a cached handle would never notice. Ask it, at most once per
        ``HOST_CHECK_S``; one that cannot answer is looked up (or made) again until one
        does (a lookup right after a death can still return the dead actor, ray#44083),
        and a live one starts its listener again if that stopped. For no longer than a
        request (``POOLED_DEADLINE_S``): it then gives up (logged), and the next push
        that finds the channel long checks again. Run on for ``MAX_ATTEMPTS`` lookups
        and answers (some 20 minutes), it shut every later check of the slot out."""
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        if now - self._host_checked.get(slot, 0.0) < HOST_CHECK_S:
            return
        self._host_checked[slot] = now
        deadline = loop.time() + POOLED_DEADLINE_S
        last: Exception | None = None  # the last attempt's error, in the log after it
        attempts = 0
        while attempts < MAX_ATTEMPTS and loop.time() < deadline:
            attempts += 1
            host = None
            wait_s = ACTIVATE_TIMEOUT_S
            lookup = asyncio.timeout_at(deadline)  # a shared make goes on for the others
            try:
                async with lookup:
                    host = await self._host(slot)  # held while it is called (ray#6265)
                wait_s = min(ACTIVATE_TIMEOUT_S, deadline - loop.time())
                await asyncio.wait_for(host.listen.remote(), wait_s)
                return
            except (*RETRYABLE, TimeoutError) as exc:
                last = exc
                if lookup.expired() or (
                    isinstance(exc, TimeoutError) and wait_s < ACTIVATE_TIMEOUT_S
                ):
                    break  # cut short by the deadline, not shown silent: the host is kept
                if attempts == 1:
                    log.warning("pool host %s does not answer; looking it up again", slot)
                if host is not None:
                    self._forget_host(slot, host)
            pause = POOLED_BACKOFF.delay_s(attempts - 1)
            if loop.time() + pause >= deadline:
                break
            await asyncio.sleep(pause)
        log.error(
            "no pool host %s answered in %d attempts (%g s at most); its requests wait for"
            " their timers",
            slot,
            attempts,
            POOLED_DEADLINE_S,
            exc_info=last,
        )

    async def request(self, session_id: str, reason: Reason, requested_at: float) -> None:
        """The session's request sent to its host (``pool_slot``): pushed to the host's
        channel, or a Ray call where there is no channel."""
        slot = pool_slot(session_id, self.size)
        queue = self._services.activations
        if queue is not None:
            await self._host(slot)  # it exists: it listens from its start
            wanted = Wanted(session_id, reason, requested_at, tracing.traceparent())
            waiting = await queue.push(pool_channel(self.namespace, slot), wanted)
            if waiting >= STALLED_CHANNEL and slot not in self._host_checks:
                # Behind the request, not on its path: the request is in the channel
                # already, and a host that does not answer is asked for up to
                # ``POOLED_DEADLINE_S``. Awaited here, a webhook that found the
                # channel stalled waited for all of it before its answer.
                check = asyncio.create_task(self._check_host(slot))
                self._host_checks[slot] = check
                check.add_done_callback(functools.partial(self._host_checked_out, slot))
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + POOLED_DEADLINE_S
        last: Exception | None = None  # the last attempt's error: the cause raised after it
        attempts = 0
        while attempts < MAX_ATTEMPTS and loop.time() < deadline:
            attempts += 1
            # A GCS that did not make or find it in time (``ClusterUnavailable``) fails
            # the request, as on the dedicated path: its timer brings it round. The wait
            # for a make that others share is cut short at the deadline; the make itself
            # goes on for them (``_host``).
            lookup = asyncio.timeout_at(deadline)
            try:
                async with lookup:
                    host = await self._host(slot)  # held while it is called (ray#6265)
            except TimeoutError as cut:
                if not lookup.expired():
                    raise  # the GCS's, ``ClusterUnavailable``: not the request's deadline
                last = cut
                break
            wait_s = min(ACTIVATE_TIMEOUT_S, deadline - loop.time())
            try:
                # A live host answers at once (it only queues the session): silence is a
                # node gone but not yet declared dead, and without a deadline the request
                # (and the sweep or webhook awaiting it) waited for as long as that lasted.
                # The host is not killed, as a dedicated actor would be: it runs others'
                # sessions. A request it takes late only runs an activation more.
                await asyncio.wait_for(
                    host.activate.remote(
                        session_id, reason.value, requested_at, tracing.traceparent()
                    ),
                    timeout=wait_s,
                )
                return
            except (*RETRYABLE, TimeoutError) as exc:
                last = exc
                if isinstance(exc, TimeoutError) and wait_s < ACTIVATE_TIMEOUT_S:
                    # The request's deadline, not the host's own: not shown silent (a
                    # host just made may still be starting), it stays known, and the
                    # request its timer brings round gives it its whole time.
                    break
                self._forget_host(slot, host)  # restarting or silent: look it up again
            pause = POOLED_BACKOFF.delay_s(attempts - 1)
            if loop.time() + pause >= deadline:
                break  # no time for another attempt: the caller's retry timer makes it
            await asyncio.sleep(pause)
        raise ActivationUnavailable(
            f"pool host {slot} did not take {session_id} in {attempts} attempts"
            f" ({POOLED_DEADLINE_S:g} s at most)"
        ) from last

    async def close(self) -> None:
        """Stop the checks and the get-or-creates under way."""
        checks = [*self._host_checks.values(), *self._making_hosts.values()]
        for check in checks:
            check.cancel()
        await asyncio.gather(*checks, return_exceptions=True)
