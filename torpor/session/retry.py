"""Retries of the session core: one capped exponential backoff, one quota, then quarantine.

A retryable failure (the agent's backend, a call that timed out, a guard whose external
state cannot be read) checkpoints, schedules a RETRY timer ``retry_delay(used)`` ahead and
ends the activation; the timer brings the session back. The quota is the snapshot's
``retry``, so it survives crashes; a success resets it. Once it is spent the session is
QUARANTINED with the reason, and stays there until an operator retries or cancels it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import NoReturn

from torpor.backoff import Backoff
from torpor.lifecycle import WAITING_STATES, SessionState
from torpor.models import Quarantine
from torpor.ports import TimerKind
from torpor.ports.services import RuntimeConfig
from torpor.session.working import StopActivation, WorkingCopy


def retry_delay(config: RuntimeConfig, attempt: int) -> timedelta:
    """The session core's backoff before retry number ``attempt`` (0-based)."""
    policy = Backoff(
        base_s=config.retry_base.total_seconds(),
        cap_s=config.retry_cap.total_seconds(),
        jitter=0.2,
    )
    seconds = policy.delay_s(attempt)
    return timedelta(seconds=seconds)


class Retrier:
    """Retry later with backoff, or set the session aside when the quota is spent."""

    def __init__(self, work: WorkingCopy) -> None:
        self.work = work
        self.deps = work.deps

    @property
    def exhausted(self) -> bool:
        return self.work.snap.retry.exhausted

    async def later(
        self, code: str, message: str, *, beside: Callable[[], Awaitable[None]] | None = None
    ) -> NoReturn:
        """Checkpoint, schedule the retry and end this activation (or quarantine).
        ``beside``: what must follow the checkpoint's commit (``WorkingCopy.commit``), as
        unbinding the waits it closes: the activation ends here, before its own would."""
        work = self.work
        quota = work.snap.retry
        if quota.exhausted:
            await self.quarantine(
                code, f"gave up after {quota.used} retries: {message}", beside=beside
            )
        work.update(retry=quota.model_copy(update={"used": quota.used + 1}))
        await work.commit(beside=beside)
        await self.deps.index.schedule(
            kind=TimerKind.RETRY,
            member=work.snap.session_id,
            at=work.now + retry_delay(self.deps.config, quota.used),
        )
        # The retry timer is what brings the session back, after the backoff. A wake-up
        # left armed (by the answer that woke it, or by the sweep that asked for it)
        # would come every ``wake_grace_s`` instead and spend the quota in minutes, as
        # ``SessionRuntime._crashed`` says; an event that arrives later arms its own.
        await self.deps.index.unschedule(kind=TimerKind.WAKE, member=work.snap.session_id)
        # But a cancel that came while this activation ran found it busy, and armed the
        # wake-up just dropped (no re-check follows a stopped activation): it is not held
        # back behind the backoff. Looked for only now, so one written after the look
        # arms its own after the unschedule. Any other event waits for the retry (a
        # running session reads its inbox only when it next waits anyway).
        if await work.pending_cancel() is not None:
            grace = timedelta(seconds=self.deps.settings.reconciler.wake_grace_s)
            await self.deps.index.schedule(
                kind=TimerKind.WAKE,
                member=work.snap.session_id,
                at=work.now + grace,
                keep_earlier=True,
            )
        # The session keeps its state; this activation ends and the timer brings it back.
        raise StopActivation("retry scheduled")

    def succeeded(self) -> None:
        """A call that had been failing went through: the quota starts afresh (committed
        with the next checkpoint)."""
        quota = self.work.snap.retry
        if quota.used:
            self.work.update(retry=quota.model_copy(update={"used": 0}))

    async def quarantine(
        self, code: str, reason: str, *, beside: Callable[[], Awaitable[None]] | None = None
    ) -> NoReturn:
        """Set the session aside with ``reason``; no timer brings it back. ``beside``: as
        for ``later``."""
        work = self.work
        state = work.snap.state
        resume_to = SessionState.SUSPENDED if state in WAITING_STATES else SessionState.RUNNING
        if state is SessionState.PENDING:  # set aside before its first step: started afresh
            resume_to = SessionState.PENDING
        work.update(
            quarantine=Quarantine(
                reason=reason[:2000],
                code=code,
                at=work.now,
                attempts=work.snap.retry.used,
                resume_to=resume_to,
            )
        )
        work.move(SessionState.QUARANTINED, code)
        await work.commit(beside=beside)
        # It ends STOPPED, so the runtime's own clean-up of a set-aside session does not
        # run: a wake-up left armed (an answer's, or the sweep's net under the retry that
        # brought it here) would activate it once more.
        for kind in (TimerKind.WAKE, TimerKind.RETRY):
            await self.deps.index.unschedule(kind=kind, member=work.snap.session_id)
        raise StopActivation("quarantined")
