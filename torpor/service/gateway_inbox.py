"""The gateway's inbox writes (``torpor.service.gateway``): an event routed into its
session's inbox (staged, audited, its wake timer armed), a redelivery's wake, and the
activations asked for once the request is remembered."""

from __future__ import annotations

import asyncio
from datetime import datetime
from typing import Any

from torpor import logs, tracing
from torpor.errors import SnapshotCorrupt
from torpor.events import EventKind, InboxEvent
from torpor.faults import CrashPoint, crash_point
from torpor.ports import Reason
from torpor.service.gateway_outcomes import Outcome, Routed, _Resolved
from torpor.service.gateway_verdicts import GatewayVerdicts
from torpor.service.replay import ReplayClaims
from torpor.webhooks.payloads import InboundEvent
from torpor.webhooks.signing import Verified


class GatewayInbox(GatewayVerdicts):
    """Events stored into their sessions' inboxes, and the sessions woken for them."""

    async def _route(
        self,
        source_name: str,
        resolved: _Resolved,
        event: InboundEvent,
        verified: Verified,
        claims: ReplayClaims,
        body_sha: str,
        trace: str | None,
        now: datetime,
    ) -> Routed:
        audit: dict[str, Any] = {
            "source": source_name,
            "at": now,
            "event_id": event.event_id,
            "correlation_id": event.correlation_id,
            "body_sha256": body_sha,
            "signature": verified.signature[:512],
            "timestamp": verified.timestamp,
            "trace_id": trace,
        }
        seen = await self._classify(source_name, resolved, event, now)
        outcome, audit["session_trace_id"] = seen.outcome, seen.trace_id
        binding = resolved.binding
        if binding is None or outcome in (Outcome.UNKNOWN, Outcome.AMBIGUOUS, Outcome.UNEXPECTED):
            # Unknown, another tenant's, ambiguous, or from a source the wait does not
            # name: nothing stored, and on the record.
            sid = binding.session_id if binding else None
            await self.audit.append(verdict=outcome.value, session_id=sid, **audit)
            return Routed(event.event_id, sid, outcome)  # counted by the request
        data: Any = event.data
        if event.status is not None and isinstance(data, dict) and "status" not in data:
            data = {**data, "status": event.status}
        addressed = event.epoch is None or event.epoch == binding.epoch
        logs.update(session_id=binding.session_id, correlation_id=binding.correlation_id)
        inbox_span = tracing.span(
            "torpor.inbox.write",
            **{"torpor.session_id": binding.session_id, "torpor.event_id": event.event_id},
        )
        stored = InboxEvent.new(
            kind=EventKind.CALLBACK,
            session_id=binding.session_id,
            source=source_name,
            event_id=event.event_id,
            type=event.type,
            received_at=now,
            # A CloudEvent's id is its producer's (its own ``source``); a mapped payload's
            # is the torpor source's, which is all its ``source`` names.
            producer=None if event.source == f"torpor:{source_name}" else event.source,
            correlation_id=binding.correlation_id,
            business_key=event.business_key,
            # The sender's own word on which request it answers wins over the wait the
            # index resolved now: that is what lets the epoch gate see a stale answer.
            epoch=binding.epoch if event.epoch is None else event.epoch,
            step_id=binding.step_id if addressed else None,
            data=data,
            trace_id=trace,
            verified_by=verified.scheme.value,
            content_digest=verified.content_digest,
        )
        with inbox_span:
            # Staged: visible now, durable by the answer (``_audited``), with the audit
            # record's flush in the usual case: one wait for the disk, not two in a row.
            written_in = await self.services.inbox.stage(stored)
            crash_point(CrashPoint.GATEWAY_AFTER_INBOX)
        new = written_in.new
        verdict = outcome.value if new else Outcome.DUPLICATE.value
        audit["correlation_id"] = binding.correlation_id
        # Counted by the request once its writes are done (``_counted``).
        record = self.audit.append(verdict=verdict, session_id=binding.session_id, **audit)
        if new:
            # The audit record is written while the wake timer is armed and then beside
            # the replay marker (``_receive``). The timer strictly after the inbox write:
            # an activation unschedules it before its last look at the inbox, and an
            # event that lands after that look must find a timer of its own. The marker
            # strictly after the timer: a marker answers the sender's retry with 409, so
            # it must never name an event nothing would wake.
            written = asyncio.ensure_future(record)
            try:
                await self.sessions.arm_wake(binding.session_id)
            except BaseException:
                await asyncio.gather(written, return_exceptions=True)
                raise
            crash_point(CrashPoint.GATEWAY_AFTER_WAKE)
            return Routed(
                event.event_id,
                binding.session_id,
                outcome,
                activate=(binding.session_id, seen.agent),
                audit=written,
                durable=written_in.durable,
            )
        await asyncio.gather(record, self._wake_if_pending(binding.session_id, stored.key))
        replayed = await self.replays.was_accepted(claims)
        return Routed(event.event_id, binding.session_id, Outcome.DUPLICATE, True, replayed)

    async def _activate(self, routed: list[Routed]) -> None:
        """Ask for the stored events' activations (their wake timers are armed)."""
        for r in routed:
            if r.activate is not None:
                session_id, agent = r.activate
                await self.sessions.activate(session_id, reason=Reason.EVENT, agent=agent)

    async def _wake(self, session_id: str) -> None:
        await self.sessions.activate_for_event(session_id)  # the wake timer, then a request
        crash_point(CrashPoint.GATEWAY_AFTER_WAKE)

    async def _wake_if_pending(self, session_id: str, key: str) -> None:
        """A redelivered event the session has not processed yet: its first delivery may
        have died between the inbox write and the wake timer, so arm it (again)."""
        try:  # its processed ids only: the whole session is all its history
            processed = await self.services.snapshots.processed_events(session_id)
        except SnapshotCorrupt:
            # Set aside, or about to be: the event is stored all the same, and an
            # activation is what quarantines the session (again) or, once an operator
            # restored it, takes the event. The sender is answered "duplicate", not a 500
            # at every retry of an event it already delivered.
            await self._wake(session_id)
            return
        if key not in processed:
            await self._wake(session_id)
