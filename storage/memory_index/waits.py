"""Open waits in memory: bindings by correlation id, business-key pointers."""

from __future__ import annotations

from datetime import datetime, timedelta

from torpor.clock import from_ms, to_ms
from torpor.ports import WaitBinding


def ms(delta: timedelta) -> int:
    return max(1, int(delta.total_seconds() * 1000))


class MemoryWaits:
    def __init__(self) -> None:
        self._waits: dict[str, tuple[WaitBinding, int]] = {}  # cid → (binding, expires ms)
        self._business_keys: dict[tuple[str, str], str] = {}  # (tenant, key) → cid
        super().__init__()

    async def bind_wait(
        self, binding: WaitBinding, *, business_key: str | None, grace: timedelta, now: datetime
    ) -> bool:
        stored = binding.model_copy(update={"deadline": from_ms(to_ms(binding.deadline))})
        self._waits[binding.correlation_id] = (stored, to_ms(binding.deadline + grace))
        if not business_key:
            return True
        held = self._live(
            self._business_keys.get((binding.tenant, business_key)),
            tenant=binding.tenant,
            now=now,
        )
        if held is not None and held.session_id != binding.session_id:
            return False  # another session's open wait keeps the key
        self._business_keys[(binding.tenant, business_key)] = binding.correlation_id
        return True

    async def mend_wait(
        self, binding: WaitBinding, *, business_key: str | None, grace: timedelta, now: datetime
    ) -> int | None:
        # A binding here holds its deadline: only a business-key pointer can be missing.
        cid = binding.correlation_id
        stored = binding.model_copy(update={"deadline": from_ms(to_ms(binding.deadline))})
        if self._live(cid, tenant=binding.tenant, now=now) != stored:
            return None
        if not business_key:
            return 0
        owner = self._live(
            self._business_keys.get((binding.tenant, business_key)),
            tenant=binding.tenant,
            now=now,
        )
        if owner is not None and (
            owner.correlation_id == cid or owner.session_id != binding.session_id
        ):
            return 0  # ours already, or another session's open wait keeps it
        self._business_keys[(binding.tenant, business_key)] = cid
        return 1

    def _live(self, cid: str | None, *, tenant: str, now: datetime) -> WaitBinding | None:
        found = self._waits.get(cid) if cid is not None else None
        if found is None or found[1] <= to_ms(now) or found[0].tenant != tenant:
            return None
        return found[0]

    async def resolve(
        self,
        *,
        tenant: str,
        now: datetime,
        correlation_id: str | None = None,
        business_key: str | None = None,
    ) -> WaitBinding | None:
        cid = correlation_id
        if cid is None and business_key is not None:
            cid = self._business_keys.get((tenant, business_key))
        return self._live(cid, tenant=tenant, now=now)

    async def unbind(
        self,
        *,
        tenant: str,
        correlation_id: str,
        business_key: str | None,
        deadline: datetime | None = None,  # a hint this index needs no use of
    ) -> None:
        found = self._waits.get(correlation_id)
        if found is None or found[0].tenant != tenant:
            return
        del self._waits[correlation_id]
        # Only the pointer that still names this wait: a newer wait may own the key.
        if business_key and self._business_keys.get((tenant, business_key)) == correlation_id:
            del self._business_keys[(tenant, business_key)]

    async def due_deadlines(self, *, now: datetime, limit: int) -> list[WaitBinding]:
        now_ms = to_ms(now)
        for cid in [c for c, (_, expires) in self._waits.items() if expires <= now_ms]:
            del self._waits[cid]  # past deadline + grace: collected, as a Redis TTL would
        due = [b for b, _ in self._waits.values() if to_ms(b.deadline) <= now_ms]
        return sorted(due, key=lambda b: b.deadline)[:limit]
