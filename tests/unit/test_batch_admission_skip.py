"""Only a batch's sessions take running slots: any other activation goes straight to the
activator, with no slot round trip before it nor after it (#13: every resume paid two)."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace
from typing import Any

from storage.memory_index import MemoryIndex
from storage.memory_slots import MemorySlots
from torpor.clock import ManualClock
from torpor.ids import batch_session_id, in_batch, new_session_id
from torpor.lifecycle import SessionState
from torpor.ports import Reason, SlotEntry
from torpor.service.admission import AdmittingActivator
from torpor.session.slots import leave_slot


class CountingSlots(MemorySlots):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str]] = []

    async def enter(self, *, member: str, ttl: timedelta) -> SlotEntry:
        self.calls.append(("enter", member))
        return await super().enter(member=member, ttl=ttl)

    async def leave(self, *, member: str, forget: bool, limit: int) -> list[str]:
        self.calls.append(("leave", member))
        return await super().leave(member=member, forget=forget, limit=limit)


class Recorder:
    def __init__(self) -> None:
        self.requested: list[str] = []

    async def request(self, session_id: str, *, reason: Reason, agent: str | None = None) -> None:
        self.requested.append(session_id)


def test_a_batch_sessions_id_is_told_from_any_other() -> None:
    batch = batch_session_id("b_0123456789abcdef", 1_700_000_000_000, 7)
    assert in_batch(batch)
    assert not in_batch(new_session_id())
    assert not in_batch("s_" + "x" * 26 + "y")  # one character longer


async def test_only_a_batch_session_takes_and_gives_back_a_slot() -> None:
    slots = CountingSlots()
    plain, doc = new_session_id(), batch_session_id("b_x", 1_700_000_000_000, 0)
    await slots.register(members={doc: 0}, scopes={"batch:b_x": 1}, queue="batch:b_x")
    services: Any = SimpleNamespace(
        slots=slots,
        clock=ManualClock(),
        index=MemoryIndex(),
        config=SimpleNamespace(
            activation_cap=timedelta(minutes=10), lease_ttl=timedelta(seconds=30)
        ),
        settings=SimpleNamespace(batches=SimpleNamespace(admission_retry_s=30.0)),
    )
    inner = Recorder()
    activator = AdmittingActivator(inner, services)
    await activator.request(plain, reason=Reason.EVENT)
    await leave_slot(services, plain, SessionState.SUSPENDED)
    assert slots.calls == [], "a session outside any batch costs no slot round trip"
    await activator.request(doc, reason=Reason.EVENT)
    await leave_slot(services, doc, SessionState.SUSPENDED)
    assert slots.calls == [("enter", doc), ("leave", doc)]
    assert inner.requested == [plain, doc]
