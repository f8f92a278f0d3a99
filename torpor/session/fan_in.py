"""Fan-in groups on wake: a member's gated answer is recorded, not yet delivered; once the
group's condition is decided, every member's result is delivered at once and the members
still open are closed.

All of it happens on the working copy, inside the activation's one commit: the answer,
the resolution, the closed waits and their compensations are durable together or not at
all. After the commit the caller unbinds the closed waits (a late answer to one then
finds no wait: observed as stale, never applied) and sends the compensations; each is an
outbox entry with its own idempotency key, so a crash before or after the send leads to
one undo on the far side, not two.
"""

from __future__ import annotations

from pydantic import JsonValue

from torpor import fanin, outbox
from torpor.fanin import Outcome
from torpor.models import ExpiryPolicy, FanIn, MemberStatus, Message, Wait
from torpor.plugins import LoadedAgent
from torpor.session.working import WorkingCopy, message_content, quotes_json_text
from torpor.tools import LongRunningTool

RESOLVED = "fan-in resolved"  # the reason a closed member's compensation carries
EXPIRED = "deadline passed"  # ... and an expired member's, as a lone wait's SLA


class FanInWake:
    """Member answers and member expiry of the session's fan-in groups."""

    def __init__(self, work: WorkingCopy, loaded: LoadedAgent | None) -> None:
        self.work = work
        self.loaded = loaded

    def group_of(self, wait: Wait) -> FanIn | None:
        if wait.group_id is None:
            return None
        return next((g for g in self.work.snap.fan_ins if g.group_id == wait.group_id), None)

    def proceeds_on_expiry(self, wait: Wait) -> bool:
        """Whether ``wait``'s deadline passing leaves its group waiting for the others
        (else the whole wait times out, as a single wait does)."""
        group = self.group_of(wait)
        return group is not None and group.spec.on_expiry is ExpiryPolicy.PROCEED_WITH_ARRIVED

    def answered(self, wait: Wait, content: JsonValue, *, failed: bool) -> list[Wait]:
        """Record ``content`` as the answer of member ``wait`` (it passed every gate);
        resolve the group if that decides it. Returns the waits this closed."""
        status = MemberStatus.FAILED if failed else MemberStatus.ANSWERED
        return self._close([wait], status, content)

    def expired(self, waits: list[Wait]) -> list[Wait]:
        """Members ``waits``' deadlines passed under ``proceed_with_arrived``: they count
        as missing, all of them before any group is decided (a member that missed the
        same deadline as another is expired too, not cancelled because its group resolved
        on the first one looked at); a group resolves if too few are left."""
        work = self.work
        closed: list[Wait] = []
        for group in list(work.snap.fan_ins):
            mine = list({w.wait_id: w for w in waits if w.group_id == group.group_id}.values())
            if not mine:
                continue
            # The session goes on without them, so their requests are undone where the
            # tool can, as a lone wait's are when its SLA passes: left open, an approval
            # could still be given (or a quote accepted) on the far side for a decision
            # that no longer waits for it.
            undo = [
                outbox.compensate_entry(work.snap, w, reason=EXPIRED, now=work.now)
                for w in mine
                if self._can_compensate(w)
            ]
            closed += self._close(mine, MemberStatus.EXPIRED, None)
            work.update(outbox=[*work.snap.outbox, *undo])
        return closed

    def reissued(self, wait: Wait, new: Wait) -> None:
        """Member ``wait``'s request was reissued in place: the member waits on ``new``."""
        group = self.group_of(wait)
        if group is not None:
            self._replace(fanin.reissued(group, wait.wait_id, new))

    def _close(self, waits: list[Wait], status: MemberStatus, answer: JsonValue) -> list[Wait]:
        """Close ``waits``, members of one group, with ``status``; then decide the group."""
        work = self.work
        group = self.group_of(waits[0])
        if group is None:  # its group is gone (resolved): nothing left to record
            return []
        for wait in waits:
            group = fanin.record(group, wait.wait_id, status, answer)
        closed = list(waits)
        ids = {w.wait_id for w in waits}
        work.update(waits=[w for w in work.snap.waits if w.wait_id not in ids])
        result = fanin.outcome(group)
        if result is Outcome.PENDING:
            self._replace(group)
            return closed
        return closed + self._resolve(group, result)

    def _resolve(self, group: FanIn, result: Outcome) -> list[Wait]:
        """Deliver the group's results, close its open members (compensating those whose
        tool can undo), and drop the group."""
        work = self.work
        open_ids = {m.wait_id for m in fanin.open_members(group)}
        closing = [w for w in work.snap.waits if w.wait_id in open_ids]
        group = fanin.close_rest(group)
        # The request of a member still PENDING in the outbox is never sent (its wait is
        # gone); one that may have gone out is undone by the tool's compensate hook.
        undo = [
            outbox.compensate_entry(work.snap, w, reason=RESOLVED, now=work.now)
            for w in closing
            if self._can_compensate(w)
        ]
        results = [
            Message(
                role="tool",
                tool_call_id=call_id,
                content=message_content(content, quote_json_text=quotes_json_text(self.loaded)),
            )
            for call_id, content in fanin.tool_results(group, result)
        ]
        work.update(
            waits=[w for w in work.snap.waits if w.wait_id not in open_ids],
            fan_ins=[g for g in work.snap.fan_ins if g.group_id != group.group_id],
            messages=[*work.snap.messages, *results],
            outbox=[*work.snap.outbox, *undo],
        )
        return closing

    def _replace(self, group: FanIn) -> None:
        self.work.update(
            fan_ins=[group if g.group_id == group.group_id else g for g in self.work.snap.fan_ins]
        )

    def _can_compensate(self, wait: Wait) -> bool:
        tool = self.loaded.tools.get(wait.tool_name) if self.loaded else None
        return isinstance(tool, LongRunningTool) and tool.can_compensate
