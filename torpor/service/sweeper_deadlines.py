"""The sweep's SLA deadlines (``torpor.service.sweeper``): the due ones, asked to time
out (on their own, far more often than a whole sweep, and as a step of it), the left-over
bindings of closed waits and those of set-aside sessions taken out of the index."""

from __future__ import annotations

import asyncio
from datetime import datetime

from torpor.errors import SessionNotFound, TorporError
from torpor.lifecycle import SessionState
from torpor.ports import Reason, WaitBinding
from torpor.service.sweeper_report import SweepReport
from torpor.service.sweeper_requests import BATCH, REQUESTS_AT_ONCE, SweeperRequests

DEADLINE_ROUNDS = 8  # batches of due deadlines one ``deadlines_once`` takes at most
# Two seconds' worth at a thousand deadlines a second: a loop every half second catches
# up after a hiccup instead of falling further behind.
DEADLINE_BATCH = 2000


class SweeperDeadlines(SweeperRequests):
    """Due deadlines: the sessions asked to time out, and the bindings no wait needs."""

    async def deadlines_once(self, now: datetime | None = None) -> int:
        """Only the due SLA deadlines: run far more often than a whole sweep, so a
        deadline is acted on within a fraction of a second (a sweep's other steps can
        wait for the next one). Returns how many sessions were asked to time out."""
        now = now or self.services.clock.now()
        seen: set[str] = set()
        asked = 0
        for _ in range(DEADLINE_ROUNDS):  # a full batch may hide more due behind it
            due = await self.services.index.due_deadlines(now=now, limit=DEADLINE_BATCH)
            fresh = [sid for sid in dict.fromkeys(b.session_id for b in due) if sid not in seen]
            # A set to look in: a list made this quadratic (2,000 due: about 22 ms a round,
            # four rounds a second on the 1,000-deadlines-a-second path).
            wanted = set(fresh)
            live = await self._live([b for b in due if b.session_id in wanted])
            await self._request_all([(sid, Reason.TIMEOUT) for sid in live])
            seen.update(fresh)
            asked += len(live)
            if len(due) < DEADLINE_BATCH or not fresh:
                break
        return asked

    async def _live(self, due: list[WaitBinding]) -> list[str]:
        """The sessions of these due bindings that are not set aside. A QUARANTINED session
        waits for its operator: asked to time out, it never would (four times a second, an
        activation each, until the grace ran out a week later). Its due bindings leave the
        index instead: left there, they came first in every look at the SLA set, and a full
        batch of them hid every later deadline for that week. Nothing needs them: the
        operator's retry times out a wait whose deadline passed from the snapshot alone,
        and an answer still finds the session by its wait's durable correlation record."""
        session_ids = list(dict.fromkeys(b.session_id for b in due))
        if not session_ids:
            return []
        states = await self.services.index.session_states(session_ids)
        aside = {sid for sid in session_ids if states.get(sid) is SessionState.QUARANTINED}
        await self._unbind([b for b in due if b.session_id in aside])
        return [sid for sid in session_ids if sid not in aside]

    async def _unbind(self, bindings: list[WaitBinding]) -> None:
        """Take due bindings out of the index by correlation id (a binding does not name
        its business key; the index frees a key whose holder is gone)."""
        for binding in bindings:
            await self.services.index.unbind(
                tenant=binding.tenant,
                correlation_id=binding.correlation_id,
                business_key=None,
                deadline=binding.deadline,
            )

    async def _deadlines(self, now: datetime, report: SweepReport) -> None:
        # A deadline stays in the SLA set until the timed-out session unbinds its wait: a
        # request that is not taken is simply made again by the next sweep.
        due = await self.services.index.due_deadlines(now=now, limit=BATCH)
        by_session: dict[str, list[WaitBinding]] = {}
        for binding in due:
            by_session.setdefault(binding.session_id, []).append(binding)
        gate = asyncio.Semaphore(REQUESTS_AT_ONCE)

        async def waiting(session_id: str) -> bool:
            async with gate:
                return await self._still_waiting(session_id, by_session[session_id])

        checks = await asyncio.gather(*(waiting(sid) for sid in by_session))
        still = [sid for sid, live in zip(by_session, checks, strict=True) if live]
        sessions = await self._live([b for sid in still for b in by_session[sid]])
        await self._request_all([(sid, Reason.TIMEOUT) for sid in sessions])
        report.timeouts += len(sessions)

    async def _still_waiting(self, session_id: str, due: list[WaitBinding]) -> bool:
        """Whether a due binding of the session still names one of its open waits.

        One that does not is left over: its wait was closed by a commit (answered, or a
        fan-in member closed with its group) and the process died before it unbound it.
        It is unbound here; otherwise it would wake the session for nothing at every sweep
        until its grace ran out. Safe because a wait is bound only after the commit that
        opened it, and a correlation id never names a wait again once it closed."""
        try:
            snapshot = await self.services.snapshots.load_waiting(session_id)
        except SessionNotFound:
            # Deleted by retention (it ended; its process died before the unbind): no
            # wait of it is open. Its activation finds nothing to run and unbinds nothing,
            # so, kept, the binding asked for one at every look until its grace ran out.
            await self._unbind(due)
            return False
        except TorporError:
            return True  # cannot tell: the activation decides, as it always did
        open_ids = {w.correlation_id for w in snapshot.waits}
        left_over = [b for b in due if b.correlation_id not in open_ids]
        await self._unbind(left_over)
        return len(left_over) < len(due)
