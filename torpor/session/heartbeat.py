"""Keeps a session lease alive while an activation runs.

The lease is renewed every ``period``; it is written with a TTL of three periods, so a
holder that stops (crash, kill -9, a partition) is considered gone after three missed
heartbeats and the reconciler re-activates the session from its last checkpoint. If a
renewal says the lease is no longer ours, or none has held for a whole TTL (the index cut
off), ``lost`` is set and the activation stops before its next tool call or commit.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import timedelta

from torpor.errors import IndexUnavailable, LeaseLost
from torpor.ports import Clock, Lease, LeaseIndex


class Heartbeat:
    def __init__(
        self,
        index: LeaseIndex,
        lease: Lease,
        *,
        clock: Clock,
        period: timedelta,
        ttl: timedelta,
        elapsed: Callable[[], float] = time.monotonic,
    ) -> None:
        self._index = index
        self.lease = lease
        self._clock = clock
        self._period = period.total_seconds()
        self._ttl = ttl
        self.lost = False
        # When the last renewal that held was sent (at first, about when the lease was
        # taken), on this process's own steady clock: the lease may be another's a TTL
        # after it. Not the clock's now, nor the lease's expiry: either may come from
        # another clock (the index's time, a test's), and a jump of one is not a lapse.
        self._elapsed = elapsed
        self._held_since = elapsed()
        self._unreachable = False  # the last renewal failed: the index did not answer
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    def start(self) -> Heartbeat:
        self._stopping = False
        self._task = asyncio.create_task(self._run(), name=f"heartbeat:{self.lease.name}")
        return self

    async def _run(self) -> None:
        # The flag ends the loop, not the cancel alone: a cancel can be swallowed on its
        # way (Python 3.11's asyncio.wait_for, which redis-py writes under, returns
        # normally when a cancel lands as the write completes, gh-86296; a client may also
        # report it as a lost connection), and the loop would renew a finished
        # activation's lease for ever while stop() waits for it.
        while not self.lost and not self._stopping:
            await asyncio.sleep(self._period)
            sent = self._elapsed()
            try:
                renewed = await self._index.renew_lease(
                    self.lease, ttl=self._ttl, now=self._clock.now()
                )
            except IndexUnavailable:
                # Try again next period; the TTL covers two more misses. Past it the lease
                # may be someone else's (the reconciler recovers the session), and this
                # holder must not go on calling tools beside the new one.
                self._unreachable = True
                self.lapsed()
                continue
            self._unreachable = False
            if renewed is None:
                self.lost = True
            else:
                self.lease = renewed
                self._held_since = sent

    def lapsed(self) -> bool:
        """Whether the lease is lost, or may be: the index is out of reach, and no renewal
        has held for a whole TTL. Sets ``lost`` once it is. A holder whose renewals were
        only late (its loop busy) is not judged here: its next renewal says whether the
        lease is still its own."""
        if (
            not self.lost
            and self._unreachable
            and self._elapsed() - self._held_since >= self._ttl.total_seconds()
        ):
            self.lost = True
        return self.lost

    async def confirm(self) -> bool:
        """Renew the lease now and say whether it is still ours: for a write that no
        fence guards (the registry's record of a poison quarantine), which a holder
        whose lease lapsed unseen must not make. ``lapsed`` alone does not tell: a
        process that stalled (its loop blocked, its read slow) has sent no renewal to
        find out with. True: the lease is ours for a whole TTL from now, so no other
        holder can have taken it when the next round trip lands, unless this process
        stalls for that long again. ``IndexUnavailable`` is raised as it is."""
        sent = self._elapsed()
        renewed = await self._index.renew_lease(self.lease, ttl=self._ttl, now=self._clock.now())
        if renewed is None:
            self.lost = True
            return False
        self.lease = renewed
        self._held_since = sent
        return True

    async def refence(self, floor: int) -> None:
        """Re-take the lease under a token above ``floor`` (the fence the snapshot
        recorded): the index lost its counter, so our token may be one a holder before us
        already committed with. Raise ``LeaseLost`` if the lease is no longer ours.

        The renewals pause meanwhile: a renewal in flight with the old token would find
        the lease re-issued and take it for lost."""
        await self.stop()
        sent = self._elapsed()
        raised = await self._index.raise_fence(
            self.lease, floor=floor, ttl=self._ttl, now=self._clock.now()
        )
        if raised is None:
            self.lost = True
            raise LeaseLost(f"lease {self.lease.name} was taken over before it was re-fenced")
        self.lease = raised
        self._held_since = sent
        self.start()

    async def stop(self) -> None:
        if self._task is not None:
            task, self._task = self._task, None
            self._stopping = True
            task.cancel()
            # wait() raises only for a cancel of our own caller (not ours to swallow: it
            # would turn a stopped activation into one that goes on), never for the
            # heartbeat's end; a task's cancelling() count can't tell the two apart.
            await asyncio.wait({task})
            if not task.cancelled() and (failed := task.exception()) is not None:
                raise failed
