"""``ApprovalTool``: a human approval (a finance director in an OA system) as a built-in
long-running tool.

The request goes to the stage's approvers; every answer is reviewed by the tool inside
the session (``review``, pure) before anything is applied:

* an answer from someone without authority (``AuthorityPolicy``) is observed as
  ``unauthorized`` and raises a security alert; it is never applied and the wait stays
  open;
* an approval is recorded once per principal (a delegate counts for whom they act for; a
  second answer from the same principal is a ``duplicate``) until the stage's quorum
  (``all`` / ``any`` / ``n_of_m``) is reached or can no longer be; answers count in any
  order;
* a stage that approves hands the request to the next stage (amounts above its
  threshold need it) in a new epoch; the last one answers the tool call;
* reminders (``remind_before_s`` before the SLA deadline) send a signed notice to the OA
  (``notify_url``, through the deliveries) and leave a ``reminder`` event on the session;
* after ``escalate_after_s`` without a decision the request goes to the next person of
  ``escalation`` in a new epoch, and an operator may reassign it
  (``SessionService.reassign_approval``): either way the old request is withdrawn
  (``compensate`` with its own idempotency key) and an answer to it is stale.

The OA transport is two hooks a deployment overrides or configures: ``send`` (default:
POST the request as JSON to ``request_url``) and ``withdraw`` (default: POST to
``withdraw_url``, if set).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, JsonValue

from torpor.approval.policy import AuthorityPolicy, Outcome, Quorum
from torpor.errors import DispatchImpossible, ToolError
from torpor.events import EventKind, InboxEvent
from torpor.models import ObservationReason, Wait
from torpor.outbound import request_async
from torpor.tools import (
    DispatchRequest,
    LongRunningTool,
    Review,
    ReviewAction,
    ToolContext,
    ToolNotice,
    ToolSpec,
    ToolTimer,
    WaitPlan,
)

REASSIGN = "torpor.approval.reassign"  # the operator's instruction (event type)
DECISIONS = ("approved", "rejected")


class Stage(BaseModel):
    """One stage of approval: who is asked and how many must agree. ``above``: the stage
    applies only to amounts above it (None: always)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    approvers: list[str]
    quorum: Quorum = Field(default_factory=Quorum)
    above: float | None = None


def _text_list(value: JsonValue) -> list[str]:
    return [str(v) for v in value] if isinstance(value, list) else []


def _dict(value: JsonValue) -> dict[str, JsonValue]:
    return dict(value) if isinstance(value, dict) else {}


class ApprovalTool(LongRunningTool):
    """Configured from the agent's ``tool_options`` (every argument is keyword-only)."""

    can_compensate = True

    def __init__(
        self,
        *,
        name: str = "request_approval",
        description: str = "Ask people for an approval and wait for their decision.",
        stages: list[dict[str, Any]] | None = None,
        policy: dict[str, Any] | None = None,
        escalation: list[str] | None = None,
        escalate_after_s: float | None = None,
        remind_before_s: list[float] | None = None,
        notify_url: str | None = None,
        request_url: str | None = None,
        withdraw_url: str | None = None,
        sla_s: float = 24 * 3600,
        expected_duration_s: float = 3600,
        answered_by: list[str] | None = None,
        timeout_s: float | None = None,
    ) -> None:
        self.spec = ToolSpec(
            name=name,
            description=description,
            parameters={
                "type": "object",
                "properties": {
                    "subject": {"type": "string"},
                    "amount": {"type": "number", "minimum": 0},
                    "cost_centre": {"type": "string"},
                },
                "required": ["subject"],
            },
        )
        self.stages = [Stage.model_validate(s) for s in (stages or [])]
        if not self.stages or not all(s.approvers for s in self.stages):
            raise ValueError("an approval tool needs stages, each with approvers")
        self.policy = AuthorityPolicy.model_validate(policy or {})
        self.escalation = list(escalation or [])
        self.escalate_after_s = escalate_after_s
        self.remind_before_s = sorted(remind_before_s or [], reverse=True)
        self.notify_url = notify_url
        self.request_url = request_url
        self.withdraw_url = withdraw_url
        self.sla_s = sla_s
        self.expected_duration_s = expected_duration_s
        self.answered_by = tuple(answered_by or ())
        self.timeout_s = timeout_s

    # -- planning ------------------------------------------------------------------------

    def stages_for(self, amount: float) -> list[Stage]:
        return [s for s in self.stages if s.above is None or amount > s.above]

    @property
    def amount_matters(self) -> bool:
        """Whether a stage or an approver's authority depends on the amount."""
        policy = self.policy
        return (
            any(s.above is not None for s in self.stages)
            or any(t.up_to is not None for t in policy.tiers)
            or (bool(policy.cost_centre_owners) and policy.cost_centre_limit is not None)
        )

    def _amount(self, args: dict[str, Any]) -> float:
        raw = args.get("amount")
        if raw is None or raw == "":
            if self.amount_matters:
                # Read as 0 it skipped the stages a large amount needs and gave the lowest
                # tier authority: the rules failed open for a call that left it out.
                raise ToolError("amount is required: this approval's rules depend on it")
            return 0.0
        if isinstance(raw, bool):
            raise ToolError("amount must be a number")
        try:
            amount = float(raw)
        except (TypeError, ValueError):
            raise ToolError("amount must be a number") from None
        if not math.isfinite(amount):
            # NaN is above no stage's threshold and within no tier, and inf is stored as
            # null (read back as 0): either would skip the stages a large amount needs.
            raise ToolError("amount must be a finite number")
        if amount < 0:
            # Below every threshold and within every tier: a negative amount would be
            # decided by the lowest tier alone, whatever its size.
            raise ToolError("amount must not be negative")
        return amount

    async def begin(self, args: dict[str, Any], ctx: ToolContext) -> WaitPlan:
        subject = str(args.get("subject") or args.get("doc_id") or args.get("doc") or "")
        amount = self._amount(args)
        stages = self.stages_for(amount)
        request: dict[str, JsonValue] = {
            **{k: v for k, v in args.items() if isinstance(k, str)},
            "subject": subject,
            "amount": amount,
            "cost_centre": args.get("cost_centre"),
            **self._stage_fields(stages, 0, stages[0].approvers),
        }
        return WaitPlan(
            action_key=f"{self.spec.name}:{subject}",
            request=request,
            business_key=subject or None,
            sla_s=self.sla_s,
            expected_duration_s=self.expected_duration_s,
            progress={"votes": {}, "by": {}, "escalations": 0, "decided": []},
        )

    @staticmethod
    def _stage_fields(
        stages: list[Stage], index: int, approvers: list[str]
    ) -> dict[str, JsonValue]:
        stage = stages[index]
        return {
            "stage": index + 1,
            "stages": len(stages),
            "approvers": list(approvers),
            "mode": stage.quorum.mode.value,
            "required": stage.quorum.needed(approvers),
        }

    def timers(self, wait: Wait) -> list[ToolTimer]:
        out = [
            ToolTimer(f"remind-{i}", at)
            for i, before in enumerate(self.remind_before_s)
            if wait.opened_at < (at := wait.deadline - timedelta(seconds=before))
        ]
        target = self._next_escalation(wait)
        if self.escalate_after_s is not None and target is not None:
            at = wait.opened_at + timedelta(seconds=self.escalate_after_s)
            if at < wait.deadline:
                out.append(ToolTimer(f"escalate-{target + 1}", at))
        return out

    def _next_escalation(self, wait: Wait) -> int | None:
        """The index in ``escalation`` of whom the request goes to next: past those it
        went to already, and past anyone it is put to now. A second stage put to the CFO
        was escalated to the CFO (the chain starts again at each stage): the CFO's request
        withdrawn and sent again, and an answer to the first one was stale."""
        asked = set(_text_list(wait.request.get("approvers")))
        start = int(str(wait.progress.get("escalations", 0)))
        for i in range(start, len(self.escalation)):
            if self.escalation[i] not in asked:
                return i
        return None

    # -- review (pure) -------------------------------------------------------------------

    def review(self, wait: Wait, event: InboxEvent, *, now: datetime) -> Review | None:
        if event.kind is EventKind.TOOL_TIMER:
            return self._timer(wait, str(_dict(event.data).get("timer", "")))
        if event.kind is EventKind.OPERATOR:
            return self._reassign(wait, event)
        if event.kind not in (EventKind.CALLBACK, EventKind.POLL):
            return None  # a request that could not be sent: the error as it is
        return self._vote(wait, event, now)

    def _timer(self, wait: Wait, name: str) -> Review:
        if name.startswith("remind-"):
            notices = []
            if self.notify_url:
                notices.append(
                    ToolNotice(
                        key=f"{wait.correlation_id}:{name}",
                        url=self.notify_url,
                        event="approval.reminder",
                        data={
                            "correlation_id": wait.correlation_id,
                            "subject": wait.request.get("subject"),
                            "approvers": wait.request.get("approvers"),
                            "deadline": wait.deadline.isoformat(),
                            "reminder": name,
                        },
                    )
                )
            return Review(ReviewAction.OBSERVE, reason=ObservationReason.REMINDER, notices=notices)
        target = self._next_escalation(wait)
        if target is not None and name == f"escalate-{target + 1}":
            progress = {**wait.progress, "escalations": target + 1}
            return self._reissue(
                wait, [self.escalation[target]], progress, ObservationReason.ESCALATED
            )
        return Review(ReviewAction.OBSERVE, reason=ObservationReason.STALE)

    def _reassign(self, wait: Wait, event: InboxEvent) -> Review:
        approvers = _text_list(_dict(event.data).get("approvers"))
        if event.type != REASSIGN or not approvers:
            return Review(ReviewAction.OBSERVE, reason=ObservationReason.UNEXPECTED)
        short = self._short_of_authority(wait, approvers)
        if short:
            # Put to people who cannot reach the stage's quorum with authority for the
            # amount, the request could only be rejected or run out its SLA: the old
            # request stays open, and the attempt is on the record as an alert.
            why = f"approval {wait.correlation_id}: reassignment refused, {short}"
            return Review(ReviewAction.OBSERVE, reason=ObservationReason.UNAUTHORIZED, alert=[why])
        return self._reissue(wait, approvers, dict(wait.progress), ObservationReason.REASSIGNED)

    def reassignment_refused(self, wait: Wait, approvers: list[str]) -> str | None:
        short = self._short_of_authority(wait, list(dict.fromkeys(approvers)))
        return f"reassignment refused, {short}" if short else None

    def _short_of_authority(self, wait: Wait, approvers: list[str]) -> str:
        """Why ``approvers`` could not approve the wait's stage (enough of them with
        authority for its amount and cost centre to reach its quorum), or ""."""
        amount = float(str(wait.request.get("amount") or 0))
        cost_centre = wait.request.get("cost_centre")
        centre = str(cost_centre) if cost_centre is not None else None
        stages = self.stages_for(amount)
        index = int(str(wait.request.get("stage", 1))) - 1
        quorum = stages[min(max(index, 0), len(stages) - 1)].quorum
        people = list(dict.fromkeys(approvers))
        able = [p for p in people if self.policy.may_approve(p, amount=amount, cost_centre=centre)]
        need = quorum.needed(people)
        if len(able) >= need:
            return ""
        return f"{need} of {', '.join(people)} must approve {amount:g} ({centre}), {len(able)} may"

    def _reissue(
        self,
        wait: Wait,
        approvers: list[str],
        progress: dict[str, JsonValue],
        reason: ObservationReason,
    ) -> Review:
        """The same stage, put to other people: their votes start afresh."""
        stages = self.stages_for(float(str(wait.request.get("amount") or 0)))
        index = int(str(wait.request.get("stage", 1))) - 1
        request = {**wait.request, **self._stage_fields(stages, index, approvers)}
        progress = {**progress, "votes": {}, "by": {}}
        return Review(ReviewAction.REISSUE, reason=reason, progress=progress, request=request)

    def _vote(self, wait: Wait, event: InboxEvent, now: datetime) -> Review:
        data = _dict(event.data)
        decision = str(data.get("status") or data.get("decision") or "").lower()
        approver = str(data.get("approver") or "")
        if decision not in DECISIONS:
            return Review(ReviewAction.OBSERVE, reason=ObservationReason.UNEXPECTED)
        asked = _text_list(wait.request.get("approvers"))
        amount = float(str(wait.request.get("amount") or 0))
        cost_centre = wait.request.get("cost_centre")
        authority = self.policy.authority(
            approver or "(none)",
            asked=asked,
            amount=amount,
            cost_centre=str(cost_centre) if cost_centre is not None else None,
            now=now,
        )
        if not authority.ok or authority.principal is None:
            why = f"approval {wait.correlation_id}: {authority.why}"
            return Review(ReviewAction.OBSERVE, reason=ObservationReason.UNAUTHORIZED, alert=[why])
        principal = authority.principal
        votes = {str(k): str(v) for k, v in _dict(wait.progress.get("votes")).items()}
        if principal in votes:
            return Review(ReviewAction.OBSERVE, reason=ObservationReason.DUPLICATE)
        votes[principal] = decision
        by = {**_dict(wait.progress.get("by")), principal: approver}
        progress: dict[str, JsonValue] = {**wait.progress, "votes": dict(votes), "by": by}
        stages = self.stages_for(amount)
        index = int(str(wait.request.get("stage", 1))) - 1
        outcome = stages[index].quorum.tally(asked, votes)
        if outcome is Outcome.OPEN:
            return Review(ReviewAction.OBSERVE, reason=ObservationReason.COUNTED, progress=progress)
        decided = [
            *(wait.progress.get("decided") or []),  # type: ignore[misc]
            {"stage": index + 1, "outcome": outcome.value, "votes": dict(votes), "by": by},
        ]
        if outcome is Outcome.APPROVED and index + 1 < len(stages):
            request = {
                **wait.request,
                **self._stage_fields(stages, index + 1, stages[index + 1].approvers),
            }
            progress = {**progress, "votes": {}, "by": {}, "decided": decided, "escalations": 0}
            return Review(
                ReviewAction.REISSUE,
                reason=ObservationReason.COUNTED,
                progress=progress,
                request=request,
                withdraw=False,  # decided, not abandoned: nothing to withdraw
            )
        answer: dict[str, JsonValue] = {
            "status": outcome.value,
            "approver": approver,
            "stages": decided,
        }
        return Review(ReviewAction.APPLY, answer=answer)

    # -- transport -----------------------------------------------------------------------

    async def dispatch(self, request: DispatchRequest) -> None:
        await self.send(request)

    async def compensate(
        self, wait: Wait, *, tenant: str, reason: str, idempotency_key: str
    ) -> None:
        await self.withdraw(wait, tenant=tenant, reason=reason, idempotency_key=idempotency_key)

    async def send(self, request: DispatchRequest) -> None:
        """Send the request to the OA. Default: POST it as JSON to ``request_url``."""
        if not self.request_url:
            raise DispatchImpossible(f"{self.spec.name}: no request_url and no send()")
        body = {
            "idempotency_key": request.idempotency_key,
            "correlation_id": request.callback.correlation_id,
            "callback_url": request.callback.callback_url,
            "deadline": request.deadline.isoformat(),
            "request": request.request,
        }
        await self._post(self.request_url, body, request.idempotency_key)

    async def withdraw(self, wait: Wait, *, tenant: str, reason: str, idempotency_key: str) -> None:
        """Withdraw a request from the OA. Default: POST to ``withdraw_url``, if set."""
        if self.withdraw_url:
            body = {
                "idempotency_key": idempotency_key,
                "reason": reason,
                "correlation_id": wait.correlation_id,
            }
            await self._post(self.withdraw_url, body, idempotency_key)

    async def _post(self, url: str, body: Mapping[str, object], key: str) -> None:
        response = await request_async(
            "POST",
            url,
            body=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Idempotency-Key": key},
            timeout_s=self.timeout_s or 30.0,
            max_body_bytes=0,
        )
        if response.status >= 300:
            raise ToolError(f"{url} answered {response.status}", retryable=response.status >= 500)
