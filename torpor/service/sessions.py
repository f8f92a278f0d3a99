"""The control plane: submit, inspect, cancel, deliver events, submit batches.

One implementation serves the Python client, the HTTP task API and the CLI. It writes
durable state first (snapshot, inbox event, batch manifest) and only then asks for an
activation, so a lost activation request delays work but never loses it: the wake-up
timer scheduled alongside brings the reconciler round.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from pydantic import BaseModel, ConfigDict, JsonValue, ValidationError

from storage import keys
from torpor.errors import (
    IdempotencyInProgress,
    IdempotencyMismatch,
    InvalidKey,
    InvalidRequest,
    ObjectExists,
    ObjectNotFound,
    PluginNotFound,
    SnapshotCorrupt,
    SnapshotNotFound,
    UnknownAgent,
)
from torpor.events import EventKind, InboxEvent
from torpor.ids import new_batch_id, new_session_id, new_trace_id
from torpor.lifecycle import SessionState
from torpor.models import AgentRef, SessionSnapshot
from torpor.ports import Activator, IdempotencyStatus, Reason, TimerKind
from torpor.ports.services import Services
from torpor.service import quarantine
from torpor.ssrf import check_callback_url

IDEMPOTENCY_TTL = timedelta(hours=24)
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Submitted:
    session_id: str
    created: bool  # False: an earlier request with the same Idempotency-Key made it


class BatchManifest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    batch_id: str
    tenant: str
    agent: str
    session_ids: list[str]
    created_at: datetime


@dataclass(frozen=True)
class BatchProgress:
    batch_id: str
    total: int
    by_state: dict[str, int]

    @property
    def done(self) -> int:
        return sum(n for s, n in self.by_state.items() if SessionState(s).terminal)

    @property
    def finished(self) -> bool:
        return self.done == self.total


def fingerprint(payload: dict[str, Any]) -> str:
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


class SessionService:
    def __init__(
        self, services: Services, activator: Activator, *, background: bool = False
    ) -> None:
        self.services = services
        self.activator = activator
        # In an HTTP handler, answer first and let the activation request run behind.
        self.background = background
        self._tasks: set[asyncio.Task[None]] = set()
        self._inflight: set[str] = set()
        self._again: set[str] = set()

    @property
    def _now(self) -> datetime:
        return self.services.clock.now()

    async def _wake_later(self, session_id: str) -> None:
        grace = timedelta(seconds=self.services.settings.wake_grace_s)
        await self.services.index.schedule(
            kind=TimerKind.WAKE, member=session_id, at=self._now + grace
        )

    # -- submit ---------------------------------------------------------------------

    async def submit(
        self,
        *,
        tenant: str,
        agent: str,
        input: JsonValue,
        metadata: dict[str, str] | None = None,
        callback_url: str | None = None,
        idempotency_key: str | None = None,
        batch_id: str | None = None,
    ) -> Submitted:
        try:
            loaded = self.services.plugins.agent(agent)
        except PluginNotFound as exc:
            raise UnknownAgent(f"no agent named {agent!r} is configured") from exc
        metadata = dict(metadata or {})
        if callback_url is not None:
            if self.services.settings.notify_key is None:
                raise InvalidRequest("callback_url needs notifications set up (notify_key)")
            await asyncio.to_thread(
                check_callback_url,
                callback_url,
                allow_private=self.services.settings.allow_private_callbacks,
            )
        session_id = new_session_id()
        index = self.services.index
        if idempotency_key is not None:
            fp = fingerprint(
                {"agent": agent, "input": input, "metadata": metadata, "callback": callback_url}
            )
            claim = await index.claim_idempotency(
                tenant=tenant,
                key=idempotency_key,
                fingerprint=fp,
                session_id=session_id,
                ttl=IDEMPOTENCY_TTL,
                now=self._now,
            )
            if not claim.created:
                if claim.fingerprint != fp:
                    raise IdempotencyMismatch(
                        "this Idempotency-Key was already used with a different request"
                    )
                if claim.status is IdempotencyStatus.IN_PROGRESS:
                    raise IdempotencyInProgress(
                        "the first request with this Idempotency-Key is still being processed"
                    )
                return Submitted(claim.session_id, created=False)
        now = self._now
        snapshot = SessionSnapshot(
            session_id=session_id,
            tenant=tenant,
            agent=AgentRef(name=agent, version=loaded.agent.version),
            trace_id=new_trace_id(),
            input=input,
            metadata=metadata,
            callback_url=callback_url,
            batch_id=batch_id,
            variables={"tool_versions": dict(loaded.tools.versions())},
            retry={"max_attempts": loaded.config.max_tool_retries},
            created_at=now,
            updated_at=now,
        )
        try:
            await self.services.snapshots.create(snapshot)
            await index.record_session(
                tenant=tenant, session_id=session_id, state=SessionState.PENDING, generation=0
            )
            await self._wake_later(session_id)
        except BaseException:
            if idempotency_key is not None:  # let a retry of this request start over
                await index.release_idempotency(tenant=tenant, key=idempotency_key)
            raise
        if idempotency_key is not None:
            await index.finish_idempotency(
                tenant=tenant, key=idempotency_key, ttl=IDEMPOTENCY_TTL, now=self._now
            )
        await self.activate(session_id, reason=Reason.SUBMIT, agent=agent)
        return Submitted(session_id, created=True)

    # -- inspect ----------------------------------------------------------------------

    async def get(self, session_id: str, *, tenant: str | None = None) -> SessionSnapshot:
        """A tenant never sees another tenant's session: it is simply not found."""
        try:
            keys.safe(session_id, "session id")
        except InvalidKey:
            raise SnapshotNotFound(f"no session {session_id[:80]!r}") from None
        try:
            snapshot = await self.services.snapshots.load(session_id)
        except SnapshotCorrupt as exc:
            snapshot = await quarantine.stand_in(self.services, session_id, exc)
        if tenant is not None and snapshot.tenant != tenant:
            raise SnapshotNotFound(f"no session {session_id}")
        return snapshot

    async def wait(
        self, session_id: str, *, timeout_s: float = 300.0, tenant: str | None = None
    ) -> SessionSnapshot:
        """Poll until the session ends; raise TimeoutError with the last state otherwise."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        delay = 0.05
        while True:
            snapshot = await self.get(session_id, tenant=tenant)
            if snapshot.terminal:
                return snapshot
            if loop.time() >= deadline:
                raise TimeoutError(f"session {session_id} still {snapshot.state}")
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 1.0)

    # -- change ---------------------------------------------------------------------

    async def cancel(self, session_id: str, *, tenant: str | None = None) -> SessionSnapshot:
        """Idempotent: the cancel request is one inbox event, whoever sends it how often."""
        snapshot = await self.get(session_id, tenant=tenant)
        if not snapshot.terminal:
            await self.deliver(
                InboxEvent.new(
                    kind=EventKind.CANCEL,
                    session_id=session_id,
                    source="torpor",
                    event_id="cancel",
                    type="torpor.session.cancel",
                    received_at=self._now,
                )
            )
        return snapshot

    async def retry(self, session_id: str, *, tenant: str | None = None) -> SessionSnapshot:
        """Operator action: take a QUARANTINED session back (``torpor.service.quarantine``)."""
        return await quarantine.retry(self, session_id, tenant=tenant)

    async def deliver(self, event: InboxEvent) -> bool:
        """Durably accept an event for a session, then wake it. False for a redelivery."""
        new = await self.services.inbox.deliver(event)
        if new:
            await self.wake(event.session_id)
        return new

    async def wake(self, session_id: str) -> None:
        """After a durable inbox write: a timer as safety net, then an activation."""
        await self._wake_later(session_id)
        await self.activate(session_id, reason=Reason.EVENT)

    async def activate(self, session_id: str, *, reason: Reason, agent: str | None = None) -> None:
        """Ask for an activation. Failure here loses nothing: the state is already durable
        and the wake-up timer brings the reconciler round."""
        if not self.background:
            await self._activate(session_id, reason, agent)
            return
        if session_id in self._inflight:
            # A burst for one session (duplicates, a batch of its events) costs one more
            # request at most: the activation that runs next sees every event so far.
            self._again.add(session_id)
            return
        if len(self._inflight) >= self.services.settings.max_inflight_activations:
            # Backpressure: the event is durable and its wake-up timer is set, so the
            # reconciler activates it; this replica keeps answering webhooks meanwhile.
            return
        self._inflight.add(session_id)
        task = asyncio.create_task(self._activate_coalesced(session_id, reason, agent))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _activate_coalesced(self, session_id: str, reason: Reason, agent: str | None) -> None:
        try:
            await self._activate(session_id, reason, agent)
            while session_id in self._again:
                self._again.discard(session_id)
                await self._activate(session_id, Reason.EVENT, agent)
        finally:
            self._inflight.discard(session_id)

    async def _activate(self, session_id: str, reason: Reason, agent: str | None) -> None:
        try:
            await self.activator.request(session_id, reason=reason, agent=agent)
        except Exception:
            log.warning(
                "activation request for %s failed; the reconciler will retry",
                session_id,
                exc_info=True,
            )

    async def drain(self) -> None:
        """Wait for background activation requests (tests, orderly shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    # -- batches --------------------------------------------------------------------

    async def submit_batch(
        self,
        *,
        tenant: str,
        agent: str,
        documents: list[JsonValue],
        metadata: dict[str, str] | None = None,
        callback_url: str | None = None,
        batch_id: str | None = None,
        concurrency: int = 16,
    ) -> BatchManifest:
        """One session per document. Each is submitted with the key ``batch:{id}:{n}``,
        so re-submitting a batch after a crash creates nothing twice."""
        if not documents:
            raise InvalidRequest("a batch needs at least one document")
        batch_id = batch_id or new_batch_id()
        gate = asyncio.Semaphore(concurrency)

        async def one(i: int, doc: JsonValue) -> str:
            async with gate:
                result = await self.submit(
                    tenant=tenant,
                    agent=agent,
                    input=doc,
                    metadata=metadata,
                    callback_url=callback_url,
                    idempotency_key=f"batch:{batch_id}:{i}",
                    batch_id=batch_id,
                )
                return result.session_id

        ids = await asyncio.gather(*(one(i, d) for i, d in enumerate(documents)))
        manifest = BatchManifest(
            batch_id=batch_id,
            tenant=tenant,
            agent=agent,
            session_ids=list(ids),
            created_at=self._now,
        )
        try:
            await self.services.store.put_if_absent(
                keys.batch(batch_id), manifest.model_dump_json().encode()
            )
        except ObjectExists:
            return await self.batch(batch_id, tenant=tenant)
        return manifest

    async def batch(self, batch_id: str, *, tenant: str | None = None) -> BatchManifest:
        try:
            obj = await self.services.store.get(keys.batch(batch_id))
            manifest = BatchManifest.model_validate_json(obj.data)
        except (ObjectNotFound, ValidationError, InvalidKey):
            raise SnapshotNotFound(f"no batch {batch_id[:80]!r}") from None
        if tenant is not None and manifest.tenant != tenant:
            raise SnapshotNotFound(f"no batch {batch_id[:80]!r}")
        return manifest

    async def progress(self, batch_id: str, *, tenant: str | None = None) -> BatchProgress:
        manifest = await self.batch(batch_id, tenant=tenant)
        states = await self.services.index.session_states(manifest.session_ids)
        missing = [sid for sid in manifest.session_ids if sid not in states]
        for sid in missing:  # the index lost them (e.g. flushed): ask the snapshots
            try:
                states[sid] = (await self.services.snapshots.header(sid)).state
            except SnapshotNotFound:
                continue
        counts = Counter(state.value for state in states.values())
        return BatchProgress(batch_id, len(manifest.session_ids), dict(counts))
