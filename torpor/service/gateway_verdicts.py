"""The gateway's verdicts (``torpor.service.gateway``): the wait an event answers,
through the index or, on a miss, the durable correlation record, and what the event
can do to it (an ``Outcome``), from the session's header or its whole snapshot."""

from __future__ import annotations

from datetime import datetime

from torpor.errors import InvalidKey, SessionNotFound, SnapshotCorrupt
from torpor.gates import may_restrict
from torpor.models import SessionHeader, Wait, WaitRoute
from torpor.ports import WaitBinding
from torpor.service.gateway_edge import GatewayEdge
from torpor.service.gateway_outcomes import Outcome, _Resolved, _Seen
from torpor.webhooks.payloads import InboundEvent


class GatewayVerdicts(GatewayEdge):
    """Which wait an event answers, and what it can do to it."""

    async def _resolve(self, tenant: str, event: InboundEvent, now: datetime) -> _Resolved:
        index = self.services.index
        found = None
        if event.correlation_id:
            found = await index.resolve(tenant=tenant, now=now, correlation_id=event.correlation_id)
        elif event.business_key:
            found = await index.resolve(tenant=tenant, now=now, business_key=event.business_key)
        if found is not None:
            return _Resolved(found, from_record=False)
        return _Resolved(await self._durable(tenant, event), from_record=True)

    async def _durable(self, tenant: str, event: InboundEvent) -> WaitBinding | None:
        """After an index miss the durable correlation record decides, never the miss: a
        flushed Redis must not turn a valid callback away."""
        records = self.services.correlations
        if event.correlation_id:
            try:
                record = await records.lookup(event.correlation_id)
            except InvalidKey:  # no id torpor issues looks like this: no wait has it
                return None
            return record if record is not None and record.tenant == tenant else None
        if event.business_key:
            return await records.lookup_business_key(tenant=tenant, business_key=event.business_key)
        return None

    async def _classify(
        self, source_name: str, resolved: _Resolved, event: InboundEvent, now: datetime
    ) -> _Seen:
        """What the event can do to its wait, as far as the edge can tell; the trace id of
        the session it names (for the audit record: the webhook links to the reasoning it
        caused) and its agent (the activation is routed without another read)."""
        binding = resolved.binding
        if binding is None:
            return _Seen(Outcome.UNKNOWN)
        try:
            return await self._classify_bound(source_name, resolved, binding, event, now)
        except SessionNotFound:
            # Bound to a session that is gone (retention, behind a stale record): the
            # event's own outcome, not the request's, so a batch's other events stand.
            return _Seen(Outcome.UNKNOWN)

    async def _classify_bound(
        self,
        source_name: str,
        resolved: _Resolved,
        binding: WaitBinding,
        event: InboundEvent,
        now: datetime,
    ) -> _Seen:
        # The index binds no sources: the snapshot's header says who may answer (a short
        # read, no decompression); a header older than 0.4 sends us to the whole snapshot.
        header = await self._header(binding)
        if header is not None and header.waits is not None:
            route = header.route_for(binding.correlation_id)
            outcome = self._verdict(source_name, resolved, event, now, route, header.state.terminal)
            return _Seen(outcome, header.trace_id, header.agent)
        snapshot = await self.sessions.get(binding.session_id, tenant=binding.tenant)
        wait = snapshot.wait_for(binding.correlation_id)
        outcome = self._verdict(source_name, resolved, event, now, wait, snapshot.terminal)
        return _Seen(outcome, snapshot.trace_id, snapshot.agent.name)

    async def _header(self, binding: WaitBinding) -> SessionHeader | None:
        """The session's header, or None where only the whole snapshot will do: another
        tenant's session (reported as not found there) or a damaged header (quarantine
        decides there)."""
        try:
            header = await self.services.snapshots.header(binding.session_id)
        except (SnapshotCorrupt, InvalidKey):
            return None
        return header if header.tenant == binding.tenant else None

    @staticmethod
    def _verdict(
        source_name: str,
        resolved: _Resolved,
        event: InboundEvent,
        now: datetime,
        wait: Wait | WaitRoute | None,
        terminal: bool,
    ) -> Outcome:
        binding = resolved.binding
        assert binding is not None
        if wait is not None and may_restrict(wait) and source_name not in wait.allowed_sources:
            # Knowing the correlation id or business key is not enough: only the sources
            # the wait names may answer it (the gate observes anything else as UNEXPECTED).
            return Outcome.UNEXPECTED
        key_only = event.epoch is None and event.correlation_id is None
        replanned = wait is not None and wait.replanned
        if key_only and (binding.epoch > 1 or replanned):
            # Found by business key alone, and the session has waited before (in an earlier
            # epoch, or in this one: a fan-in member's request reissued in place). If an
            # earlier wait used the same key (a re-plan), the key now names the new wait
            # and a late answer to the superseded request would be applied to it: only the
            # sender can say which it answers (for a request reissued in place, only by
            # the correlation id: an echoed epoch names both).
            if wait is None:
                return Outcome.CLOSED
            if wait.replanned:
                return Outcome.AMBIGUOUS
        if event.epoch is not None and event.epoch != binding.epoch:
            return Outcome.STALE
        # From the record alone, the index no longer binds it: closed, or the index lost.
        if resolved.from_record and (terminal or wait is None):
            return Outcome.CLOSED
        if now > binding.deadline:
            return Outcome.LATE
        return Outcome.ACCEPTED
