"""One contract, every index: a real Redis, SQLite and the in-memory index.

The suite runs at a fixed date in the past: an adapter that read the wall clock instead of
the ``now`` it is given would see every entry here as long expired. Lease expiry is the
one exception for Redis, which decides it by the server's clock (``ServerClockLeases``);
the single-process indexes decide it by the caller's ``now`` (``CallerClockLeases``).
"""

from __future__ import annotations

import asyncio
import sqlite3
from contextlib import closing
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio.client import Pipeline

from storage.memory_index import MemoryIndex
from storage.redis_index import RedisIndex
from storage.redis_index import leases as leases_module
from storage.redis_index import registry as registry_module
from storage.sqlite_index import SqliteIndex
from tests.conftest import eventually
from tests.support.race import race
from torpor.errors import IndexUnavailable
from torpor.ids import new_correlation_id
from torpor.lifecycle import SessionState
from torpor.ports import ClaimIndex, Index, SessionEntry, TimerKind, WaitBinding

NOW = datetime(2020, 1, 1, tzinfo=UTC)
GRACE = timedelta(days=1)


def binding(
    tenant: str = "acme", *, deadline_in: float = 3600, session: str = "s_1"
) -> WaitBinding:
    return WaitBinding(
        tenant=tenant,
        correlation_id=new_correlation_id(),
        session_id=session,
        epoch=3,
        step_id="2",
        deadline=NOW + timedelta(seconds=deadline_in),
    )


async def claim(index: ClaimIndex, claims: list[tuple[str, str]]) -> bool:
    """Replay claims alone, as the webhook path takes them (with nothing to resolve)."""
    admission = await index.admit(
        claims=claims,
        ttl=timedelta(minutes=10),
        now=NOW,
        tenant="acme",
        correlation_id=None,
        business_key=None,
    )
    return admission.fresh


class IndexContract:
    @pytest.fixture
    def index(self) -> Index:
        raise NotImplementedError

    # -- waits --

    async def test_bind_then_resolve_by_correlation_and_business_key(self, index: Index) -> None:
        b = binding()
        await index.bind_wait(b, business_key="PO-1|with|pipes", grace=GRACE, now=NOW)
        assert await index.resolve(now=NOW, tenant="acme", correlation_id=b.correlation_id) == b
        assert await index.resolve(now=NOW, tenant="acme", business_key="PO-1|with|pipes") == b

    async def test_resolve_is_scoped_by_tenant(self, index: Index) -> None:
        b = binding()
        await index.bind_wait(b, business_key="PO-1", grace=GRACE, now=NOW)
        assert await index.resolve(now=NOW, tenant="other", correlation_id=b.correlation_id) is None
        assert await index.resolve(now=NOW, tenant="other", business_key="PO-1") is None

    async def test_unknown_ids_resolve_to_none(self, index: Index) -> None:
        assert (
            await index.resolve(now=NOW, tenant="acme", correlation_id=new_correlation_id()) is None
        )
        assert await index.resolve(now=NOW, tenant="acme", business_key="nope") is None

    async def test_unbind_removes_everything(self, index: Index) -> None:
        b = binding()
        await index.bind_wait(b, business_key="PO-1", grace=GRACE, now=NOW)
        await index.unbind(tenant="acme", correlation_id=b.correlation_id, business_key="PO-1")
        assert await index.resolve(now=NOW, tenant="acme", correlation_id=b.correlation_id) is None
        assert await index.resolve(now=NOW, tenant="acme", business_key="PO-1") is None
        assert await index.due_deadlines(now=NOW + timedelta(days=2), limit=10) == []

    async def test_unbind_knowing_the_deadline_removes_everything(self, index: Index) -> None:
        b = binding()
        await index.bind_wait(b, business_key="PO-1", grace=GRACE, now=NOW)
        await index.unbind(
            tenant="acme", correlation_id=b.correlation_id, business_key="PO-1", deadline=b.deadline
        )
        assert await index.resolve(now=NOW, tenant="acme", correlation_id=b.correlation_id) is None
        assert await index.resolve(now=NOW, tenant="acme", business_key="PO-1") is None
        assert await index.due_deadlines(now=NOW + timedelta(days=2), limit=10) == []

    @pytest.mark.parametrize("off", [timedelta(hours=3), -timedelta(days=1), timedelta(0)])
    async def test_unbind_with_a_deadline_of_another_hour_still_removes_the_stored_wait(
        self, index: Index, off: timedelta
    ) -> None:
        """The deadline is the caller's hint: a binding stored with another deadline (bound
        again since, say) goes all the same, its deadline entry included."""
        b = binding()
        await index.bind_wait(b, business_key="PO-1", grace=GRACE, now=NOW)
        later = b.model_copy(update={"deadline": b.deadline + timedelta(hours=5)})
        await index.bind_wait(later, business_key="PO-1", grace=GRACE, now=NOW)
        await index.unbind(
            tenant="acme",
            correlation_id=b.correlation_id,
            business_key="PO-1",
            deadline=b.deadline + off,
        )
        assert await index.resolve(now=NOW, tenant="acme", correlation_id=b.correlation_id) is None
        assert await index.resolve(now=NOW, tenant="acme", business_key="PO-1") is None
        assert await index.due_deadlines(now=NOW + timedelta(days=2), limit=10) == []

    async def test_unbind_knowing_the_deadline_keeps_a_newer_wait_and_another_tenants(
        self, index: Index
    ) -> None:
        old, new, theirs = binding(), binding(), binding("other", session="s_2")
        await index.bind_wait(old, business_key="PO-1", grace=GRACE, now=NOW)
        await index.bind_wait(new, business_key="PO-1", grace=GRACE, now=NOW)
        await index.bind_wait(theirs, business_key="PO-1", grace=GRACE, now=NOW)
        await index.unbind(
            tenant="acme",
            correlation_id=old.correlation_id,
            business_key="PO-1",
            deadline=old.deadline,
        )
        await index.unbind(
            tenant="mallory",
            correlation_id=theirs.correlation_id,
            business_key="PO-1",
            deadline=theirs.deadline,
        )
        assert await index.resolve(now=NOW, tenant="acme", business_key="PO-1") == new
        assert await index.resolve(now=NOW, tenant="other", business_key="PO-1") == theirs

    async def test_unbind_keeps_a_newer_wait_on_the_same_business_key(self, index: Index) -> None:
        old, new = binding(), binding()
        await index.bind_wait(old, business_key="PO-1", grace=GRACE, now=NOW)
        await index.bind_wait(new, business_key="PO-1", grace=GRACE, now=NOW)
        await index.unbind(tenant="acme", correlation_id=old.correlation_id, business_key="PO-1")
        assert await index.resolve(now=NOW, tenant="acme", business_key="PO-1") == new

    async def test_a_business_key_held_by_another_sessions_wait_is_refused(
        self, index: Index
    ) -> None:
        first, second = binding(session="s_1"), binding(session="s_2")
        assert await index.bind_wait(first, business_key="PO-1", grace=GRACE, now=NOW)
        assert not await index.bind_wait(second, business_key="PO-1", grace=GRACE, now=NOW)
        # The first binder keeps the key; the loser is still answerable by correlation id.
        assert await index.resolve(now=NOW, tenant="acme", business_key="PO-1") == first
        assert (
            await index.resolve(now=NOW, tenant="acme", correlation_id=second.correlation_id)
            == second
        )
        # Unbinding the loser leaves the holder's key alone.
        await index.unbind(tenant="acme", correlation_id=second.correlation_id, business_key="PO-1")
        assert await index.resolve(now=NOW, tenant="acme", business_key="PO-1") == first

    async def test_the_same_session_takes_its_business_key_over(self, index: Index) -> None:
        old, new = binding(session="s_1"), binding(session="s_1")
        assert await index.bind_wait(old, business_key="PO-1", grace=GRACE, now=NOW)
        assert await index.bind_wait(new, business_key="PO-1", grace=GRACE, now=NOW)
        assert await index.resolve(now=NOW, tenant="acme", business_key="PO-1") == new

    async def test_a_business_key_is_free_again_once_its_holder_expired_or_left(
        self, index: Index
    ) -> None:
        expired, left = binding(session="s_1", deadline_in=10), binding(session="s_2")
        await index.bind_wait(expired, business_key="PO-1", grace=GRACE, now=NOW)
        later = NOW + GRACE + timedelta(seconds=11)
        taker = binding(session="s_3", deadline_in=GRACE.total_seconds() + 3600)
        assert await index.bind_wait(taker, business_key="PO-1", grace=GRACE, now=later)
        assert await index.resolve(now=later, tenant="acme", business_key="PO-1") == taker
        await index.bind_wait(left, business_key="PO-2", grace=GRACE, now=NOW)
        await index.unbind(tenant="acme", correlation_id=left.correlation_id, business_key="PO-2")
        other = binding(session="s_4")
        assert await index.bind_wait(other, business_key="PO-2", grace=GRACE, now=NOW)

    @pytest.mark.parametrize("knows_deadline", [True, False])
    async def test_a_wait_unbound_without_its_business_key_frees_the_key(
        self, index: Index, knows_deadline: bool
    ) -> None:
        """The sweeper unbinds left-over and set-aside waits by correlation id alone (the
        binding does not name its key): the key is then no one's, for a bind and for a
        mend, as the holder's binding is gone. (Redis kept the pointer's own expiry, and
        refused every other session the key until the grace ran out.)"""
        gone = binding(session="s_1")
        assert await index.bind_wait(gone, business_key="PO-1", grace=GRACE, now=NOW)
        await index.unbind(
            tenant="acme",
            correlation_id=gone.correlation_id,
            business_key=None,
            deadline=gone.deadline if knows_deadline else None,
        )
        taker = binding(session="s_2")
        assert await index.bind_wait(taker, business_key="PO-1", grace=GRACE, now=NOW)
        assert await index.resolve(now=NOW, tenant="acme", business_key="PO-1") == taker
        # And a mend takes such a key back for its wait, as a bind would.
        await index.bind_wait(gone, business_key="PO-2", grace=GRACE, now=NOW)
        await index.unbind(tenant="acme", correlation_id=gone.correlation_id, business_key=None)
        mended = binding(session="s_3")
        await index.bind_wait(mended, business_key=None, grace=GRACE, now=NOW)
        assert await index.mend_wait(mended, business_key="PO-2", grace=GRACE, now=NOW) == 1
        assert await index.resolve(now=NOW, tenant="acme", business_key="PO-2") == mended
        # A holder still bound keeps its key, looked at twice or not.
        assert not await index.bind_wait(
            binding(session="s_4"), business_key="PO-1", grace=GRACE, now=NOW
        )
        assert await index.resolve(now=NOW, tenant="acme", business_key="PO-1") == taker

    async def test_a_business_key_is_per_tenant(self, index: Index) -> None:
        assert await index.bind_wait(binding(), business_key="PO-1", grace=GRACE, now=NOW)
        theirs = binding("other", session="s_2")
        assert await index.bind_wait(theirs, business_key="PO-1", grace=GRACE, now=NOW)

    async def test_unbind_by_other_tenant_changes_nothing(self, index: Index) -> None:
        b = binding()
        await index.bind_wait(b, business_key="PO-1", grace=GRACE, now=NOW)
        await index.unbind(tenant="mallory", correlation_id=b.correlation_id, business_key="PO-1")
        assert await index.resolve(now=NOW, tenant="acme", correlation_id=b.correlation_id) == b

    async def test_due_deadlines_in_order_and_limited(self, index: Index) -> None:
        early = binding(deadline_in=10)
        late = binding(deadline_in=20)
        future = binding(deadline_in=10_000)
        for b in (late, future, early):
            await index.bind_wait(b, business_key=None, grace=GRACE, now=NOW)
        assert await index.due_deadlines(now=NOW, limit=10) == []
        due = await index.due_deadlines(now=NOW + timedelta(seconds=30), limit=10)
        assert [d.correlation_id for d in due] == [early.correlation_id, late.correlation_id]
        assert len(await index.due_deadlines(now=NOW + timedelta(seconds=30), limit=1)) == 1

    async def test_entries_expire_at_deadline_plus_grace(self, index: Index) -> None:
        gone = binding(deadline_in=-7200)  # deadline two hours ago, grace one hour
        live = binding(deadline_in=-60)
        await index.bind_wait(gone, business_key="PO-old", grace=timedelta(hours=1), now=NOW)
        await index.bind_wait(live, business_key=None, grace=timedelta(hours=1), now=NOW)
        assert (
            await index.resolve(now=NOW, tenant="acme", correlation_id=gone.correlation_id) is None
        )
        assert await index.resolve(now=NOW, tenant="acme", business_key="PO-old") is None
        due = await index.due_deadlines(now=NOW, limit=10)
        assert [d.correlation_id for d in due] == [live.correlation_id]

    async def test_due_deadlines_span_hours_in_deadline_order(self, index: Index) -> None:
        waits = [binding(deadline_in=-s) for s in (30, 4000, 9000, 20)]
        for b in waits:
            await index.bind_wait(b, business_key=None, grace=GRACE, now=NOW)
        due = await index.due_deadlines(now=NOW, limit=10)
        assert [d.deadline for d in due] == sorted(b.deadline for b in waits)
        for b in waits:
            await index.unbind(tenant="acme", correlation_id=b.correlation_id, business_key=None)
        assert await index.due_deadlines(now=NOW, limit=10) == []
        late = binding(deadline_in=-5000)  # a bind into an hour already swept still counts
        await index.bind_wait(late, business_key=None, grace=GRACE, now=NOW)
        assert [d.correlation_id for d in await index.due_deadlines(now=NOW, limit=10)] == [
            late.correlation_id
        ]

    async def test_a_backlog_of_due_deadlines_comes_earliest_first_a_limit_at_a_time(
        self, index: Index
    ) -> None:
        """An hour of deadlines left due (the deadline loop was down): each pass returns
        the earliest ``limit`` of them, in order, wherever the index keeps them."""
        waits = [binding(deadline_in=-3000 + n / 1000) for n in range(600)]
        for b in waits:
            await index.bind_wait(b, business_key=None, grace=GRACE, now=NOW)
        due = await index.due_deadlines(now=NOW, limit=50)
        assert due == waits[:50]
        for b in due:
            await index.unbind(tenant="acme", correlation_id=b.correlation_id, business_key=None)
        assert await index.due_deadlines(now=NOW, limit=50) == waits[50:100]

    async def test_a_wait_bound_again_with_another_deadline_is_due_at_that_one_only(
        self, index: Index
    ) -> None:
        """Bound again under the same correlation id, the wait's deadline is the new one:
        neither the old (earlier) one nor a duplicate entry makes it due."""
        moved = binding(deadline_in=60)
        await index.bind_wait(moved, business_key=None, grace=GRACE, now=NOW)
        later = moved.model_copy(update={"deadline": moved.deadline + timedelta(hours=5)})
        await index.bind_wait(later, business_key=None, grace=GRACE, now=NOW)
        assert await index.due_deadlines(now=NOW + timedelta(minutes=5), limit=10) == []
        sooner = binding(deadline_in=5 * 3600)
        await index.bind_wait(sooner, business_key=None, grace=GRACE, now=NOW)
        early = sooner.model_copy(update={"deadline": NOW + timedelta(seconds=60)})
        await index.bind_wait(early, business_key=None, grace=GRACE, now=NOW)
        assert await index.due_deadlines(now=NOW + timedelta(minutes=5), limit=10) == [early]
        at = NOW + timedelta(hours=6)
        assert await index.due_deadlines(now=at, limit=10) == [early, later]

    async def test_several_waits_of_one_session_route_and_unbind_independently(
        self, index: Index
    ) -> None:
        """A fan-in group: one binding per member, all to the same session, each with its
        own deadline and business key; closing one member leaves the others routable."""
        members = [binding(deadline_in=d, session="s_fan") for d in (60, 120, 180)]
        for i, b in enumerate(members):
            await index.bind_wait(b, business_key=f"RFQ-1:{i}", grace=GRACE, now=NOW)
        for i, b in enumerate(members):
            assert await index.resolve(now=NOW, tenant="acme", correlation_id=b.correlation_id) == b
            assert await index.resolve(now=NOW, tenant="acme", business_key=f"RFQ-1:{i}") == b
        due = await index.due_deadlines(now=NOW + timedelta(seconds=150), limit=10)
        assert [d.correlation_id for d in due] == [b.correlation_id for b in members[:2]]
        first = members[0]
        await index.unbind(
            tenant="acme", correlation_id=first.correlation_id, business_key="RFQ-1:0"
        )
        assert (
            await index.resolve(now=NOW, tenant="acme", correlation_id=first.correlation_id) is None
        )
        for i, b in enumerate(members[1:], start=1):
            assert await index.resolve(now=NOW, tenant="acme", correlation_id=b.correlation_id) == b
            assert await index.resolve(now=NOW, tenant="acme", business_key=f"RFQ-1:{i}") == b
        due = await index.due_deadlines(now=NOW + timedelta(seconds=150), limit=10)
        assert [d.correlation_id for d in due] == [members[1].correlation_id]

    # -- timers --

    async def test_timers(self, index: Index) -> None:
        await index.schedule(kind=TimerKind.WAKE, member="s_a", at=NOW + timedelta(seconds=5))
        await index.schedule(kind=TimerKind.WAKE, member="s_b", at=NOW + timedelta(seconds=1))
        await index.schedule(kind=TimerKind.POLL, member="s_c", at=NOW)
        assert await index.due(kind=TimerKind.WAKE, now=NOW, limit=10) == []
        assert await index.due(kind=TimerKind.WAKE, now=NOW + timedelta(seconds=9), limit=10) == [
            "s_b",
            "s_a",
        ]
        # rescheduling moves, it does not duplicate
        await index.schedule(kind=TimerKind.WAKE, member="s_b", at=NOW + timedelta(seconds=60))
        assert await index.due(kind=TimerKind.WAKE, now=NOW + timedelta(seconds=9), limit=10) == [
            "s_a"
        ]
        await index.unschedule(kind=TimerKind.WAKE, member="s_a")
        assert await index.due(kind=TimerKind.WAKE, now=NOW + timedelta(seconds=9), limit=10) == []
        assert await index.due(kind=TimerKind.POLL, now=NOW, limit=10) == ["s_c"]

    async def test_a_leased_timer_is_taken_not_removed(self, index: Index) -> None:
        later = NOW + timedelta(seconds=30)
        await index.schedule(kind=TimerKind.RETRY, member="s_a", at=NOW)
        await index.schedule(kind=TimerKind.RETRY, member="s_b", at=NOW + timedelta(seconds=60))
        taken = await index.lease_due(kind=TimerKind.RETRY, now=NOW, limit=10, until=later)
        assert taken == ["s_a"]
        assert await index.due(kind=TimerKind.RETRY, now=NOW, limit=10) == [], "leased"
        # Its taker never confirmed: it comes due again when the lease runs out.
        assert await index.due(kind=TimerKind.RETRY, now=later, limit=10) == ["s_a"]

    async def test_timers_due_at_once_come_in_member_order(self, index: Index) -> None:
        for member in ("s_c", "s_a", "s_b"):
            await index.schedule(kind=TimerKind.RETRY, member=member, at=NOW)
        await index.schedule(kind=TimerKind.RETRY, member="s_0", at=NOW + timedelta(seconds=1))
        later = NOW + timedelta(seconds=1)
        assert await index.due(kind=TimerKind.RETRY, now=later, limit=10) == [
            "s_a",
            "s_b",
            "s_c",
            "s_0",
        ]
        until = NOW + timedelta(seconds=30)
        assert await index.lease_due(kind=TimerKind.RETRY, now=later, limit=2, until=until) == [
            "s_a",
            "s_b",
        ]

    async def test_a_leased_timer_is_removed_only_if_nobody_moved_it(self, index: Index) -> None:
        later = NOW + timedelta(seconds=30)
        for member in ("s_a", "s_b"):
            await index.schedule(kind=TimerKind.RETRY, member=member, at=NOW)
        await index.lease_due(kind=TimerKind.RETRY, now=NOW, limit=10, until=later)
        moved = NOW + timedelta(seconds=5)  # the work itself asked for another try
        await index.schedule(kind=TimerKind.RETRY, member="s_b", at=moved)
        for member in ("s_a", "s_b"):
            await index.unschedule(kind=TimerKind.RETRY, member=member, if_at=later)
        assert await index.due(kind=TimerKind.RETRY, now=later, limit=10) == ["s_b"]

    async def test_keep_earlier_never_delays_a_timer(self, index: Index) -> None:
        soon, late = NOW + timedelta(seconds=1), NOW + timedelta(seconds=60)
        await index.schedule(kind=TimerKind.RETRY, member="s_a", at=soon)
        await index.schedule(kind=TimerKind.RETRY, member="s_a", at=late, keep_earlier=True)
        await index.schedule(kind=TimerKind.RETRY, member="s_b", at=late, keep_earlier=True)
        assert await index.due(kind=TimerKind.RETRY, now=soon, limit=10) == ["s_a"]
        assert await index.due(kind=TimerKind.RETRY, now=late, limit=10) == ["s_a", "s_b"]
        await index.schedule(kind=TimerKind.RETRY, member="s_b", at=soon, keep_earlier=True)
        assert await index.due(kind=TimerKind.RETRY, now=soon, limit=10) == ["s_a", "s_b"]

    async def test_if_absent_adds_a_missing_timer_and_moves_none(self, index: Index) -> None:
        soon, late = NOW + timedelta(seconds=1), NOW + timedelta(seconds=60)
        await index.schedule(kind=TimerKind.POLL, member="s_a", at=late)
        for member in ("s_a", "s_b"):
            await index.schedule(kind=TimerKind.POLL, member=member, at=soon, if_absent=True)
        assert await index.due(kind=TimerKind.POLL, now=soon, limit=10) == ["s_b"]
        await index.schedule(kind=TimerKind.POLL, member="s_b", at=late, if_absent=True)
        assert await index.due(kind=TimerKind.POLL, now=soon, limit=10) == ["s_b"], "not delayed"
        with pytest.raises(ValueError, match="exclude"):
            await index.schedule(
                kind=TimerKind.POLL, member="s_c", at=soon, if_absent=True, keep_earlier=True
            )

    # -- mending a partly lost wait --

    async def test_mend_changes_nothing_of_a_wait_not_bound_as_it_was(self, index: Index) -> None:
        b = binding()
        assert await index.mend_wait(b, business_key="PO-1", grace=GRACE, now=NOW) is None
        assert await index.resolve(now=NOW, tenant="acme", correlation_id=b.correlation_id) is None
        assert await index.resolve(now=NOW, tenant="acme", business_key="PO-1") is None
        await index.bind_wait(b, business_key=None, grace=GRACE, now=NOW)
        anew = b.model_copy(update={"epoch": b.epoch + 1})  # a re-plan bound it since
        assert await index.mend_wait(anew, business_key="PO-1", grace=GRACE, now=NOW) is None
        assert await index.resolve(now=NOW, tenant="acme", business_key="PO-1") is None
        expired = NOW + timedelta(hours=1) + GRACE
        assert await index.mend_wait(b, business_key="PO-1", grace=GRACE, now=expired) is None

    async def test_mend_of_a_whole_wait_puts_nothing_back(self, index: Index) -> None:
        b = binding()
        await index.bind_wait(b, business_key="PO-1", grace=GRACE, now=NOW)
        assert await index.mend_wait(b, business_key="PO-1", grace=GRACE, now=NOW) == 0
        other = binding(session="s_2")
        await index.bind_wait(other, business_key=None, grace=GRACE, now=NOW)
        # A key held by another wait stays with it.
        assert await index.mend_wait(other, business_key="PO-1", grace=GRACE, now=NOW) == 0
        assert await index.resolve(now=NOW, tenant="acme", business_key="PO-1") == b

    async def test_mend_takes_a_business_key_over_from_a_holder_that_expired(
        self, index: Index
    ) -> None:
        """As a bind would: an expired pointer is no one's."""
        b, gone = binding(), binding(session="s_2", deadline_in=60)
        await index.bind_wait(gone, business_key="PO-1", grace=timedelta(seconds=1), now=NOW)
        await index.bind_wait(b, business_key=None, grace=GRACE, now=NOW)
        later = NOW + timedelta(seconds=120)
        assert await index.mend_wait(b, business_key="PO-1", grace=GRACE, now=later) == 1
        assert await index.resolve(now=later, tenant="acme", business_key="PO-1") == b

    async def test_mend_puts_a_lost_business_key_pointer_back(self, index: Index) -> None:
        b = binding()
        await index.bind_wait(b, business_key=None, grace=GRACE, now=NOW)
        assert await index.mend_wait(b, business_key="PO-1", grace=GRACE, now=NOW) == 1
        assert await index.resolve(now=NOW, tenant="acme", business_key="PO-1") == b

    # -- nonces and idempotency --

    async def test_nonce_claims_once(self, index: Index) -> None:
        assert await claim(index, [("oa", "n-1")])
        assert not await claim(index, [("oa", "n-1")])
        assert await claim(index, [("erp", "n-1")])
        await index.release_nonce(scope="oa", nonce="n-1")
        assert await claim(index, [("oa", "n-1")])

    async def test_holds_nonce_reads_a_claim_without_taking_it(self, index: Index) -> None:
        assert not await index.holds_nonce(scope="oa", nonce="n-2", now=NOW)
        assert not await index.holds_nonce(scope="oa", nonce="n-2", now=NOW)  # still free
        assert await claim(index, [("oa", "n-2")])
        assert await index.holds_nonce(scope="oa", nonce="n-2", now=NOW)
        assert not await index.holds_nonce(scope="erp", nonce="n-2", now=NOW)
        await index.release_nonce(scope="oa", nonce="n-2")
        assert not await index.holds_nonce(scope="oa", nonce="n-2", now=NOW)

    async def test_admit_claims_and_resolves_together(self, index: Index) -> None:
        ttl = timedelta(minutes=10)
        b = binding()
        await index.bind_wait(b, business_key="PO-9", grace=GRACE, now=NOW)
        first = await index.admit(
            claims=[("h", "d1")],
            ttl=ttl,
            now=NOW,
            tenant="acme",
            correlation_id=b.correlation_id,
            business_key=None,
        )
        assert first.fresh and first.binding == b
        replay = await index.admit(
            claims=[("h", "d1")],
            ttl=ttl,
            now=NOW,
            tenant="acme",
            correlation_id=b.correlation_id,
            business_key=None,
        )
        assert not replay.fresh and replay.binding is None
        by_key = await index.admit(
            claims=[("h", "d2")],
            ttl=ttl,
            now=NOW,
            tenant="acme",
            correlation_id=None,
            business_key="PO-9",
        )
        assert by_key.binding == b
        other = await index.admit(
            claims=[("h", "d3")],
            ttl=ttl,
            now=NOW,
            tenant="beta",
            correlation_id=b.correlation_id,
            business_key=None,
        )
        assert other.fresh and other.binding is None
        unknown = await index.admit(
            claims=[("h", "d4")],
            ttl=ttl,
            now=NOW,
            tenant="acme",
            correlation_id=new_correlation_id(),
            business_key=None,
        )
        assert unknown.fresh and unknown.binding is None

    async def test_nonce_pairs_are_claimed_all_or_none(self, index: Index) -> None:
        assert await claim(index, [("a", "1"), ("b", "1")])
        assert not await claim(index, [("a", "2"), ("b", "1")])
        # the failed pair took nothing: its free half is still free
        assert await claim(index, [("a", "2")])

    async def test_idempotency_claim_finish_release(self, index: Index) -> None:
        ttl = timedelta(hours=24)
        first = await index.claim_idempotency(
            tenant="acme", key="k1", fingerprint="fp1", session_id="s_1", ttl=ttl, now=NOW
        )
        assert first.created and first.status == "in_progress"
        again = await index.claim_idempotency(
            tenant="acme", key="k1", fingerprint="fp2", session_id="s_2", ttl=ttl, now=NOW
        )
        assert not again.created
        assert (again.session_id, again.fingerprint) == ("s_1", "fp1")
        other_tenant = await index.claim_idempotency(
            tenant="beta", key="k1", fingerprint="fp1", session_id="s_3", ttl=ttl, now=NOW
        )
        assert other_tenant.created
        await index.finish_idempotency(tenant="acme", key="k1", ttl=ttl, now=NOW)
        done = await index.claim_idempotency(
            tenant="acme", key="k1", fingerprint="fp1", session_id="s_9", ttl=ttl, now=NOW
        )
        assert done.status == "done" and done.session_id == "s_1"
        await index.release_idempotency(tenant="beta", key="k1")
        assert (
            await index.claim_idempotency(
                tenant="beta", key="k1", fingerprint="x", session_id="s_4", ttl=ttl, now=NOW
            )
        ).created

    # -- leases --

    async def test_raise_fence_reissues_the_lease_above_the_floor(self, index: Index) -> None:
        ttl = timedelta(seconds=45)
        a = await index.acquire_lease(name="session:f", owner="a", ttl=ttl, now=NOW)
        assert a is not None
        raised = await index.raise_fence(a, floor=a.token + 10, ttl=ttl, now=NOW)
        assert raised is not None and (raised.owner, raised.token) == ("a", a.token + 11)
        # the old token is no longer the lease: it can neither renew nor release it
        assert await index.renew_lease(a, ttl=ttl, now=NOW) is None
        assert not await index.release_lease(a)
        # a floor below the counter still moves the token up
        again = await index.raise_fence(raised, floor=0, ttl=ttl, now=NOW)
        assert again is not None and again.token == raised.token + 1
        assert await index.release_lease(again)
        # a lease no longer ours is not raised, and the counter kept every raise
        assert await index.raise_fence(again, floor=100, ttl=ttl, now=NOW) is None
        b = await index.acquire_lease(name="session:f", owner="b", ttl=ttl, now=NOW)
        assert b is not None and b.token == again.token + 1

    async def test_a_dropped_lease_name_keeps_no_counter(self, index: Index) -> None:
        """A purged session's lease: its fencing counter (kept past every release so that
        tokens only grow) goes with it, and the name counts from the start again."""
        ttl = timedelta(seconds=45)
        for _ in range(3):
            held = await index.acquire_lease(name="session:gone", owner="a", ttl=ttl, now=NOW)
            assert held is not None and await index.release_lease(held)
        assert held.token == 3
        await index.drop_lease(name="session:gone")
        again = await index.acquire_lease(name="session:gone", owner="b", ttl=ttl, now=NOW)
        assert again is not None and again.token == 1

    # -- session registry, integrity --

    async def test_session_generation_is_the_last_recorded(self, index: Index) -> None:
        assert await index.session_generation("s_none") is None
        for generation in (3, 7, 5):  # an older generation never overwrites a newer one
            await index.record_session(
                tenant="acme", session_id="s_gen", state=SessionState.RUNNING, generation=generation
            )
        assert await index.session_generation("s_gen") == 7

    async def test_session_registry_lists_newest_first_by_state(self, index: Index) -> None:
        ids = [f"s_{i:04d}" for i in range(7)]
        for sid in ids:
            await index.record_session(
                tenant="acme", session_id=sid, state=SessionState.PENDING, generation=0
            )
        await index.record_session(
            tenant="beta", session_id="s_9999", state=SessionState.PENDING, generation=0
        )
        for sid in ids[:3]:
            await index.record_session(
                tenant="acme", session_id=sid, state=SessionState.SUSPENDED, generation=5
            )
        page1 = await index.list_sessions(tenant="acme", state=None, cursor=None, limit=4)
        assert page1.session_ids == list(reversed(ids))[:4]
        page2 = await index.list_sessions(
            tenant="acme", state=None, cursor=page1.next_cursor, limit=4
        )
        assert page2.session_ids == list(reversed(ids))[4:] and page2.next_cursor is None
        suspended = await index.list_sessions(
            tenant="acme", state=SessionState.SUSPENDED, cursor=None, limit=10
        )
        assert suspended.session_ids == list(reversed(ids[:3]))
        pending = await index.list_sessions(
            tenant="acme", state=SessionState.PENDING, cursor=None, limit=10
        )
        assert pending.session_ids == list(reversed(ids[3:]))
        states = await index.session_states([*ids[:4], "s_missing"])
        assert states == {
            ids[0]: SessionState.SUSPENDED,
            ids[1]: SessionState.SUSPENDED,
            ids[2]: SessionState.SUSPENDED,
            ids[3]: SessionState.PENDING,
        }

    async def test_a_forgotten_session_leaves_every_listing(self, index: Index) -> None:
        for sid in ("s_keep", "s_gone"):
            await index.record_session(
                tenant="acme", session_id=sid, state=SessionState.COMPLETED, generation=4
            )
        await index.forget_session(tenant="acme", session_id="s_gone")
        await index.forget_session(tenant="acme", session_id="s_gone")  # idempotent
        assert await index.session_states(["s_keep", "s_gone"]) == {
            "s_keep": SessionState.COMPLETED
        }
        assert await index.session_generation("s_gone") is None
        for state in (None, SessionState.COMPLETED):
            page = await index.list_sessions(tenant="acme", state=state, cursor=None, limit=5)
            assert page.session_ids == ["s_keep"]

    async def test_an_older_generation_never_overwrites_a_newer_state(self, index: Index) -> None:
        record = index.record_session
        await record(tenant="acme", session_id="s_r", state=SessionState.SUSPENDED, generation=6)
        # a repair that read generation 2 earlier arrives late
        await record(tenant="acme", session_id="s_r", state=SessionState.RUNNING, generation=2)
        assert await index.session_states(["s_r"]) == {"s_r": SessionState.SUSPENDED}
        page = await index.list_sessions(
            tenant="acme", state=SessionState.RUNNING, cursor=None, limit=5
        )
        assert page.session_ids == []
        await record(tenant="acme", session_id="s_r", state=SessionState.COMPLETED, generation=9)
        assert await index.session_states(["s_r"]) == {"s_r": SessionState.COMPLETED}

    async def test_a_record_says_whether_it_wrote(self, index: Index) -> None:
        """True when the registry took the record, False when it kept a newer generation:
        an activation whose commit's record was refused (the QUARANTINED of a snapshot an
        older backup replaced, at that snapshot's newer generation) lifts it instead. The
        same under tenant "" (a caller that looks the tenant up)."""
        s, record = SessionState, index.record_session
        assert await record(tenant="acme", session_id="s_w", state=s.PENDING, generation=1) is True
        assert await record(tenant="acme", session_id="s_w", state=s.RUNNING, generation=1) is True
        assert await index.record_poison(tenant="acme", session_id="s_w", generation=5) == 5
        for tenant in ("acme", ""):
            refused = await record(tenant=tenant, session_id="s_w", state=s.RUNNING, generation=4)
            assert refused is False, tenant
            assert await index.session_entry("s_w") == SessionEntry("acme", s.QUARANTINED, 5)
        assert await record(tenant="", session_id="s_w", state=s.SUSPENDED, generation=5) is True
        assert await record(tenant="acme", session_id="s_w", state=s.RUNNING, generation=6) is True
        assert await index.session_entry("s_w") == SessionEntry("acme", s.RUNNING, 6)

    async def test_a_quarantine_is_lifted_only_where_it_is_and_not_newer(
        self, index: Index
    ) -> None:
        lift, record = index.lift_quarantine, index.record_session
        s = SessionState

        async def listed(state: SessionState) -> list[str]:
            page = await index.list_sessions(tenant="acme", state=state, cursor=None, limit=5)
            return page.session_ids

        # Nothing recorded (a lost index: repair's to rebuild): nothing lifted.
        assert not await lift(tenant="acme", session_id="s_q", state=s.SUSPENDED, generation=4)
        assert await index.session_states(["s_q"]) == {}
        await record(tenant="acme", session_id="s_q", state=s.QUARANTINED, generation=4)
        # An older snapshot than the one found undecodable does not lift it.
        assert not await lift(tenant="acme", session_id="s_q", state=s.SUSPENDED, generation=3)
        assert await index.session_states(["s_q"]) == {"s_q": s.QUARANTINED}
        # The same generation, decoding again (restored): its state, in every listing.
        assert await lift(tenant="acme", session_id="s_q", state=s.SUSPENDED, generation=4)
        assert await index.session_states(["s_q"]) == {"s_q": s.SUSPENDED}
        assert await listed(s.SUSPENDED) == ["s_q"] and await listed(s.QUARANTINED) == []
        # Not QUARANTINED any more (a commit recorded since): left as it is.
        await record(tenant="acme", session_id="s_q", state=s.RUNNING, generation=6)
        assert not await lift(tenant="acme", session_id="s_q", state=s.SUSPENDED, generation=7)
        assert await index.session_states(["s_q"]) == {"s_q": s.RUNNING}
        assert await index.session_generation("s_q") == 6

    async def test_the_operators_retry_lifts_a_quarantine_of_any_generation_and_only_that(
        self, index: Index
    ) -> None:
        """A backup restored from before the snapshot found undecodable is older than the
        quarantine: the operator's retry lifts it all the same (``quarantined_at``, the
        generation it read), and later commits are recorded. Nothing but a QUARANTINED is
        replaced so."""
        s = SessionState

        async def lift(sid: str, state: SessionState, generation: int, read: int = 7) -> bool:
            return await index.lift_quarantine(
                tenant="acme",
                session_id=sid,
                state=state,
                generation=generation,
                quarantined_at=read,
            )

        async def listed(state: SessionState) -> list[str]:
            page = await index.list_sessions(tenant="acme", state=state, cursor=None, limit=5)
            return page.session_ids

        await index.record_session(
            tenant="acme", session_id="s_q", state=s.QUARANTINED, generation=7
        )
        assert await lift("s_q", s.SUSPENDED, 3)
        assert await index.session_states(["s_q"]) == {"s_q": s.SUSPENDED}
        assert await index.session_generation("s_q") == 3
        assert await listed(s.SUSPENDED) == ["s_q"] and await listed(s.QUARANTINED) == []
        await index.record_session(tenant="acme", session_id="s_q", state=s.RUNNING, generation=4)
        assert await index.session_states(["s_q"]) == {"s_q": s.RUNNING}
        # Any other state, even an older one, stands; nothing recorded, nothing lifted.
        assert not await lift("s_q", s.SUSPENDED, 2)
        assert await index.session_states(["s_q"]) == {"s_q": s.RUNNING}
        assert await index.session_generation("s_q") == 4
        assert not await lift("s_none", s.SUSPENDED, 2)
        assert await index.session_states(["s_none"]) == {}

    async def test_the_operators_retry_never_replaces_a_quarantine_newer_than_it_read(
        self, index: Index
    ) -> None:
        """The retry read a QUARANTINED at generation 7; before its lift, a newer snapshot
        was found undecodable and quarantined at 9. That quarantine is not the one the
        operator took back: the lift leaves it (and its generation) as it is."""
        s = SessionState
        record = index.record_session
        await record(tenant="acme", session_id="s_q", state=s.QUARANTINED, generation=7)
        await record(tenant="acme", session_id="s_q", state=s.QUARANTINED, generation=9)
        assert not await index.lift_quarantine(
            tenant="acme", session_id="s_q", state=s.SUSPENDED, generation=3, quarantined_at=7
        )
        assert await index.session_entry("s_q") == SessionEntry("acme", s.QUARANTINED, 9)
        page = await index.list_sessions(tenant="acme", state=s.QUARANTINED, cursor=None, limit=5)
        assert page.session_ids == ["s_q"]
        # Nor one older than it read (a record it could not have seen either).
        await record(tenant="acme", session_id="s_o", state=s.QUARANTINED, generation=4)
        assert not await index.lift_quarantine(
            tenant="acme", session_id="s_o", state=s.SUSPENDED, generation=2, quarantined_at=7
        )
        assert await index.session_entry("s_o") == SessionEntry("acme", s.QUARANTINED, 4)

    async def test_the_generation_of_a_quarantine_is_read_only_of_a_quarantine(
        self, index: Index
    ) -> None:
        """``quarantine_generation``: what refused an activation's lift, read beside it.
        Only a QUARANTINED has one; another state, or none, reads None."""
        s = SessionState
        assert await index.quarantine_generation("s_g") is None
        await index.record_session(tenant="acme", session_id="s_g", state=s.RUNNING, generation=3)
        assert await index.quarantine_generation("s_g") is None
        assert await index.record_poison(tenant="acme", session_id="s_g", generation=5) == 5
        assert await index.quarantine_generation("s_g") == 5
        assert await index.lift_quarantine(
            tenant="acme", session_id="s_g", state=s.SUSPENDED, generation=2, quarantined_at=5
        )
        assert await index.quarantine_generation("s_g") is None

    async def test_a_quarantine_under_no_tenant_is_listed_there_no_more_once_lifted(
        self, index: Index
    ) -> None:
        """A snapshot whose header does not decode either is quarantined under tenant ""
        (its tenant unknown, ``_quarantine_poison``). Restored, its state is recorded under
        its tenant, by the operator's retry or the lift of the activation that reads it: no
        listing of tenant "" shows it any more, a ghost no one could open."""
        s = SessionState

        async def listed(tenant: str, state: SessionState | None) -> list[str]:
            page = await index.list_sessions(tenant=tenant, state=state, cursor=None, limit=5)
            return page.session_ids

        for sid, put in (("s_l", index.lift_quarantine), ("s_r", index.record_session)):
            await index.record_session(tenant="", session_id=sid, state=s.QUARANTINED, generation=0)
            assert sid in await listed("", s.QUARANTINED)
            await put(tenant="acme", session_id=sid, state=s.SUSPENDED, generation=0)
        assert await listed("", None) == [] and await listed("", s.QUARANTINED) == []
        assert await listed("acme", s.SUSPENDED) == ["s_r", "s_l"]
        assert await listed("acme", None) == ["s_r", "s_l"]

    async def test_a_quarantine_is_lifted_only_under_the_tenant_its_entry_names(
        self, index: Index
    ) -> None:
        """A session's tenant never changes: a lift naming another tenant than the entry's
        (or "", which a lift does not take for "not known") leaves it quarantined where it
        is, on every adapter; the activation's lift and the operator's retry alike. Under
        its own tenant, it is lifted."""
        s = SessionState

        async def listed(tenant: str) -> list[str]:
            page = await index.list_sessions(tenant=tenant, state=None, cursor=None, limit=5)
            return page.session_ids

        for sid, read in (("s_a", None), ("s_o", 4)):
            await index.record_session(
                tenant="acme", session_id=sid, state=s.QUARANTINED, generation=4
            )
            for other in ("", "globex"):
                assert not await index.lift_quarantine(
                    tenant=other,
                    session_id=sid,
                    state=s.SUSPENDED,
                    generation=4,
                    quarantined_at=read,
                ), (sid, other)
                assert await index.session_entry(sid) == SessionEntry("acme", s.QUARANTINED, 4)
                assert await listed(other) == [] and sid in await listed("acme")
            assert await index.lift_quarantine(
                tenant="acme",
                session_id=sid,
                state=s.SUSPENDED,
                generation=4,
                quarantined_at=read,
            )
            assert await index.session_entry(sid) == SessionEntry("acme", s.SUSPENDED, 4)

    async def test_a_session_forgotten_under_its_tenant_leaves_no_quarantine_under_no_tenant(
        self, index: Index
    ) -> None:
        """Purged (retention) while still quarantined under tenant "" (its header never
        read, never restored): forgetting it under its own tenant leaves no ghost in tenant
        ""'s listings, which nothing else would ever remove."""
        s = SessionState
        await index.record_session(tenant="", session_id="s_g", state=s.QUARANTINED, generation=0)
        await index.forget_session(tenant="acme", session_id="s_g")
        for state in (None, s.QUARANTINED):
            page = await index.list_sessions(tenant="", state=state, cursor=None, limit=5)
            assert page.session_ids == []
        assert await index.session_states(["s_g"]) == {}

    async def test_a_poison_quarantine_is_recorded_over_any_state_never_back_in_generation(
        self, index: Index
    ) -> None:
        """A snapshot that does not decode is quarantined over whatever the registry holds
        (its newest snapshot is unreadable, so that state is true no more): a header that
        did not read (generation 0) or named an older generation than the one held was
        refused by "newest wins", and the index kept a live state for it. The generation
        held is kept, and later commits, the activation's lift and the operator's retry
        replace it as any quarantine."""
        s = SessionState

        async def listed(state: SessionState | None) -> list[str]:
            page = await index.list_sessions(tenant="acme", state=state, cursor=None, limit=5)
            return page.session_ids

        await index.record_session(tenant="acme", session_id="s_p", state=s.SUSPENDED, generation=5)
        assert await index.record_poison(tenant="acme", session_id="s_p", generation=0) == 5
        assert await index.session_entry("s_p") == SessionEntry("acme", s.QUARANTINED, 5)
        assert await listed(s.QUARANTINED) == ["s_p"] and await listed(s.SUSPENDED) == []
        assert await listed(None) == ["s_p"]
        # A header that reads and names a newer generation: that one.
        assert await index.record_poison(tenant="acme", session_id="s_p", generation=8) == 8
        assert await index.session_generation("s_p") == 8
        # Restored at that generation, the activation's lift (no newer) takes it back.
        assert await index.lift_quarantine(
            tenant="acme", session_id="s_p", state=s.SUSPENDED, generation=8
        )
        assert await index.session_entry("s_p") == SessionEntry("acme", s.SUSPENDED, 8)
        # Over a terminal state too, and a later commit replaces it.
        await index.record_session(tenant="acme", session_id="s_p", state=s.COMPLETED, generation=9)
        assert await index.record_poison(tenant="acme", session_id="s_p", generation=2) == 9
        assert await index.session_states(["s_p"]) == {"s_p": s.QUARANTINED}
        await index.record_session(tenant="acme", session_id="s_p", state=s.RUNNING, generation=10)
        assert await index.session_entry("s_p") == SessionEntry("acme", s.RUNNING, 10)
        # The operator's retry of a backup older than the quarantine.
        assert await index.record_poison(tenant="acme", session_id="s_p", generation=0) == 10
        assert await index.lift_quarantine(
            tenant="acme", session_id="s_p", state=s.SUSPENDED, generation=4, quarantined_at=10
        )
        assert await index.session_entry("s_p") == SessionEntry("acme", s.SUSPENDED, 4)
        assert await listed(s.SUSPENDED) == ["s_p"] and await listed(s.QUARANTINED) == []

    async def test_a_poison_quarantine_of_a_session_it_never_held_is_under_no_tenant(
        self, index: Index
    ) -> None:
        """A lost index, a header that did not read: its tenant is unknown, tenant "" it is
        (``SessionEntry``), and a record under its tenant moves it there."""
        s = SessionState
        assert await index.session_entry("s_n") is None
        assert await index.record_poison(tenant="", session_id="s_n", generation=0) == 0
        assert await index.session_entry("s_n") == SessionEntry("", s.QUARANTINED, 0)
        page = await index.list_sessions(tenant="", state=s.QUARANTINED, cursor=None, limit=5)
        assert page.session_ids == ["s_n"]
        await index.record_session(tenant="acme", session_id="s_n", state=s.SUSPENDED, generation=3)
        assert await index.session_entry("s_n") == SessionEntry("acme", s.SUSPENDED, 3)
        page = await index.list_sessions(tenant="", state=None, cursor=None, limit=5)
        assert page.session_ids == []

    async def test_a_record_under_no_tenant_keeps_the_tenant_held(self, index: Index) -> None:
        """A caller that does not know the tenant ("") records the state over an entry that
        has one: the entry keeps its tenant and the session stays listed under it, in the
        state recorded; nothing is listed under "". A session with no entry is recorded
        under "" (nothing held names another)."""
        s = SessionState
        await index.record_session(tenant="acme", session_id="s_k", state=s.SUSPENDED, generation=5)
        await index.record_session(tenant="", session_id="s_k", state=s.RUNNING, generation=6)
        assert await index.session_entry("s_k") == SessionEntry("acme", s.RUNNING, 6)
        await index.record_session(tenant="", session_id="s_n", state=s.SUSPENDED, generation=1)
        assert await index.session_entry("s_n") == SessionEntry("", s.SUSPENDED, 1)
        for tenant, state, listed in (
            ("acme", s.RUNNING, ["s_k"]),
            ("acme", s.SUSPENDED, []),
            ("acme", None, ["s_k"]),
            ("", None, ["s_n"]),
            ("", s.RUNNING, []),
        ):
            page = await index.list_sessions(tenant=tenant, state=state, cursor=None, limit=5)
            assert page.session_ids == listed, (tenant, state)

    async def test_a_poison_quarantine_under_no_tenant_keeps_the_tenant_held(
        self, index: Index
    ) -> None:
        """A caller that does not know the tenant (its header did not read) records the
        poison quarantine under "": the session stays listed under the tenant the
        registry holds, quarantined there, so that tenant can still see and retry it."""
        s = SessionState
        await index.record_session(tenant="acme", session_id="s_k", state=s.SUSPENDED, generation=5)
        assert await index.record_poison(tenant="", session_id="s_k", generation=0) == 5
        assert await index.session_entry("s_k") == SessionEntry("acme", s.QUARANTINED, 5)
        for tenant, state, listed in (
            ("acme", s.QUARANTINED, ["s_k"]),
            ("acme", s.SUSPENDED, []),
            ("acme", None, ["s_k"]),
            ("", None, []),
            ("", s.QUARANTINED, []),
        ):
            page = await index.list_sessions(tenant=tenant, state=state, cursor=None, limit=5)
            assert page.session_ids == listed, (tenant, state)

    async def test_integrity_marker(self, index: Index) -> None:
        assert not await index.is_intact()
        token = await index.begin_repair()
        assert not await index.mark_intact("not-" + token)  # another repair's
        assert not await index.is_intact()
        assert await index.mark_intact(token)
        assert await index.is_intact()
        assert not await index.mark_intact(token)  # the note is used up

    async def test_the_last_complete_sweep_is_remembered(self, index: Index) -> None:
        assert await index.last_sweep() is None
        await index.record_sweep(at=NOW)
        await index.record_sweep(at=NOW + timedelta(seconds=5))
        assert await index.last_sweep() == NOW + timedelta(seconds=5)


class CallerClockLeases:
    """Lease expiry by the caller's ``now``: the single-process indexes (one clock)."""

    async def test_lease_exclusive_until_expiry_with_growing_fence(self, index: Index) -> None:
        ttl = timedelta(seconds=45)
        a = await index.acquire_lease(name="session:s1", owner="a", ttl=ttl, now=NOW)
        assert a is not None
        assert await index.acquire_lease(name="session:s1", owner="b", ttl=ttl, now=NOW) is None
        later = NOW + timedelta(seconds=46)
        b = await index.acquire_lease(name="session:s1", owner="b", ttl=ttl, now=later)
        assert b is not None and b.token > a.token
        # the stale holder can neither renew nor release the new holder's lease
        assert await index.renew_lease(a, ttl=ttl, now=later) is None
        assert not await index.release_lease(a)
        assert await index.release_lease(b)
        c = await index.acquire_lease(name="session:s1", owner="c", ttl=ttl, now=later)
        assert c is not None and c.token > b.token

    async def test_a_lease_its_holder_never_released_is_taken_over(self, index: Index) -> None:
        ttl = timedelta(seconds=45)
        a = await index.acquire_lease(name="session:t", owner="a", ttl=ttl, now=NOW)
        assert a is not None and not a.taken_over
        later = NOW + timedelta(seconds=46)
        await index.forget_lease(name="session:t", now=later)  # the sweep dealt with it
        b = await index.acquire_lease(name="session:t", owner="b", ttl=ttl, now=later)
        assert b is not None and b.taken_over
        assert await index.release_lease(b)
        c = await index.acquire_lease(name="session:t", owner="c", ttl=ttl, now=later)
        assert c is not None and not c.taken_over, "released: nothing taken over"

    async def test_late_renewal_succeeds_only_if_nobody_took_over(self, index: Index) -> None:
        ttl = timedelta(seconds=45)
        a = await index.acquire_lease(name="session:late", owner="a", ttl=ttl, now=NOW)
        assert a is not None
        late = NOW + timedelta(seconds=50)  # past expiry, but the lease is still a's
        renewed = await index.renew_lease(a, ttl=ttl, now=late)
        assert renewed is not None and renewed.expires_at == late + ttl
        assert await index.acquire_lease(name="session:late", owner="b", ttl=ttl, now=late) is None

    async def test_renew_extends(self, index: Index) -> None:
        ttl = timedelta(seconds=45)
        a = await index.acquire_lease(name="session:s2", owner="a", ttl=ttl, now=NOW)
        assert a is not None
        renewed = await index.renew_lease(a, ttl=ttl, now=NOW + timedelta(seconds=30))
        assert renewed is not None and renewed.expires_at == NOW + timedelta(seconds=75)
        at_60 = NOW + timedelta(seconds=60)
        assert await index.acquire_lease(name="session:s2", owner="b", ttl=ttl, now=at_60) is None

    async def test_expired_leases_are_listed_and_forgotten(self, index: Index) -> None:
        ttl = timedelta(seconds=45)
        dead = await index.acquire_lease(name="session:dead", owner="a", ttl=ttl, now=NOW)
        gone = await index.acquire_lease(name="session:gone", owner="a", ttl=ttl, now=NOW)
        assert dead and gone
        await index.release_lease(gone)
        later = NOW + timedelta(seconds=50)
        assert await index.expired_leases(now=NOW, limit=10) == []
        assert await index.expired_leases(now=later, limit=10) == ["session:dead"]
        await index.forget_lease(name="session:dead", now=later)
        assert await index.expired_leases(now=later, limit=10) == []

    async def test_a_forgotten_lease_is_still_its_holders(self, index: Index) -> None:
        """Forgetting takes a lease off the expiry list only: a late heartbeat whom nobody
        replaced renews it (back on the list), and its holder can release it."""
        ttl = timedelta(seconds=45)
        a = await index.acquire_lease(name="session:slow", owner="a", ttl=ttl, now=NOW)
        assert a is not None
        late = NOW + timedelta(seconds=50)
        await index.forget_lease(name="session:slow", now=late)
        assert await index.expired_leases(now=late, limit=10) == []
        renewed = await index.renew_lease(a, ttl=ttl, now=late)
        assert renewed is not None
        assert await index.acquire_lease(name="session:slow", owner="b", ttl=ttl, now=late) is None
        later = late + timedelta(seconds=46)
        assert await index.expired_leases(now=later, limit=10) == ["session:slow"]
        await index.forget_lease(name="session:slow", now=later)
        assert await index.release_lease(renewed)
        b = await index.acquire_lease(name="session:slow", owner="b", ttl=ttl, now=later)
        assert b is not None and b.token > a.token


async def server_now(index: RedisIndex) -> datetime:
    seconds, micros = await index.client.time()
    return datetime.fromtimestamp(seconds + micros / 1e6, UTC)


async def until_server_time(index: RedisIndex, at: datetime, *, limit_s: float = 10) -> None:
    """Wait until the Redis server's clock reaches ``at`` (a condition with a deadline)."""
    deadline = asyncio.get_running_loop().time() + limit_s
    while await server_now(index) < at:
        assert asyncio.get_running_loop().time() < deadline, "the server clock stood still"
        await asyncio.sleep(0.01)


class ServerClockLeases:
    """Lease expiry by the Redis server's clock: the caller's ``now`` (here a date long
    past, or far ahead) changes nothing, only the server's time passing does."""

    async def test_lease_exclusive_until_expiry_with_growing_fence(
        self, redis_index: RedisIndex
    ) -> None:
        index, ttl = redis_index, timedelta(milliseconds=300)
        a = await index.acquire_lease(name="session:s1", owner="a", ttl=ttl, now=NOW)
        assert a is not None
        ahead = NOW + timedelta(days=3650)  # a caller whose clock runs far ahead
        assert await index.acquire_lease(name="session:s1", owner="b", ttl=ttl, now=ahead) is None
        await until_server_time(index, a.expires_at + timedelta(milliseconds=1))
        b = await index.acquire_lease(name="session:s1", owner="b", ttl=ttl, now=NOW)
        assert b is not None and b.token > a.token
        # the stale holder can neither renew nor release the new holder's lease
        assert await index.renew_lease(a, ttl=ttl, now=NOW) is None
        assert not await index.release_lease(a)
        assert await index.release_lease(b)
        c = await index.acquire_lease(name="session:s1", owner="c", ttl=ttl, now=NOW)
        assert c is not None and c.token > b.token

    async def test_a_lease_its_holder_never_released_is_taken_over(
        self, redis_index: RedisIndex
    ) -> None:
        index, ttl = redis_index, timedelta(milliseconds=200)
        a = await index.acquire_lease(name="session:t", owner="a", ttl=ttl, now=NOW)
        assert a is not None and not a.taken_over
        await until_server_time(index, a.expires_at + timedelta(milliseconds=1))
        await index.forget_lease(name="session:t", now=NOW)  # the sweep dealt with it
        b = await index.acquire_lease(name="session:t", owner="b", ttl=ttl, now=NOW)
        assert b is not None and b.taken_over
        assert await index.release_lease(b)
        c = await index.acquire_lease(name="session:t", owner="c", ttl=ttl, now=NOW)
        assert c is not None and not c.taken_over, "released: nothing taken over"

    async def test_late_renewal_succeeds_only_if_nobody_took_over(
        self, redis_index: RedisIndex
    ) -> None:
        index, ttl = redis_index, timedelta(milliseconds=200)
        a = await index.acquire_lease(name="session:late", owner="a", ttl=ttl, now=NOW)
        assert a is not None
        await until_server_time(index, a.expires_at + timedelta(milliseconds=50))
        before = await server_now(index)
        renewed = await index.renew_lease(a, ttl=timedelta(seconds=30), now=NOW)
        assert renewed is not None and renewed.expires_at >= before + timedelta(seconds=29)
        assert await index.acquire_lease(name="session:late", owner="b", ttl=ttl, now=NOW) is None

    async def test_renew_extends(self, redis_index: RedisIndex) -> None:
        index = redis_index
        a = await index.acquire_lease(
            name="session:s2", owner="a", ttl=timedelta(milliseconds=200), now=NOW
        )
        assert a is not None
        renewed = await index.renew_lease(a, ttl=timedelta(seconds=30), now=NOW)
        assert renewed is not None and renewed.expires_at > a.expires_at
        await until_server_time(index, a.expires_at + timedelta(milliseconds=50))
        ttl = timedelta(seconds=1)
        assert await index.acquire_lease(name="session:s2", owner="b", ttl=ttl, now=NOW) is None

    async def test_expired_leases_are_listed_and_forgotten(self, redis_index: RedisIndex) -> None:
        index, ttl = redis_index, timedelta(milliseconds=200)
        dead = await index.acquire_lease(name="session:dead", owner="a", ttl=ttl, now=NOW)
        gone = await index.acquire_lease(name="session:gone", owner="a", ttl=ttl, now=NOW)
        assert dead and gone
        await index.release_lease(gone)
        ahead = NOW + timedelta(days=3650)
        assert await index.expired_leases(now=ahead, limit=10) == []
        await index.forget_lease(name="session:dead", now=ahead)  # still live: kept
        await until_server_time(index, dead.expires_at + timedelta(milliseconds=1))
        assert await index.expired_leases(now=NOW, limit=10) == ["session:dead"]
        await index.forget_lease(name="session:dead", now=NOW)
        assert await index.expired_leases(now=NOW, limit=10) == []

    async def test_a_forgotten_lease_is_still_its_holders(self, redis_index: RedisIndex) -> None:
        index, ttl = redis_index, timedelta(milliseconds=200)
        a = await index.acquire_lease(name="session:slow", owner="a", ttl=ttl, now=NOW)
        assert a is not None
        await until_server_time(index, a.expires_at + timedelta(milliseconds=1))
        await index.forget_lease(name="session:slow", now=NOW)
        assert await index.expired_leases(now=NOW, limit=10) == []
        renewed = await index.renew_lease(a, ttl=timedelta(seconds=30), now=NOW)
        assert renewed is not None
        assert await index.acquire_lease(name="session:slow", owner="b", ttl=ttl, now=NOW) is None
        assert await index.release_lease(renewed)


async def raced_look(redis_index: RedisIndex, monkeypatch: pytest.MonkeyPatch) -> list[str | None]:
    """Session s_m with an older torpor's entry (no tenant), and a record naming tenant
    acme made between the first look for its tenant and the write that follows it: the
    entries each look read, in order."""
    await redis_index._redis.hset(redis_index.keys.session_state, "s_m", "SUSPENDED|5")
    look = redis_index._tenant_of
    looks: list[str | None] = []

    async def raced(session_id: str, value: str | None, **kwargs: Any) -> str:
        looks.append(value)
        found = await look(session_id, value, **kwargs)
        if len(looks) == 1:
            await redis_index.record_session(
                tenant="acme", session_id="s_m", state=SessionState.RUNNING, generation=6
            )
        return found

    monkeypatch.setattr(redis_index, "_tenant_of", raced)
    return looks


class TestRedisIndex(IndexContract, ServerClockLeases):
    @pytest.fixture
    def index(self, redis_index: RedisIndex) -> Index:
        return redis_index

    @pytest.mark.parametrize("op", ["nonce", "lease", "idempotency", "business_key"])
    def test_races_have_exactly_one_winner(
        self, op: str, redis_url: str, redis_prefix: str
    ) -> None:
        winners = race(
            ("redis", {"url": redis_url, "prefix": redis_prefix}), op, workers=6, rounds=20
        )
        assert all(len(w) == 1 for w in winners.values()), winners

    async def test_a_state_entry_carries_its_tenant_and_reads_as_an_older_torpor_wrote_it(
        self, redis_index: RedisIndex
    ) -> None:
        """The state hash carries the tenant between state and generation (a poison
        quarantine whose header did not read finds it there). An entry an older torpor
        wrote ("state|generation") reads with no tenant; a tenant holding "|" reads whole."""
        s, hash_key = SessionState, redis_index.keys.session_state
        await redis_index._redis.hset(hash_key, "s_old", "SUSPENDED|5")
        assert await redis_index.session_entry("s_old") == SessionEntry("", s.SUSPENDED, 5)
        assert await redis_index.session_generation("s_old") == 5
        assert await redis_index.record_poison(tenant="", session_id="s_old", generation=0) == 5
        await redis_index.record_session(
            tenant="a|b", session_id="s_new", state=s.RUNNING, generation=12
        )
        assert await redis_index.session_entry("s_new") == SessionEntry("a|b", s.RUNNING, 12)
        assert await redis_index.session_states(["s_new"]) == {"s_new": s.RUNNING}
        assert await redis_index.session_generation("s_new") == 12

    async def test_a_record_over_an_older_torpors_entry_clears_its_ghost_under_no_tenant(
        self, redis_index: RedisIndex
    ) -> None:
        """An older torpor's poison quarantine wrote "state|generation" (no tenant) and
        listed the session under tenant "": the next record under its tenant takes it out
        of tenant ""'s listings, as a record over an entry under "" does (the contract's
        ``test_a_quarantine_under_no_tenant_is_listed_there_no_more_once_lifted``)."""
        s, keys, r = SessionState, redis_index.keys, redis_index._redis
        await r.hset(keys.session_state, "s_g", "QUARANTINED|0")
        for key in (keys.sessions("", None), keys.sessions("", s.QUARANTINED)):
            await r.zadd(key, {"s_g": 0})
        await redis_index.record_session(
            tenant="acme", session_id="s_g", state=s.SUSPENDED, generation=1
        )
        for state in (None, s.QUARANTINED):
            page = await redis_index.list_sessions(tenant="", state=state, cursor=None, limit=5)
            assert page.session_ids == []
        page = await redis_index.list_sessions(tenant="acme", state=None, cursor=None, limit=5)
        assert page.session_ids == ["s_g"]

    async def test_a_record_with_no_entry_clears_a_ghost_under_no_tenant(
        self, redis_index: RedisIndex
    ) -> None:
        """A session listed under tenant "" whose state hash entry is gone (the sets
        stayed): its next record under its tenant takes it out of tenant ""'s listings.
        Lua reads a missing hash field as false, not nil: the check for "no entry" took
        false for an entry that names a tenant, and the ghost stayed listed for good."""
        s, keys, r = SessionState, redis_index.keys, redis_index._redis
        for key in (keys.sessions("", None), keys.sessions("", s.QUARANTINED)):
            await r.zadd(key, {"s_h": 0})
        assert await r.hget(keys.session_state, "s_h") is None
        await redis_index.record_session(
            tenant="acme", session_id="s_h", state=s.SUSPENDED, generation=1
        )
        for state in (None, s.QUARANTINED):
            page = await redis_index.list_sessions(tenant="", state=state, cursor=None, limit=5)
            assert page.session_ids == [], state
        page = await redis_index.list_sessions(tenant="acme", state=None, cursor=None, limit=5)
        assert page.session_ids == ["s_h"]

    async def test_a_lift_reads_the_tenant_of_every_form_of_entry(
        self, redis_index: RedisIndex
    ) -> None:
        """``lift_quarantine`` under the tenant the entry names: an older torpor's entry
        ("state|generation") names none and takes the lift; a tenant holding "|" is read
        whole, so "b" (its tail) or "" does not lift "a|b"'s quarantine, and "a|b" does."""
        s, r = SessionState, redis_index._redis
        await r.hset(redis_index.keys.session_state, "s_old", "QUARANTINED|4")
        assert await redis_index.lift_quarantine(
            tenant="acme", session_id="s_old", state=s.SUSPENDED, generation=4
        )
        assert await redis_index.session_entry("s_old") == SessionEntry("acme", s.SUSPENDED, 4)
        await redis_index.record_session(
            tenant="a|b", session_id="s_bar", state=s.QUARANTINED, generation=4
        )
        for other in ("b", "", "a"):
            assert not await redis_index.lift_quarantine(
                tenant=other, session_id="s_bar", state=s.SUSPENDED, generation=4
            ), other
        assert await redis_index.lift_quarantine(
            tenant="a|b", session_id="s_bar", state=s.SUSPENDED, generation=4
        )
        assert await redis_index.session_entry("s_bar") == SessionEntry("a|b", s.SUSPENDED, 4)

    async def test_a_read_of_an_entry_no_tenant_lists_scans_the_keyspace_once_a_minute(
        self, redis_index: RedisIndex
    ) -> None:
        """An older torpor's entry names no tenant, and one no tenant's set lists was
        looked up by a SCAN of the whole keyspace at every read, back to back. A read of
        it now SCANs at most once in ``_RESCAN_S``, and finds a tenant listing it since at
        the next; a write under the tenant held always looks (it would lose the session
        to tenant "" for good)."""
        s, keys, r = SessionState, redis_index.keys, redis_index._redis
        scans: list[object] = []
        scan_iter = r.scan_iter

        def counted(*args: Any, **kwargs: Any) -> Any:
            scans.append(kwargs.get("match"))
            return scan_iter(*args, **kwargs)

        r.scan_iter = counted  # type: ignore[method-assign]
        await r.hset(keys.session_state, "s_x", "QUARANTINED|3")
        for _ in range(3):
            assert await redis_index.session_entry("s_x") == SessionEntry("", s.QUARANTINED, 3)
        assert len(scans) == 1
        await r.zadd(keys.sessions("acme", None), {"s_x": 0})  # a tenant new since the SCAN
        assert await redis_index.session_entry("s_x") == SessionEntry("", s.QUARANTINED, 3)
        assert len(scans) == 1
        assert redis_index._unlisted is not None
        redis_index._unlisted["s_x"] -= registry_module._RESCAN_S + 1  # the window is over
        assert await redis_index.session_entry("s_x") == SessionEntry("acme", s.QUARANTINED, 3)
        assert len(scans) == 2
        # A write looks within the window: the poison quarantine of an older entry whose
        # tenant's set is new since a read's SCAN found none is recorded under that tenant.
        await r.hset(keys.session_state, "s_y", "SUSPENDED|2")
        assert await redis_index.session_entry("s_y") == SessionEntry("", s.SUSPENDED, 2)
        assert len(scans) == 3 and "s_y" in redis_index._unlisted
        await r.zadd(keys.sessions("globex", None), {"s_y": 0})
        assert await redis_index.record_poison(tenant="", session_id="s_y", generation=0) == 2
        assert len(scans) == 4 and "s_y" not in redis_index._unlisted
        assert await redis_index.session_entry("s_y") == SessionEntry("globex", s.QUARANTINED, 2)
        # Reads at once of sessions none lists share one SCAN: the first read's SCAN is
        # held until every read has asked for one.
        unlisted = [f"s_z{i}" for i in range(5)]
        for sid in unlisted:
            await r.hset(keys.session_state, sid, "SUSPENDED|1")
        asked: list[float] = []
        release = asyncio.Event()
        shared_scan, every_tenant = redis_index._shared_scan, redis_index._every_tenant

        async def asking(began: float) -> frozenset[str]:
            asked.append(began)
            return await shared_scan(began)

        async def held() -> frozenset[str]:
            await release.wait()
            return await every_tenant()

        redis_index._shared_scan = asking  # type: ignore[method-assign]
        redis_index._every_tenant = held  # type: ignore[method-assign]
        reads = asyncio.gather(*(redis_index.session_entry(sid) for sid in unlisted))
        await eventually(lambda: len(asked) == len(unlisted), timeout_s=10)
        release.set()
        assert await reads == [SessionEntry("", s.SUSPENDED, 1)] * 5
        assert len(scans) == 5

    async def test_a_record_over_an_entry_that_names_its_tenant_touches_no_tenants_sets(
        self, redis_index: RedisIndex
    ) -> None:
        """A commit's record over an entry that names a real tenant makes no ZREM on
        tenant ""'s sets (only an entry under "" or with no tenant can have left a ghost
        there). Proved by a member planted there: a ZREM would take it out."""
        s, keys, r = SessionState, redis_index.keys, redis_index._redis
        await redis_index.record_session(
            tenant="acme", session_id="s_t", state=s.SUSPENDED, generation=5
        )
        planted = (keys.sessions("", None), keys.sessions("", s.QUARANTINED))
        for key in planted:
            await r.zadd(key, {"s_t": 0})
        await redis_index.record_session(
            tenant="acme", session_id="s_t", state=s.RUNNING, generation=6
        )
        for key in planted:
            assert await r.zscore(key, "s_t") == 0
        assert await redis_index.session_entry("s_t") == SessionEntry("acme", s.RUNNING, 6)

    async def test_a_poison_quarantine_of_an_older_torpors_entry_stays_under_its_tenant(
        self, redis_index: RedisIndex
    ) -> None:
        """An older torpor wrote "state|generation" (no tenant) and listed the session
        under its tenant. Its poison quarantine, header unread (tenant ""), finds the
        tenant in the listings: quarantined there, in the hash and the sets, never under
        "" (where its tenant's GET and retry would not find it)."""
        s, keys, r = SessionState, redis_index.keys, redis_index._redis
        await r.hset(keys.session_state, "s_o", "SUSPENDED|5")
        for key in (keys.sessions("a:b", None), keys.sessions("a:b", s.SUSPENDED)):
            await r.zadd(key, {"s_o": 0})
        await redis_index.record_session(  # another tenant's session, another listing
            tenant="beta", session_id="s_b", state=s.SUSPENDED, generation=1
        )
        assert await redis_index.record_poison(tenant="", session_id="s_o", generation=0) == 5
        assert await redis_index.session_entry("s_o") == SessionEntry("a:b", s.QUARANTINED, 5)
        for tenant, state, listed in (
            ("a:b", s.QUARANTINED, ["s_o"]),
            ("a:b", s.SUSPENDED, []),
            ("a:b", None, ["s_o"]),
            ("", None, []),
            ("", s.QUARANTINED, []),
            ("beta", None, ["s_b"]),
        ):
            page = await redis_index.list_sessions(tenant=tenant, state=state, cursor=None, limit=5)
            assert page.session_ids == listed, (tenant, state)

    async def test_an_older_torpors_entry_reads_under_the_tenant_whose_listing_holds_it(
        self, redis_index: RedisIndex
    ) -> None:
        """An older torpor wrote "state|generation" (no tenant) and listed the session
        under its tenant (and, its own poison quarantine, under "" too): the entry reads
        under the tenant whose listing holds it, not "" (the stand-in of a session whose
        header does not read is built from it: its tenant's GET answered 404). The read
        leaves the value as it was (``session_entry`` says why)."""
        s, keys, r = SessionState, redis_index.keys, redis_index._redis
        await r.hset(keys.session_state, "s_o", "QUARANTINED|0")
        for tenant, state in (("a:b", s.SUSPENDED), ("", s.QUARANTINED)):
            for key in (keys.sessions(tenant, None), keys.sessions(tenant, state)):
                await r.zadd(key, {"s_o": 0})
        await redis_index.record_session(  # another tenant's session, another listing
            tenant="beta", session_id="s_b", state=s.SUSPENDED, generation=1
        )
        assert await redis_index.session_entry("s_o") == SessionEntry("a:b", s.QUARANTINED, 0)
        assert await r.hget(keys.session_state, "s_o") == "QUARANTINED|0"
        assert await redis_index.session_entry("s_b") == SessionEntry("beta", s.SUSPENDED, 1)

    async def test_a_record_under_no_tenant_over_an_older_torpors_entry_stays_under_its_tenant(
        self, redis_index: RedisIndex
    ) -> None:
        """A record under "" over an older torpor's entry ("state|generation", no tenant)
        is made under the tenant whose listing holds the session, as a poison quarantine's
        is: the entry names it from then on, and nothing is listed under ""."""
        s, keys, r = SessionState, redis_index.keys, redis_index._redis
        await r.hset(keys.session_state, "s_o", "SUSPENDED|5")
        for key in (keys.sessions("a:b", None), keys.sessions("a:b", s.SUSPENDED)):
            await r.zadd(key, {"s_o": 0})
        await redis_index.record_session(tenant="", session_id="s_o", state=s.RUNNING, generation=6)
        assert await r.hget(keys.session_state, "s_o") == "RUNNING|a:b|6"
        for tenant, state, listed in (
            ("a:b", s.RUNNING, ["s_o"]),
            ("a:b", s.SUSPENDED, []),
            ("", None, []),
        ):
            page = await redis_index.list_sessions(tenant=tenant, state=state, cursor=None, limit=5)
            assert page.session_ids == listed, (tenant, state)

    async def test_an_older_torpors_entry_is_looked_for_in_the_tenants_found_before_a_scan(
        self, redis_index: RedisIndex, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The tenants a SCAN of the keyspace found are kept: an older torpor's entry of a
        tenant found before is looked up in its listing alone, no SCAN; one no tenant
        found before lists (a tenant new since) makes one, and is found all the same."""
        keys, r = redis_index.keys, redis_index._redis
        for sid, tenant in (("s_1", "acme"), ("s_2", "acme"), ("s_3", "beta")):
            await r.hset(keys.session_state, sid, "SUSPENDED|5")
            await r.zadd(keys.sessions(tenant, None), {sid: 0})
        scan = r.scan_iter
        scans: list[object] = []

        def counted(*args: Any, **kwargs: Any) -> Any:
            scans.append(kwargs["match"])
            return scan(*args, **kwargs)

        monkeypatch.setattr(r, "scan_iter", counted)
        entry = await redis_index.session_entry("s_1")
        assert (entry and entry.tenant, len(scans)) == ("acme", 1)
        for sid, tenant in (("s_2", "acme"), ("s_3", "beta")):
            entry = await redis_index.session_entry(sid)
            assert (entry and entry.tenant, len(scans)) == (tenant, 1)
        await r.hset(keys.session_state, "s_4", "SUSPENDED|5")
        await r.zadd(keys.sessions("gamma", None), {"s_4": 0})
        entry = await redis_index.session_entry("s_4")
        assert (entry and entry.tenant, len(scans)) == ("gamma", 2)

    async def test_a_poison_quarantine_is_written_over_the_entry_it_looked_at_only(
        self, redis_index: RedisIndex, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The tenant of an entry that names none is looked up before the write: a record
        made between the look and the write (naming another tenant) sends it round to
        look again, and the quarantine goes under the tenant the entry names then."""
        s = SessionState
        looks = await raced_look(redis_index, monkeypatch)
        assert await redis_index.record_poison(tenant="", session_id="s_m", generation=0) == 6
        assert looks == ["SUSPENDED|5", "RUNNING|acme|6"]
        assert await redis_index.session_entry("s_m") == SessionEntry("acme", s.QUARANTINED, 6)
        page = await redis_index.list_sessions(tenant="", state=None, cursor=None, limit=5)
        assert page.session_ids == []

    async def test_a_record_under_no_tenant_is_written_over_the_entry_it_looked_at_only(
        self, redis_index: RedisIndex, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """As a poison quarantine's: a record under "" made between the look for the
        tenant and the write (naming one) sends it round to look again, and the state
        goes under the tenant the entry names then, never under "" over it."""
        s = SessionState
        looks = await raced_look(redis_index, monkeypatch)
        written = await redis_index.record_session(
            tenant="", session_id="s_m", state=s.RESUMING, generation=7
        )
        assert looks == ["SUSPENDED|5", "RUNNING|acme|6"]
        assert written is True  # the look made again wrote: its -1 is no answer
        assert await redis_index.session_entry("s_m") == SessionEntry("acme", s.RESUMING, 7)
        page = await redis_index.list_sessions(tenant="", state=None, cursor=None, limit=5)
        assert page.session_ids == []

    async def test_unbind_knowing_the_deadline_is_one_script_with_no_read_first(
        self, redis_index: RedisIndex, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        b = binding()
        await redis_index.bind_wait(b, business_key="PO-1", grace=GRACE, now=NOW)
        sent: list[Any] = []
        call = redis_index._pipelined.call

        async def recorded(*args: Any, **options: Any) -> Any:
            sent.append(args[0])
            return await call(*args, **options)

        monkeypatch.setattr(redis_index._pipelined, "call", recorded)
        await redis_index.unbind(
            tenant="acme", correlation_id=b.correlation_id, business_key="PO-1", deadline=b.deadline
        )
        assert sent == ["EVALSHA"]
        assert await redis_index.resolve(now=NOW, tenant="acme", business_key="PO-1") is None

    async def test_unbind_with_a_stale_deadline_removes_the_stored_deadline_entry(
        self, redis_index: RedisIndex
    ) -> None:
        """The hint names an hour the binding is no longer in: the entry of the hour it is
        in goes (read from the binding), not the hint's."""
        b = binding()
        later = b.model_copy(update={"deadline": b.deadline + timedelta(hours=5)})
        await redis_index.bind_wait(b, business_key=None, grace=GRACE, now=NOW)
        await redis_index.bind_wait(later, business_key=None, grace=GRACE, now=NOW)
        hour = int(later.deadline.timestamp()) // 3600
        shard = redis_index.keys.deadline_set(b.correlation_id, hour)
        assert await redis_index._redis.zscore(shard, b.correlation_id) is not None
        await redis_index.unbind(
            tenant="acme", correlation_id=b.correlation_id, business_key=None, deadline=b.deadline
        )
        assert await redis_index._redis.zscore(shard, b.correlation_id) is None

    async def test_mend_puts_a_lost_deadline_entry_and_hour_back(
        self, redis_index: RedisIndex
    ) -> None:
        """A binding whose deadline entry was evicted or deleted alone: its SLA would
        never fall due. The hour index too (lost, every deadline of its hour is unseen)."""
        b = binding(deadline_in=60)
        await redis_index.bind_wait(b, business_key=None, grace=GRACE, now=NOW)
        hour = int(b.deadline.timestamp()) // 3600
        await redis_index._redis.delete(
            redis_index.keys.deadline_set(b.correlation_id, hour), redis_index.keys.deadline_hours
        )
        due_at = NOW + timedelta(seconds=61)
        assert await redis_index.due_deadlines(now=due_at, limit=10) == []
        assert await redis_index.mend_wait(b, business_key=None, grace=GRACE, now=NOW) == 2
        assert await redis_index.due_deadlines(now=due_at, limit=10) == [b]
        assert await redis_index.mend_wait(b, business_key=None, grace=GRACE, now=NOW) == 0

    async def test_mend_gives_what_it_puts_back_the_bindings_own_life(
        self, redis_index: RedisIndex
    ) -> None:
        """A wait repair bound for longer than the grace (overdue by more): what a mend
        puts back lives as long as that binding, not deadline + the configured grace
        (already past: the entries expired as they were made)."""
        b = binding(deadline_in=60)
        await redis_index.bind_wait(b, business_key=None, grace=timedelta(days=10), now=NOW)
        hour = int(b.deadline.timestamp()) // 3600
        shard = redis_index.keys.deadline_set(b.correlation_id, hour)
        await redis_index._redis.delete(shard)
        later = NOW + GRACE + timedelta(hours=2)  # past deadline + GRACE, inside the 10 days
        assert await redis_index.mend_wait(b, business_key="PO-9", grace=GRACE, now=later) == 2
        day_ms = 24 * 3600 * 1000
        assert await redis_index._redis.pttl(shard) > 7 * day_ms
        bk_key, _ = redis_index.keys.business_key("acme", "PO-9")
        assert await redis_index._redis.pttl(bk_key) > 7 * day_ms
        assert await redis_index.resolve(now=later, tenant="acme", business_key="PO-9") == b

    async def test_a_lost_fence_counter_never_hands_out_a_token_below_the_last_holders(
        self, redis_index: RedisIndex
    ) -> None:
        """The counter lost alone (evicted, deleted) while the record of a lease its holder
        never released stays: the next holder's token is still above the dead one's."""
        index, ttl = redis_index, timedelta(milliseconds=200)
        a = await index.acquire_lease(name="session:lf", owner="a", ttl=ttl, now=NOW)
        assert a is not None
        a = await index.raise_fence(a, floor=10, ttl=ttl, now=NOW)
        assert a is not None and a.token == 11
        await index.client.delete(index.keys.fence("session:lf"))
        await until_server_time(index, a.expires_at + timedelta(milliseconds=1))
        b = await index.acquire_lease(name="session:lf", owner="b", ttl=ttl, now=NOW)
        assert b is not None and b.token > a.token
        # and the counter moved with it: the next token is above b's
        assert await index.release_lease(b)
        c = await index.acquire_lease(name="session:lf", owner="c", ttl=ttl, now=NOW)
        assert c is not None and c.token > b.token

    @pytest.mark.parametrize("forgotten", [False, True])
    async def test_a_lease_never_released_is_taken_over_after_its_record_was_collected(
        self, redis_index: RedisIndex, monkeypatch: pytest.MonkeyPatch, forgotten: bool
    ) -> None:
        """The record of an expired lease is collected (a day later, here at once) while
        its entry in the expiry set waits for a sweep: its holder still never released
        it, and the next holder must be told (it re-records the session's state), before
        the sweep forgot the lease or after."""
        gc = leases_module.LEASE_GC
        monkeypatch.setattr(leases_module, "LEASE_GC", 1)
        index, ttl = redis_index, timedelta(milliseconds=200)
        a = await index.acquire_lease(name="session:gc", owner="a", ttl=ttl, now=NOW)
        assert a is not None
        record = index.keys.lease("session:gc")

        async def collected() -> bool:  # it expires by the server's clock
            return not await index.client.exists(record)

        await eventually(collected, timeout_s=10, interval_s=0.01, what="the record expired")
        monkeypatch.setattr(leases_module, "LEASE_GC", gc)  # what forget writes back stays
        assert await index.expired_leases(now=NOW, limit=10) == ["session:gc"]
        if forgotten:  # the sweep queued its recovery and forgot it first
            await index.forget_lease(name="session:gc", now=NOW)
            assert await index.expired_leases(now=NOW, limit=10) == []
        b = await index.acquire_lease(name="session:gc", owner="b", ttl=ttl, now=NOW)
        assert b is not None and b.taken_over and b.token > a.token
        assert await index.release_lease(b)
        c = await index.acquire_lease(name="session:gc", owner="c", ttl=ttl, now=NOW)
        assert c is not None and not c.taken_over, "released: nothing taken over"

    async def test_raising_the_fence_after_the_counter_was_lost_never_lowers_the_token(
        self, redis_index: RedisIndex
    ) -> None:
        index, ttl = redis_index, timedelta(seconds=30)
        a = await index.acquire_lease(name="session:lr", owner="a", ttl=ttl, now=NOW)
        assert a is not None
        a = await index.raise_fence(a, floor=10, ttl=ttl, now=NOW)
        assert a is not None and a.token == 11
        await index.client.delete(index.keys.fence("session:lr"))
        raised = await index.raise_fence(a, floor=0, ttl=ttl, now=NOW)
        assert raised is not None and raised.token > a.token

    async def test_a_binding_this_version_cannot_read_keeps_its_deadline_entry(
        self, redis_index: RedisIndex
    ) -> None:
        """A newer torpor's binding, mid-upgrade: this one's deadline loop neither returns
        it nor drops its deadline entry (the newer one would never see it fall due)."""
        b = binding(deadline_in=60)
        await redis_index.bind_wait(b, business_key=None, grace=GRACE, now=NOW)
        cid, bucket = b.correlation_id, redis_index.keys.correlation(b.correlation_id)
        stored = await redis_index.client.hget(bucket, cid)
        await redis_index.client.hset(bucket, cid, "9" + stored[1:] + "|newer")
        shard = redis_index.keys.deadline_set(cid, int(b.deadline.timestamp()) // 3600)
        due_at = NOW + timedelta(seconds=61)
        assert await redis_index.due_deadlines(now=due_at, limit=10) == []
        assert await redis_index.client.zscore(shard, cid) is not None
        # a binding that is gone is still collected
        await redis_index.client.hdel(bucket, cid)
        assert await redis_index.due_deadlines(now=due_at, limit=10) == []
        assert await redis_index.client.zscore(shard, cid) is None

    async def test_due_deadlines_reads_the_bindings_of_the_earliest_entries_only(
        self, redis_index: RedisIndex, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A backlog of due deadlines spread over the shards: a pass reads the bindings of
        the ``limit`` earliest (and of more only for those that are not live), not of
        every entry each shard returned, up to 128 times ``limit``."""
        waits = [binding(deadline_in=60 + n) for n in range(60)]
        for b in waits:
            await redis_index.bind_wait(b, business_key=None, grace=GRACE, now=NOW)
        gone = waits[1]  # its binding gone, its deadline entry left: garbage to drop
        await redis_index.client.hdel(
            redis_index.keys.correlation(gone.correlation_id), gone.correlation_id
        )
        reads: list[Any] = []
        hget = Pipeline.hget

        def counted(pipe: Pipeline, *args: Any) -> Any:
            reads.append(args)
            return hget(pipe, *args)

        monkeypatch.setattr(Pipeline, "hget", counted)
        due = await redis_index.due_deadlines(now=NOW + timedelta(hours=1), limit=5)
        assert due == [waits[0], *waits[2:6]]
        # one round trip of a few (``waits.MIN_BINDING_READS``), the 5 wanted among them
        assert len(reads) <= 16
        shard = redis_index.keys.deadline_set(
            gone.correlation_id, int(gone.deadline.timestamp()) // 3600
        )
        assert await redis_index.client.zscore(shard, gone.correlation_id) is None

    @pytest.mark.parametrize("entry", ["9|acme|s_1|3|2|zz|1", "3|acme|s_1|3|2|!!|1", "3|acme"])
    async def test_unbind_knowing_the_deadline_leaves_an_unreadable_entry_alone(
        self, redis_index: RedisIndex, entry: str
    ) -> None:
        """As the read before it did: an entry it cannot decode is not torpor's binding."""
        cid = new_correlation_id()
        bucket = redis_index.keys.correlation(cid)
        await redis_index._redis.hset(bucket, cid, entry)
        await redis_index.unbind(tenant="acme", correlation_id=cid, business_key=None, deadline=NOW)
        assert await redis_index._redis.hget(bucket, cid) == entry

    async def test_a_backlog_of_due_deadlines_is_read_about_limit_entries_a_pass(
        self, redis_url: str, redis_prefix: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Each pass read every shard of an hour up to ``limit`` entries and sorted the
        union: after an outage, with an hour of deadlines due, 128 times ``limit`` entries
        a pass (the whole backlog, 200,000 entries and 2.2 s a pass at ``limit`` 2,000),
        four passes a second. A pass now reads about twice ``limit``. Eight shards here,
        each holding 100 due entries, every eighth deadline."""
        index = RedisIndex(redis_url, prefix=f"{redis_prefix}few:", deadline_shards=8)
        hour = int(NOW.timestamp()) // 3600
        by_shard: dict[str, list[str]] = {}
        while min((len(c) for c in by_shard.values()), default=0) < 100 or len(by_shard) < 8:
            cid = new_correlation_id()
            by_shard.setdefault(index.keys.deadline_set(cid, hour), []).append(cid)
        columns = [cids[:100] for cids in by_shard.values()]
        in_order = [cid for row in zip(*columns, strict=True) for cid in row]
        waits = [
            binding(deadline_in=n / 1000).model_copy(update={"correlation_id": cid})
            for n, cid in enumerate(in_order)
        ]
        for b in waits:
            await index.bind_wait(b, business_key=None, grace=GRACE, now=NOW)
        asked: list[int] = []
        zrangebyscore = Pipeline.zrangebyscore

        def counted(pipe: Pipeline, *args: Any, **kwargs: Any) -> Any:
            asked.append(kwargs["num"])
            return zrangebyscore(pipe, *args, **kwargs)

        monkeypatch.setattr(Pipeline, "zrangebyscore", counted)
        try:
            due = await index.due_deadlines(now=NOW + timedelta(minutes=30), limit=50)
        finally:
            await index.close()
        assert due == waits[:50]
        assert sum(asked) <= 3 * 50, f"{sum(asked)} entries asked for in {len(asked)} reads"

    async def test_redis_down_is_a_typed_retryable_error(self) -> None:
        index = RedisIndex("redis://127.0.0.1:9/0")
        with pytest.raises(IndexUnavailable, match=r"127\.0\.0\.1:9") as info:
            await claim(index, [("s", "n")])
        assert info.value.retryable
        await index.close()

    async def test_password_never_shown(self) -> None:
        index = RedisIndex("redis://:hunter2@127.0.0.1:9/0")
        assert "hunter2" not in index.url
        with pytest.raises(IndexUnavailable) as info:
            await index.ping()
        assert "hunter2" not in str(info.value)
        await index.close()


class TestSqliteIndex(IndexContract, CallerClockLeases):
    @pytest.fixture
    def index(self, sqlite_index: SqliteIndex) -> Index:
        return sqlite_index

    @pytest.mark.parametrize("op", ["nonce", "lease", "idempotency", "business_key"])
    def test_races_have_exactly_one_winner(self, op: str, tmp_path: Path) -> None:
        winners = race(("sqlite", {"path": str(tmp_path / "race.db")}), op, workers=6, rounds=20)
        assert all(len(w) == 1 for w in winners.values()), winners

    async def test_expired_claims_are_deleted_not_kept_for_ever(
        self, sqlite_index: SqliteIndex
    ) -> None:
        """Redis' TTLs forget replay nonces and idempotency keys; here each claim deletes
        expired rows, not only a row of its own key (rarely claimed twice: the tables grew
        with every request ever taken)."""
        index, ttl = sqlite_index, timedelta(minutes=10)
        for n in range(3):
            assert await claim(index, [("hook:gh", f"old-{n}")])
            await index.claim_idempotency(
                tenant="acme", key=f"old-{n}", fingerprint="f", session_id="s", ttl=ttl, now=NOW
            )
        later = NOW + ttl + timedelta(seconds=1)
        fresh = await index.admit(
            claims=[("hook:gh", "new")],
            ttl=ttl,
            now=later,
            tenant="acme",
            correlation_id=None,
            business_key=None,
        )
        assert fresh.fresh
        await index.claim_idempotency(
            tenant="acme", key="new", fingerprint="f", session_id="s", ttl=ttl, now=later
        )

        def count(table: str) -> int:
            with closing(sqlite3.connect(index.path)) as db:
                [(rows,)] = db.execute(f"SELECT count(*) FROM {table}").fetchall()
                return int(rows)

        assert (count("nonces"), count("idempotency")) == (1, 1)

    @pytest.mark.parametrize("op", ["unbind", "due_deadlines"])
    async def test_unbind_and_due_deadlines_do_not_grow_with_the_waits_bound(
        self, sqlite_index: SqliteIndex, op: str
    ) -> None:
        """A resume unbinds its wait, and the deadline loop runs 4 times a second: each
        finds its rows by an index. Measured in SQLite VM instructions, with many other
        waits bound (and business keys held) in the same tenant."""
        index, others = sqlite_index, 5000
        with closing(sqlite3.connect(index.path)) as db, db:
            far = 10**13  # neither due nor expired
            db.executemany(
                "INSERT INTO bindings VALUES (?,?,?,?,?)",
                [(f"c{n}", "acme", "x", far, far) for n in range(others)],
            )
            db.executemany(
                "INSERT INTO business_keys VALUES (?,?,?,?)",
                [("acme", f"k{n}", f"c{n}", far) for n in range(others)],
            )
        b = binding()
        await index.bind_wait(b, business_key="PO-1", grace=GRACE, now=NOW)
        steps = 0

        def step() -> int:
            nonlocal steps
            steps += 1
            return 0  # go on

        index._conn.set_progress_handler(step, 1000)
        if op == "unbind":
            await index.unbind(tenant="acme", correlation_id=b.correlation_id, business_key="PO-1")
        else:
            assert await index.due_deadlines(now=NOW, limit=10) == []
        index._conn.set_progress_handler(None, 0)
        # a look-up by index is a few hundred instructions; a scan of 5000 rows, tens of
        # thousands
        assert steps <= 3, f"{steps} thousand instructions: a table scan"


class TestMemoryIndex(IndexContract, CallerClockLeases):
    @pytest.fixture
    def index(self, memory_index: MemoryIndex) -> Index:
        return memory_index
