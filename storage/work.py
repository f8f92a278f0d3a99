"""What is recorded about compute work (``torpor.work``), and the progress it reports.

Every record that decides something is create-only, so two processes that race (a
re-dispatch after a crash and the first run, a stop and a late start) agree on one answer:

* ``order`` — what the work was asked to do, written at first dispatch (a re-run reads it);
* ``runs/{n}`` — run *n* was started: claiming it is what lets exactly one process start it;
* ``outcome`` — how the work ended: the first recorded outcome is the answer, always;
* ``stopped`` — cancelled or compensated: no later dispatch may start it again;
* ``lost/{n}`` — why run *n* died (the runner saw its node or process go).

Progress is advisory and overwritten in place, beside the session, never in its snapshot.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import JsonValue, ValidationError

from storage import keys
from torpor.errors import ObjectExists, ObjectNotFound
from torpor.ports import ObjectStore
from torpor.work import Progress, WorkOrder


class WorkRecords:
    def __init__(self, store: ObjectStore) -> None:
        self.store = store

    async def save_order(self, order: WorkOrder) -> None:
        data = dict(order.as_data())
        data["run"] = 1
        # The session's ref first (for retention): a crash after it leaves a ref naming
        # nothing, which retention skips, never a work record it cannot find.
        await self.store.put(keys.work_ref(order.session_id, order.work_id), b"")
        try:
            await self.store.put_if_absent(keys.work_order(order.work_id), _dump(data))
        except ObjectExists:  # a re-dispatch: the first order stands
            return

    async def order(self, work_id: str) -> WorkOrder | None:
        data = await self._json(keys.work_order(work_id))
        return WorkOrder.from_data(data) if data is not None else None

    async def claim_run(self, work_id: str, run: int, *, by: str) -> bool:
        """True for the one caller that may start run ``run`` of this work."""
        try:
            await self.store.put_if_absent(keys.work_run(work_id, run), by.encode())
        except ObjectExists:
            return False
        return True

    async def runs(self, work_id: str) -> int:
        page = await self.store.list(keys.work_runs_prefix(work_id), limit=1000)
        return len(page.keys)

    async def record_outcome(
        self, work_id: str, outcome: dict[str, JsonValue]
    ) -> dict[str, JsonValue]:
        """Create-only: the outcome recorded first is the one every caller gets back."""
        try:
            await self.store.put_if_absent(keys.work_outcome(work_id), _dump(outcome))
        except ObjectExists:
            first = await self.outcome(work_id)
            if first is not None:
                return first
        return outcome

    async def outcome(self, work_id: str) -> dict[str, JsonValue] | None:
        return await self._json(keys.work_outcome(work_id))

    async def put_result(self, work_id: str, data: bytes) -> str:
        key = keys.work_result(work_id)
        await self.store.put(key, data)  # single writer: the run that recorded it
        return key

    async def stop(self, work_id: str, reason: str) -> None:
        try:
            await self.store.put_if_absent(keys.work_stopped(work_id), reason.encode()[:500])
        except ObjectExists:
            return

    async def stopped(self, work_id: str) -> bool:
        return await self._raw(keys.work_stopped(work_id)) is not None

    async def record_lost(self, work_id: str, run: int, cause: str) -> None:
        try:
            await self.store.put_if_absent(keys.work_lost(work_id, run), cause.encode()[:1000])
        except ObjectExists:
            return

    async def lost_cause(self, work_id: str, run: int) -> str | None:
        raw = await self._raw(keys.work_lost(work_id, run))
        return raw.decode(errors="replace") if raw is not None else None

    async def _raw(self, key: str) -> bytes | None:
        try:
            return (await self.store.get(key)).data
        except ObjectNotFound:
            return None

    async def _json(self, key: str) -> dict[str, Any] | None:
        raw = await self._raw(key)
        if raw is None:
            return None
        value = json.loads(raw)
        return value if isinstance(value, dict) else None


class ObjectProgress:
    """``torpor.work.ProgressRepository`` on the object store: one small object per work."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store

    async def report(self, session_id: str, progress: Progress) -> None:
        await self.store.put(
            keys.progress(session_id, progress.work_id), progress.model_dump_json().encode()
        )

    async def of(self, session_id: str) -> list[Progress]:
        page = await self.store.list(keys.progress_prefix(session_id), limit=100)
        found: list[Progress] = []
        for key in page.keys:
            try:
                found.append(Progress.model_validate_json((await self.store.get(key)).data))
            except (ObjectNotFound, ValidationError):
                continue  # cleared meanwhile, or not ours: progress is advisory
        return sorted(found, key=lambda p: p.at)

    async def clear(self, session_id: str, work: str) -> None:
        await self.store.delete(keys.progress(session_id, work))


def _dump(value: object) -> bytes:
    return json.dumps(value, separators=(",", ":"), default=str).encode()
