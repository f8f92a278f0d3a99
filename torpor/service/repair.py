"""Index repair: rebuild every index entry and timer the sessions need, from object storage.

Runs after the index was lost (its integrity marker is gone) and periodically. Object
storage is the source of truth, so repair walks the snapshots of the live sessions (and
of those that ended within the binding grace), found through their markers rather than
by listing every snapshot, and the delivery records:

* every session's state goes back into the registry;
* PENDING and RUNNING sessions are activated (nobody may hold them any more);
* a SUSPENDED session's waits are bound again (with their poll timers), and it is
  activated if its inbox or outbox holds work; a wait still bound is mended instead:
  what a partial loss took from it (its deadline entry and hour, its business-key
  pointer, its poll timer, its tool timers still to come) is put back, and what exists
  is left as it is (about three index round trips a wait);
* a terminal session that still owes outbox work (a compensation, a notification) is
  activated too: the runtime settles a finished session's outbox;
* every pending delivery gets its delivery timer back;
* every batch whose fan-out has not finished (its ``fanouts/`` marker) gets its fan-out
  timer back, and a batch's live sessions go back under its running caps.

Activation requests go through ``request``, which reports whether one was taken and
leaves a timer behind when not.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable
from datetime import datetime, timedelta
from typing import Protocol, TypeVar

from torpor.batches import Attempts
from torpor.deliveries import DeliveryStatus
from torpor.errors import (
    NotFound,
    PermanentError,
    PluginNotFound,
    SessionNotFound,
    SnapshotError,
)
from torpor.lifecycle import WAITING_STATES, SessionState
from torpor.models import SessionHeader, Wait, WaitingSession
from torpor.ports import Reason, TimerKind, WaitBinding
from torpor.ports.services import Services
from torpor.service.batches import register_slots
from torpor.service.deliveries import timer_member
from torpor.session.suspend import (
    binding_of,
    poll_member,
    schedule_tool_timers,
    unsent_starts,
)
from torpor.tools import LongRunningTool


class Request(Protocol):
    def __call__(self, wanted: list[tuple[str, Reason]], *, net: bool) -> Awaitable[object]: ...


Item = TypeVar("Item")
PAGE = 200
AT_ONCE = 32


async def _each(
    items: AsyncGenerator[Item, None],
    work: Callable[[Item], Awaitable[None]],
    limit: int,
) -> None:
    """``work`` on every item, up to ``limit`` at once, the items read as room frees up;
    the first error stops the rest (cancelled) and is raised as it is."""
    running: set[asyncio.Task[None]] = set()

    async def settle(until: int) -> None:
        nonlocal running
        while len(running) > until:
            done, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            # Every outcome read (two that failed together: the first raised, the other
            # not left for asyncio to report as never retrieved).
            failed = [exc for task in done if (exc := task.exception()) is not None]
            if failed:
                raise failed[0]

    try:
        async with contextlib.aclosing(items) as walk:
            async for item in walk:
                await settle(limit - 1)
                running.add(asyncio.ensure_future(work(item)))
        await settle(0)
    finally:
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)


class IndexRepair:
    def __init__(self, services: Services, request: Request) -> None:
        self.services = services
        self.request = request

    async def run(self, now: datetime, errors: list[str]) -> tuple[int, int, int]:
        """Repair everything; returns (sessions to activate, waits rebound, suspended).
        Sessions are repaired ``AT_ONCE`` at a time: each is a few round trips to the
        index and a few reads and writes of the store, each waiting on the network with
        a remote one. One after another, 100 sleeping sessions on the S3 test server
        20 ms away took 13.4 s; at once 4.1-4.9 s (2.5-2.8 with ``storage.blocking``'s
        wider pool). On the local folder at once changed nothing: its cost was the
        flushed rewrites of records the suspend had made durable and the decoding of
        whole snapshots, both gone since (6.3 ms a session at 20,000, then 0.32 ms)."""
        index = self.services.index
        # What only a lost index lacks (a periodic repair of an intact one leaves it be):
        # the batches' running-slot registrations, the delivery timers of tenants with no
        # session walked here.
        lost = not await index.is_intact()
        token = await index.begin_repair()
        wanted: list[tuple[str, Reason]] = []
        tenants: set[str] = set()
        batched: dict[str, list[str]] = {}  # batch id -> its live sessions
        rebound = suspended = 0

        async def one(header: SessionHeader | WaitingSession) -> None:
            nonlocal rebound, suspended
            tenants.add(header.tenant)
            if isinstance(header, WaitingSession) and header.batch_id is not None:
                batched.setdefault(header.batch_id, []).append(header.session_id)
            state = header.state
            if not isinstance(header, WaitingSession) and not state.terminal:
                # A live session listed by its header alone: its body does not decode
                # (``list_live_waiting``). Recorded as the activation that finds it so
                # records it (``_quarantine_poison``): the header's state, over a
                # quarantine nothing can write into the snapshot, had the registry say
                # SUSPENDED while every read showed QUARANTINED, and the operator's retry
                # refused.
                state = SessionState.QUARANTINED
            await index.record_session(
                tenant=header.tenant,
                session_id=header.session_id,
                state=state,
                generation=header.generation,
            )
            if header.state is SessionState.PENDING:
                wanted.append((header.session_id, Reason.SUBMIT))
                return
            if header.state is SessionState.RUNNING:
                wanted.append((header.session_id, Reason.RECOVER))
                return
            if header.state in WAITING_STATES:
                suspended += 1
            elif not self._may_owe_work(header, now):
                return
            if isinstance(header, WaitingSession):
                snapshot = header
            else:
                try:
                    snapshot = await self.services.snapshots.load_waiting(header.session_id)
                except PermanentError as exc:  # named, the others repaired; a transient
                    # error fails the repair, which is not marked done and runs again
                    errors.append(f"repair {header.session_id}: {exc}")
                    return
            if not snapshot.terminal:
                # Awaited first: ``rebound += await ...`` reads the total before the
                # wait, and the others running meanwhile add to it.
                waits = await self._rebind(snapshot, now)
                rebound += waits
            try:
                owes = await self._owes_work(snapshot)
            except PermanentError as exc:  # its sealed processed ids unreadable
                errors.append(f"repair {header.session_id}: {exc}")
                return
            if owes:
                wanted.append((snapshot.session_id, Reason.REPAIR))

        await _each(self._sessions(now), one, AT_ONCE)
        # Every configured tenant too: an operator's resend of a delivery whose session
        # ended past the binding grace is pending, with no walked session to name it.
        configured = set(self.services.settings.tenants) if lost else set()
        for tenant in sorted(tenants | configured):
            await self._delivery_timers(tenant, now, full=lost)
        await self._fan_out_timers(now)
        # Before any activation: a batch's PENDING sessions wait for a running slot.
        for batch_id in sorted(batched) if lost else ():
            await self._slots(batch_id, batched[batch_id], errors)
        # The sessions that were RUNNING first: their slots went with the index, and each
        # may still be running; were the PENDING ones to take the slots first, the batch
        # would run over its cap until those ended.
        # After a loss, nothing else in the index remembers these sessions (their leases,
        # timers and activation requests went with it): each request arms a wake-up first
        # (``Sweeper._request_all``). An intact index has their leases and timers, and a
        # wake-up armed under a live activation would only come back every grace, busy.
        await self.request([w for w in wanted if w[1] is Reason.RECOVER], net=lost)
        await self.request([w for w in wanted if w[1] is not Reason.RECOVER], net=lost)
        if not await index.mark_intact(token):
            # Lost again while this ran (the note went with it): what was rebuilt before
            # that is gone. Not marked, so the next sweep repairs again.
            errors.append("repair: the index was lost again while it ran; repairing again")
        return len(wanted), rebound, suspended

    async def _sessions(
        self, now: datetime
    ) -> AsyncGenerator[SessionHeader | WaitingSession, None]:
        """The live sessions (each read once, whole: nearly all are waiting), then the
        headers of those that ended within the binding grace: the cost follows them,
        never every session the store ever held. (Sessions that ended before are not put
        back in the registry; their snapshots still answer reads.)"""
        snapshots = self.services.snapshots
        async for session in snapshots.list_live_waiting(now=now):
            yield session
        horizon = timedelta(seconds=self.services.settings.storage.binding_grace_s)
        async for header in snapshots.list_ended(since=now - horizon, now=now):
            yield header

    def _may_owe_work(self, header: SessionHeader | WaitingSession, now: datetime) -> bool:
        """A waiting session always may; a finished one only if it ended recently:
        its outbox work (compensations, notifications) gives up within hours, so older
        ones are not worth reading every snapshot for."""
        if not header.state.terminal:
            return True
        horizon = timedelta(seconds=self.services.settings.storage.binding_grace_s)
        return header.updated_at >= now - horizon

    async def _owes_work(self, snapshot: WaitingSession) -> bool:
        if snapshot.pending_outbox():
            return True
        processed = snapshot.processed_events
        if snapshot.chunks.processed_events:  # a long session's older ids, sealed apart
            processed = await self.services.snapshots.processed_events(snapshot.session_id)
        pending = await self.services.inbox.pending(snapshot.session_id, processed=set(processed))
        return bool(pending)

    def _long_running(self, snapshot: WaitingSession, name: str) -> LongRunningTool | None:
        try:
            tool = self.services.plugins.agent(snapshot.agent.name).tools.get(name)
        except PluginNotFound:
            return None
        return tool if isinstance(tool, LongRunningTool) else None

    async def _rebind(self, snapshot: WaitingSession, now: datetime) -> int:
        index = self.services.index
        grace = timedelta(seconds=self.services.settings.storage.binding_grace_s)
        rebound = 0
        correlations = self.services.correlations
        unsent = unsent_starts(snapshot)
        bound: list[Wait] = []
        for wait in snapshot.waits:
            binding = binding_of(snapshot, wait)
            if await index.resolve(
                tenant=snapshot.tenant, now=now, correlation_id=wait.correlation_id
            ):
                # Bound still, yet a partial loss (a key evicted or deleted) may have
                # taken its other entries: what is missing of them is put back.
                await self._mend(snapshot, wait, binding, now)
                continue
            # A wait whose request went out has its durable record: the suspend writes
            # it before binding, and sends only after both. Written again anyway, two
            # flushed writes a session were three quarters of a repair's time on the
            # local folder (2,000 sleeping sessions: 8.1 s, 1.7 s without).
            recorded = wait.correlation_id not in unsent
            if not recorded:
                await correlations.record(binding, business_key=None)
            key, target = wait.business_key, None
            if key is not None:
                target = await correlations.business_key_target(
                    tenant=binding.tenant, business_key=key
                )
                if target not in (None, wait.correlation_id) and await self._open(target):
                    # Two waits bound the key at once (each checked it free before the
                    # other bound); the index gave it to the first, and the durable
                    # pointer says which. Repair keeps it there, whichever it walks first.
                    key = None
            # A deadline that passed more than the grace ago (the reconciler down for
            # longer): bound until the grace past now, not already expired, so the next
            # deadline sweep still times the wait out.
            kept = max(grace, now - wait.deadline + grace)
            took_key = await index.bind_wait(binding, business_key=key, grace=kept, now=now)
            # As the suspend did; the pointer follows the index (it may have named a wait
            # that is over), and one the suspend wrote for this wait stands.
            if key is not None and took_key and not (recorded and target == wait.correlation_id):
                await correlations.record_business_key(binding, business_key=key)
            bound.append(wait)
        for wait in await self._still_open(snapshot, bound):
            await self._timers(snapshot, wait, now)
            rebound += 1
        return rebound

    async def _still_open(self, snapshot: WaitingSession, bound: list[Wait]) -> list[Wait]:
        """The waits just bound that are still open. The snapshot was read a while ago (a
        page of the walk, then its turn): a commit meanwhile may have closed a wait and
        its activation unbound it before the bind above, which bound it again; a late or
        replayed answer to it was then accepted until its deadline, not told it closed.
        One header read confirms the session has not moved on; if it has, the waits it no
        longer holds are unbound here (a correlation id never names a wait again)."""
        if not bound:
            return []
        snapshots = self.services.snapshots
        try:
            header = await snapshots.header(snapshot.session_id)
            if header.generation == snapshot.generation:
                return bound
            current = await snapshots.load_waiting(snapshot.session_id)
        except SessionNotFound:
            current = None
        held = (
            set()
            if current is None or current.terminal
            else {w.correlation_id for w in current.waits}
        )
        for wait in bound:
            if wait.correlation_id not in held:
                await self.services.index.unbind(
                    tenant=snapshot.tenant,
                    correlation_id=wait.correlation_id,
                    business_key=wait.business_key,
                    deadline=wait.deadline,
                )
        return [wait for wait in bound if wait.correlation_id in held]

    async def _mend(
        self, snapshot: WaitingSession, wait: Wait, binding: WaitBinding, now: datetime
    ) -> None:
        """A bound wait's deadline entry, business-key pointer and timers, where missing.
        The pointer only where the durable one names this wait (otherwise the key was
        another wait's when it was bound, and stays so), read only when the index has
        none: one index read a wait in the usual case, not a store read. Timers due in
        the past are made sure of only when something was missing: most of them fired
        and were removed, and each put back would fire again (to no effect) every hour."""
        index, key = self.services.index, wait.business_key
        if key is not None and not await index.resolve(
            tenant=snapshot.tenant, now=now, business_key=key
        ):
            target = await self.services.correlations.business_key_target(
                tenant=snapshot.tenant, business_key=key
            )
            key = key if target == wait.correlation_id else None
        else:
            key = None  # someone holds it: a mend would leave it as it is
        grace = timedelta(seconds=self.services.settings.storage.binding_grace_s)
        mended = await index.mend_wait(binding, business_key=key, grace=grace, now=now)
        if mended is None:
            return  # unbound (answered) or bound anew meanwhile: its own timers are right
        await self._timers(snapshot, wait, now, past=mended > 0)

    async def _timers(
        self, snapshot: WaitingSession, wait: Wait, now: datetime, *, past: bool = True
    ) -> None:
        """The wait's tool timers and its poll timer, as the suspend scheduled them, where
        missing: one that exists stays as it is (a reminder leased, a poll backed off).
        Without ``past``, only tool timers still to come."""
        tool = self._long_running(snapshot, wait.tool_name)
        if tool is None:
            return
        # A timer that fired already delivers nothing twice.
        await schedule_tool_timers(
            self.services.index,
            snapshot.session_id,
            wait,
            tool,
            if_absent=True,
            after=None if past else now,
        )
        if tool.can_poll:
            await self.services.index.schedule(
                kind=TimerKind.POLL,
                member=poll_member(snapshot.session_id, wait.correlation_id),
                at=max(now, wait.overdue_after),
                if_absent=True,
            )

    async def _open(self, correlation_id: str) -> bool:
        """Whether the wait ``correlation_id`` is still open in its live session."""
        record = await self.services.correlations.lookup(correlation_id)
        if record is None:
            return False
        try:
            session = await self.services.snapshots.load_waiting(record.session_id)
        except (SessionNotFound, SnapshotError):
            return False
        return not session.terminal and session.wait_for(correlation_id) is not None

    async def _slots(self, batch_id: str, live: list[str], errors: list[str]) -> None:
        """The batch's live sessions back under its running caps (registered in the
        index by the fan-out): unregistered, every one would run at once."""
        if self.services.slots is None:
            return
        try:
            manifest = await self.services.batches.get(batch_id)
        except NotFound:
            errors.append(f"repair: batch {batch_id} of {len(live)} live sessions is gone")
            return
        generations = await self.services.batches.generations(batch_id)
        ranks = Attempts.of(manifest, generations).ranks()
        # Those still unfinished now: one that ended during the walk left its slot, and
        # a registration written for it would never be taken away.
        states = await self.services.index.session_states(live)
        members = {
            sid: ranks[sid]
            for sid in live
            if sid in ranks and sid in states and not states[sid].terminal
        }
        await register_slots(self.services, manifest, members)

    async def _fan_out_timers(self, now: datetime) -> None:
        """Every batch whose fan-out has not finished gets its timer back, due after the
        grace a running fan-out keeps it ahead by (one may be running: it goes on, and a
        second one would only find its sessions made); an earlier one is kept."""
        grace = timedelta(seconds=self.services.settings.reconciler.wake_grace_s)
        async for batch_id in self.services.batches.fanning_out():
            await self.services.index.schedule(
                kind=TimerKind.FANOUT, member=batch_id, at=now + grace, keep_earlier=True
            )

    async def _delivery_timers(self, tenant: str, now: datetime, *, full: bool) -> None:
        """Every pending delivery gets its timer back; an earlier one (or a leased one
        whose attempt is under way) is never pushed later. Through the pending markers
        (a page of what is pending), or, once the index was lost (``full``), through every
        delivery: one made before the markers existed has none."""
        cursor: str | None = None
        while True:
            page, cursor = await self.services.deliveries.list(
                tenant, status=DeliveryStatus.PENDING, cursor=cursor, limit=PAGE, full=full
            )
            for delivery in page:
                await self.services.index.schedule(
                    kind=TimerKind.DELIVER,
                    member=timer_member(tenant, delivery.delivery_id),
                    at=delivery.next_attempt_at or now,
                    keep_earlier=True,
                )
            if cursor is None:
                return
