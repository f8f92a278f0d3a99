"""Get a session activated on Ray, in its agent's placement.

Dedicated: race-safe get-or-create of the session's named actor, then a poke. Ray may
hand back an actor that has just decided to exit (ray#44083); it answers ``closing`` or
dies under the call, and we retry until a fresh one takes the request. Pooled: a poke to
the host that ``hash(session_id)`` selects.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict
from typing import Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError

from actors.pool import PoolHost, host_name
from actors.session_actor import ACCEPTED, SessionActor, actor_name
from storage.factory import check_embedded_allowed
from torpor.backoff import Backoff
from torpor.errors import ActivationUnavailable, SessionNotFound
from torpor.ports import Reason
from torpor.ports.services import Services
from torpor.settings import Placement, Settings

_RETRYABLE = (RayActorError, ActorDiedError, ActorUnavailableError, GetTimeoutError)
MAX_ATTEMPTS = 40
# Ray needs a moment to settle a dying actor or a restarting host: retry soon, then less
# often. No jitter: one caller retries one actor, there is no fleet to spread out.
DEDICATED_BACKOFF = Backoff(base_s=0.02, cap_s=0.5, jitter=0)
POOLED_BACKOFF = Backoff(base_s=0.05, cap_s=1.0, jitter=0)
POKE_TIMEOUT_S = 20.0


def alive_nodes() -> int:
    nodes: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]
    return len([node for node in nodes if node.get("Alive")])


def pool_slot(session_id: str, size: int) -> int:
    digest = hashlib.sha256(session_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") % size


class RayActivator:
    def __init__(self, services: Services) -> None:
        self.services = services
        self.settings: Settings = services.settings
        self.namespace = self.settings.namespace
        check_embedded_allowed(self.settings, alive_nodes=alive_nodes())
        self._placements: OrderedDict[str, Placement] = OrderedDict()
        self._hosts: dict[int, Any] = {}

    async def request(
        self,
        session_id: str,
        *,
        reason: Reason,
        agent: str | None = None,
        requested_at: float | None = None,
    ) -> None:
        requested_at = time.time() if requested_at is None else requested_at
        placement = await self._placement(session_id, agent)
        if placement is Placement.POOLED:
            await self._pooled(session_id, reason, requested_at)
        else:
            await self._dedicated(session_id, reason, requested_at)

    async def _placement(self, session_id: str, agent: str | None) -> Placement:
        if agent is None and session_id in self._placements:
            return self._placements[session_id]
        if agent is None:
            try:
                agent = (await self.services.snapshots.header(session_id)).agent
            except SessionNotFound:
                agent = ""
        config = self.settings.agents.get(agent)
        placement = config.placement if config else Placement.DEDICATED
        self._placements[session_id] = placement
        if len(self._placements) > 10_000:
            self._placements.popitem(last=False)
        return placement

    async def _dedicated(self, session_id: str, reason: Reason, requested_at: float) -> None:
        for attempt in range(MAX_ATTEMPTS):
            try:
                handle = SessionActor.options(  # type: ignore[attr-defined]
                    name=actor_name(session_id),
                    namespace=self.namespace,
                    get_if_exists=True,
                    lifetime="detached",
                    # Spread sessions over the cluster: losing a node then costs a slice
                    # of the running sessions, not all of them.
                    scheduling_strategy="SPREAD",
                ).remote(self.settings, session_id)
                try:
                    answer = await asyncio.wait_for(
                        handle.poke.remote(reason.value, requested_at), timeout=POKE_TIMEOUT_S
                    )
                except TimeoutError:
                    # A poke answers at once; silence means the actor's node is gone but
                    # not yet declared dead. Free the name: the session is safe (its
                    # lease and the generation CAS), and the next attempt starts afresh.
                    ray.kill(handle, no_restart=True)
                    continue
                if answer == ACCEPTED:
                    return
            except _RETRYABLE:
                pass  # the actor died between lookup and call: make a new one
            await asyncio.sleep(DEDICATED_BACKOFF.delay_s(attempt))
        raise ActivationUnavailable(f"no session actor for {session_id} took the request")

    def _host(self, slot: int) -> Any:
        if slot not in self._hosts:
            self._hosts[slot] = PoolHost.options(  # type: ignore[attr-defined]
                name=host_name(slot),
                namespace=self.namespace,
                get_if_exists=True,
                lifetime="detached",
                scheduling_strategy="SPREAD",
            ).remote(self.settings, slot)
        return self._hosts[slot]

    async def _pooled(self, session_id: str, reason: Reason, requested_at: float) -> None:
        slot = pool_slot(session_id, self.settings.pool.size)
        for attempt in range(MAX_ATTEMPTS):
            try:
                await self._host(slot).poke.remote(session_id, reason.value, requested_at)
                return
            except _RETRYABLE:
                self._hosts.pop(slot, None)  # restarting: look it up again
            await asyncio.sleep(POOLED_BACKOFF.delay_s(attempt))
        raise ActivationUnavailable(f"pool host {slot} did not take {session_id}")
