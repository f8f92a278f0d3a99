"""Operator actions from the console, each audited with who and why.

Every action first writes its record (operator key id, action, session, reason, payload)
create-only to the object store, then appends an audit record naming it (verdict
``operator:<action>``, source ``operator:<key id>``, the record's SHA-256 as the body
hash, so editing the reason later breaks the chain), and only then acts. An action that
then fails is still on record as asked for: nothing unaudited ever changes a session.

Force-resolve is the operator's takeover of a wait: the payload goes into the session's
inbox as an operator-sourced event addressed to that wait (its correlation id, epoch and
step) and the session is activated, exactly as a webhook's event would be. The same
gates decide: a wait that closed meanwhile sees it as stale, a late one as late.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import JsonValue

from storage import keys
from torpor.deliveries import Delivery
from torpor.entry.console.login import Principal
from torpor.errors import InvalidRequest, NotFound, PermanentError
from torpor.events import EventKind, InboxEvent
from torpor.lifecycle import SessionState
from torpor.models import OutboxEntry, SessionSnapshot
from torpor.ports import Reason, TimerKind
from torpor.service.deliveries import DeliveryWorker, ensure_resendable
from torpor.service.sessions import SessionService

OPERATOR_SOURCE = "operator"
MAX_REASON = 500
# What retry now did, as the session page then says it.
TAKEN_BACK = "quarantined session taken back"
ACTIVATED = "activation requested"


class Forbidden(PermanentError):
    """A tenant's read-only login asked for an operator action."""

    code: ClassVar[str] = "forbidden"
    status, title = 403, "Forbidden"
    public: ClassVar[bool] = True


@dataclass(frozen=True)
class ActionRecord:
    action_id: str
    action: str
    who: str
    reason: str
    session_id: str | None
    detail: dict[str, Any]

    def encode(self) -> bytes:
        body = {
            "action_id": self.action_id,
            "action": self.action,
            "who": self.who,
            "reason": self.reason,
            "session_id": self.session_id,
            "detail": self.detail,
        }
        return json.dumps(body, sort_keys=True, separators=(",", ":"), default=str).encode()


def required_reason(reason: str | None) -> str:
    text = (reason or "").strip()
    if not text:
        raise InvalidRequest("every operator action needs a reason")
    return text[:MAX_REASON]


class OperatorActions:
    def __init__(self, control: SessionService, deliveries: DeliveryWorker) -> None:
        self.control = control
        self.services = control.services
        self.deliveries = deliveries

    async def _record(
        self,
        principal: Principal,
        action: str,
        reason: str | None,
        *,
        session_id: str | None,
        detail: dict[str, Any],
    ) -> ActionRecord:
        if not principal.operator:
            raise Forbidden("the console's tenant view is read-only")
        now = self.services.clock.now()
        record = ActionRecord(
            action_id=f"{now:%Y%m%dT%H%M%S}-{secrets.token_hex(6)}",
            action=action,
            who=principal.who,
            reason=required_reason(reason),
            session_id=session_id,
            detail=detail,
        )
        data = record.encode()
        await self.services.store.put_if_absent(keys.operator_action(record.action_id), data)
        await self.services.audit.append(
            verdict=f"operator:{action}",
            at=now,
            source=f"operator:{principal.key_id}",
            body_sha256=hashlib.sha256(data).hexdigest(),
            event_id=record.action_id,
            session_id=session_id,
        )
        return record

    async def _session(self, principal: Principal, session_id: str) -> SessionSnapshot:
        """The session as this login may see it: another tenant's is not found, as on its
        page, before the role is checked (a 403 there would tell that it exists)."""
        return await self.control.get(session_id, tenant=principal.tenant)

    async def cancel(self, principal: Principal, session_id: str, reason: str) -> SessionSnapshot:
        await self._session(principal, session_id)  # 404 before anything is recorded
        await self._record(principal, "cancel", reason, session_id=session_id, detail={})
        return await self.control.cancel(session_id)

    async def retry_now(self, principal: Principal, session_id: str, reason: str) -> str:
        """A quarantined session is taken back (fresh quota); any other unfinished one has
        its retry timer brought forward and is activated now (a backing-off session)."""
        snapshot = await self._session(principal, session_id)
        await self._record(principal, "retry", reason, session_id=session_id, detail={})
        indexed = (await self.services.index.session_states([session_id])).get(session_id)
        if SessionState.QUARANTINED in (snapshot.state, indexed):
            await self.control.retry(session_id)
            return TAKEN_BACK
        if snapshot.terminal:
            raise InvalidRequest(f"session {session_id} is {snapshot.state}: nothing to retry")
        await self.services.index.schedule(
            kind=TimerKind.RETRY, member=session_id, at=self.services.clock.now()
        )
        await self.control.activate(session_id, reason=Reason.RETRY)
        return ACTIVATED

    async def force_resolve(
        self,
        principal: Principal,
        session_id: str,
        correlation_id: str,
        payload: JsonValue,
        reason: str,
        *,
        event_type: str | None = None,
    ) -> bool:
        snapshot = await self._session(principal, session_id)
        wait = snapshot.wait_for(correlation_id)
        if wait is None:
            raise InvalidRequest(f"session {session_id} has no open wait {correlation_id[:80]!r}")
        record = await self._record(
            principal,
            "force_resolve",
            reason,
            session_id=session_id,
            detail={"correlation_id": correlation_id, "payload": payload},
        )
        kind = event_type or (
            wait.expected_types[0] if wait.expected_types else "operator.resolved"
        )
        return await self.control.deliver(
            InboxEvent.answering(
                wait,
                kind=EventKind.CALLBACK,
                session_id=session_id,
                source=OPERATOR_SOURCE,
                event_id=record.action_id,
                type=kind,
                received_at=self.services.clock.now(),
                data=payload,
                verified_by="operator",
            )
        )

    async def resend_delivery(
        self, principal: Principal, tenant: str, delivery_id: str, reason: str
    ) -> Delivery:
        if principal.tenant not in (None, tenant):  # another tenant's: as if missing
            raise NotFound(f"no delivery {delivery_id[:80]!r}")
        delivery = await self.services.deliveries.get(tenant, delivery_id)
        ensure_resendable(delivery)  # refused before it is on the record
        await self._record(
            principal,
            "resend_delivery",
            reason,
            session_id=delivery.session_id,
            detail={"tenant": tenant, "delivery_id": delivery_id},
        )
        return await self.deliveries.resend(tenant, delivery_id, now=self.services.clock.now())

    async def resend_outbox(
        self, principal: Principal, session_id: str, entry_id: str, reason: str
    ) -> OutboxEntry:
        await self._session(principal, session_id)
        await self._record(
            principal, "resend_outbox", reason, session_id=session_id, detail={"entry": entry_id}
        )
        return await self.control.resend_outbox(session_id, entry_id)

    def can_reassign(self) -> bool:
        # A control plane without approvals (a stand-in) hides the button.
        return callable(getattr(self.control, "reassign_approval", None))

    async def reassign(
        self, principal: Principal, session_id: str, correlation_id: str, approver: str, reason: str
    ) -> object:
        if not self.can_reassign():
            raise InvalidRequest("approval reassignment is not available in this deployment")
        await self._record(
            principal,
            "reassign_approval",
            reason,
            session_id=session_id,
            detail={"correlation_id": correlation_id, "approver": approver},
        )
        # The form takes one name or a comma-separated list: the new approvers.
        approvers = [a.strip() for a in approver.split(",") if a.strip()]
        result: object = await self.control.reassign_approval(
            session_id, correlation_id, approvers=approvers, by=principal.who, why=reason
        )
        return result
