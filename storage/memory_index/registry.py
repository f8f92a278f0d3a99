"""The session registry in memory: last generation wins, listings newest first."""

from __future__ import annotations

from torpor.lifecycle import SessionState
from torpor.ports import SessionEntry, SessionPage


class MemorySessionRegistry:
    def __init__(self) -> None:
        self._sessions: dict[str, tuple[str, SessionState, int]] = {}  # id → tenant, state, gen
        super().__init__()

    async def record_session(
        self, *, tenant: str, session_id: str, state: SessionState, generation: int
    ) -> bool:
        current = self._sessions.get(session_id)
        if current is not None:
            if current[2] > generation:
                return False  # last generation wins: a late repair never puts an old state back
            tenant = tenant or current[0]  # "" (not known to the caller) keeps the one held
        self._sessions[session_id] = (tenant, state, generation)
        return True

    async def lift_quarantine(
        self,
        *,
        tenant: str,
        session_id: str,
        state: SessionState,
        generation: int,
        quarantined_at: int | None = None,
    ) -> bool:
        current = self._sessions.get(session_id)
        if current is None or current[1] is not SessionState.QUARANTINED:
            return False  # only over a QUARANTINED
        if quarantined_at is None and current[2] > generation:
            return False  # ... no newer
        if quarantined_at is not None and current[2] != quarantined_at:
            return False  # ... or the very one the operator's retry read
        if current[0] and current[0] != tenant:
            return False  # ... under the tenant it names, if it names one
        self._sessions[session_id] = (tenant, state, generation)
        return True

    async def record_poison(self, *, tenant: str, session_id: str, generation: int) -> int:
        current = self._sessions.get(session_id)
        if current is not None:
            generation = max(generation, current[2])  # over any state, never back
            # A caller that does not know the tenant ("") leaves the one held: the
            # session stays listed under it, and its tenant can still see it.
            tenant = tenant or current[0]
        self._sessions[session_id] = (tenant, SessionState.QUARANTINED, generation)
        return generation

    async def session_entry(self, session_id: str) -> SessionEntry | None:
        current = self._sessions.get(session_id)
        return None if current is None else SessionEntry(*current)

    async def quarantine_generation(self, session_id: str) -> int | None:
        current = self._sessions.get(session_id)
        if current is None or current[1] is not SessionState.QUARANTINED:
            return None
        return current[2]

    async def forget_session(self, *, tenant: str, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    async def session_states(self, session_ids: list[str]) -> dict[str, SessionState]:
        return {sid: self._sessions[sid][1] for sid in session_ids if sid in self._sessions}

    async def session_generation(self, session_id: str) -> int | None:
        current = self._sessions.get(session_id)
        return None if current is None else current[2]

    async def list_sessions(
        self, *, tenant: str, state: SessionState | None, cursor: str | None, limit: int
    ) -> SessionPage:
        ids = sorted(
            (
                sid
                for sid, (t, s, _) in self._sessions.items()
                if t == tenant and state in (None, s) and (cursor is None or sid < cursor)
            ),
            reverse=True,
        )
        page = ids[:limit]
        return SessionPage(page, page[-1] if len(ids) > limit else None)
