"""One activation of one session: rehydrate, pass the gates, run, checkpoint, sleep.

``Activation`` ties the phases together over one working copy: ``Wake`` (resume through
the gates and the guard), ``AgentLoop`` (agent steps and sync tool calls) and ``Suspender``
(suspend or finish, bind, drain the outbox). Its runtime holds the session's lease while
it drives them.
"""

from __future__ import annotations

from torpor.events import EventKind
from torpor.lifecycle import WAITING_STATES, SessionState
from torpor.models import ErrorInfo, SessionSnapshot
from torpor.plugins import LoadedAgent
from torpor.ports import Reason
from torpor.ports.services import Services
from torpor.session.heartbeat import Heartbeat
from torpor.session.loop import AgentLoop
from torpor.session.suspend import Suspender
from torpor.session.wake import Wake
from torpor.session.working import Stats, WorkingCopy


class Activation:
    """The phases of one activation over one working copy."""

    def __init__(
        self,
        deps: Services,
        snapshot: SessionSnapshot,
        heartbeat: Heartbeat,
        loaded: LoadedAgent | None,
    ) -> None:
        self.loaded = loaded
        self.deps = deps
        self.work = WorkingCopy(deps, snapshot, heartbeat)
        self.suspender = Suspender(self.work, loaded)
        self.loop = AgentLoop(self.work, loaded, self.suspender)
        self.wake = Wake(self.work, loaded, self.suspender, on_running=self.loop.step_ahead)

    @property
    def snap(self) -> SessionSnapshot:
        return self.work.snap

    @property
    def stats(self) -> Stats:
        return self.work.stats

    async def drive(self, reason: Reason) -> None:
        """Take the session as far as it goes now: to a wait, an end, or a retry."""
        try:
            await self._drive(reason)
        finally:
            self.loop.drop_ahead()  # a step called ahead whose turn was not taken

    async def _drive(self, reason: Reason) -> None:
        work, loaded = self.work, self.loaded
        snap = work.snap
        if snap.terminal:
            await self.wake.settle_terminal()
            return
        if snap.state is SessionState.QUARANTINED and not await self.leave_quarantine():
            return
        if loaded is None:
            await self.suspender.finish(
                SessionState.FAILED,
                reason="agent not found",
                error=ErrorInfo(
                    code="plugin_not_found",
                    message=f"agent {snap.agent.name!r} is not configured on this cluster",
                ),
            )
            return
        if work.snap.state is SessionState.PENDING:
            if snap.batch_id is not None and await self.deps.batches.is_cancelled(snap.batch_id):
                # Made after its batch was cancelled, by a fan-out or retry that looked for
                # the marker just before it was written: that cancel found no session to
                # end, and its maker's second look comes after this one may have run its
                # document through. One read, at a batch session's first start only.
                await self.suspender.finish(SessionState.CANCELLED, reason="batch cancelled")
                return
            ctx = self.loop.agent_context()
            work.update(
                messages=loaded.agent.initial_messages(snap.input, ctx),
                variables=ctx.variables,
            )
            work.move(SessionState.RUNNING, reason.value)
            await work.commit()
        if work.snap.state in WAITING_STATES:
            if work.snap.pending_outbox():
                if await self.wake.cancel_first():
                    return  # nothing owed goes out after a cancel (undos of what may have)
                await self.suspender.complete_suspend()  # finish what a crashed suspend started
            await self.suspender.report_failed_starts()  # ...or a crashed failed dispatch
            await self.wake.resume()
        while work.state() is SessionState.RUNNING:
            await self.loop.run()
            state = work.state()
            if state is SessionState.RUNNING:
                return  # the step budget ran out; a retry timer brings the session back
            if state is SessionState.SUSPENDED:
                # Events may have arrived before the wait was even committed (a fast far
                # side, or a client delivery): apply them now rather than sleep on them.
                await self.wake.resume()

    async def leave_quarantine(self) -> bool:
        """Only an operator takes a session out of quarantine: a cancel ends it, a retry
        puts it back where it was set aside, with a fresh retry quota. True if it runs on."""
        work = self.work
        events = await self.deps.inbox.pending(
            work.snap.session_id, processed=set(work.snap.processed_events)
        )
        cancel = next((e for e in events if e.kind is EventKind.CANCEL), None)
        if cancel is not None:
            work.update(processed_events=[*work.snap.processed_events, cancel.key])
            await self.suspender.finish(
                SessionState.CANCELLED, reason="cancelled", compensate=list(work.snap.waits)
            )
            return False
        retry = next((e for e in events if e.kind is EventKind.RETRY), None)
        if retry is None:
            return False  # set aside: nothing brings it back but an operator
        aside = work.snap.quarantine
        work.update(
            processed_events=[*work.snap.processed_events, retry.key],
            quarantine=None,
            retry=work.snap.retry.model_copy(update={"used": 0}),
        )
        work.move(aside.resume_to if aside else SessionState.RUNNING, "operator retry")
        await work.commit()
        return True
