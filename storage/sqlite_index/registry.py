"""The session registry in SQLite: one row per session, indexed by tenant and state."""

from __future__ import annotations

import sqlite3
from typing import Any

from storage.sqlite_index.connection import SqliteConnection
from torpor.lifecycle import SessionState
from torpor.ports import SessionEntry, SessionPage


class SqliteSessionRegistry(SqliteConnection):
    async def record_session(
        self, *, tenant: str, session_id: str, state: SessionState, generation: int
    ) -> bool:
        # Last generation wins: an older snapshot's state never overwrites a newer one.
        # The tenant is the one named, unless that is "" (the quarantine of a snapshot
        # whose header did not decode, its tenant unknown), which keeps the row's: a row
        # recorded under "" takes its tenant when the restored session is recorded. The
        # row count says whether it wrote: 0 when the upsert's WHERE kept a newer row.
        written = await self._run(
            lambda c: (
                c.execute(
                    "INSERT INTO sessions VALUES (?,?,?,?) ON CONFLICT(session_id) "
                    "DO UPDATE SET state=excluded.state, generation=excluded.generation, "
                    "tenant=COALESCE(NULLIF(excluded.tenant, ''), tenant) "
                    "WHERE excluded.generation >= sessions.generation",
                    (session_id, tenant, state.value, generation),
                ).rowcount
            )
        )
        return bool(written)

    async def lift_quarantine(
        self,
        *,
        tenant: str,
        session_id: str,
        state: SessionState,
        generation: int,
        quarantined_at: int | None = None,
    ) -> bool:
        # One statement, so the check and the write are one step: only over a QUARANTINED
        # no newer than ``generation``, or (the operator's retry) at exactly the generation
        # it read, so that a quarantine recorded since its read stays; and only under the
        # tenant the row names, unless that is "" (a poison quarantine's, unknown).
        aside = SessionState.QUARANTINED.value
        lifted = await self._run(
            lambda c: (
                c.execute(
                    "UPDATE sessions SET state=?, generation=?, tenant=? "
                    "WHERE session_id=? AND state=? AND tenant IN (?, '') "
                    "AND (generation = ? OR (? IS NULL AND generation <= ?))",
                    (
                        state.value,
                        generation,
                        tenant,
                        session_id,
                        aside,
                        tenant,
                        quarantined_at,
                        quarantined_at,
                        generation,
                    ),
                ).rowcount
            )
        )
        return bool(lifted)

    async def record_poison(self, *, tenant: str, session_id: str, generation: int) -> int:
        # One statement: over any state, at the newer of the two generations, the tenant
        # as ``record_session`` keeps it; RETURNING says which generation it kept.
        row = await self._run(
            lambda c: c.execute(
                "INSERT INTO sessions VALUES (?,?,?,?) ON CONFLICT(session_id) "
                "DO UPDATE SET state=excluded.state, "
                "generation=MAX(excluded.generation, sessions.generation), "
                "tenant=COALESCE(NULLIF(excluded.tenant, ''), sessions.tenant) "
                "RETURNING generation",
                (session_id, tenant, SessionState.QUARANTINED.value, generation),
            ).fetchone()
        )
        return int(row[0])

    async def session_entry(self, session_id: str) -> SessionEntry | None:
        def op(c: sqlite3.Connection) -> SessionEntry | None:
            query = "SELECT tenant, state, generation FROM sessions WHERE session_id = ?"
            row = c.execute(query, (session_id,)).fetchone()
            return None if row is None else SessionEntry(row[0], SessionState(row[1]), int(row[2]))

        return await self._run(op, write=False)

    async def quarantine_generation(self, session_id: str) -> int | None:
        def op(c: sqlite3.Connection) -> int | None:
            query = "SELECT generation FROM sessions WHERE session_id = ? AND state = ?"
            row = c.execute(query, (session_id, SessionState.QUARANTINED.value)).fetchone()
            return None if row is None else int(row[0])

        # On the one writer thread, behind the calls asked for before it in this turn
        # (``SessionRegistry.quarantine_generation``).
        return await self._run(op, write=False)

    async def forget_session(self, *, tenant: str, session_id: str) -> None:
        await self._run(
            lambda c: c.execute(
                # Or under tenant "": a poison quarantine whose header never read.
                "DELETE FROM sessions WHERE session_id=? AND tenant IN (?, '')",
                (session_id, tenant),
            )
        )

    async def session_states(self, session_ids: list[str]) -> dict[str, SessionState]:
        def op(c: sqlite3.Connection) -> dict[str, SessionState]:
            out: dict[str, SessionState] = {}
            for start in range(0, len(session_ids), 500):  # stay under SQLite's variable limit
                chunk = session_ids[start : start + 500]
                marks = ",".join("?" * len(chunk))
                query = f"SELECT session_id, state FROM sessions WHERE session_id IN ({marks})"  # noqa: S608
                out.update({sid: SessionState(st) for sid, st in c.execute(query, chunk)})
            return out

        return await self._run(op, write=False)

    async def session_generation(self, session_id: str) -> int | None:
        def op(c: sqlite3.Connection) -> int | None:
            query = "SELECT generation FROM sessions WHERE session_id = ?"
            row = c.execute(query, (session_id,)).fetchone()
            return None if row is None else int(row[0])

        return await self._run(op, write=False)

    async def list_sessions(
        self, *, tenant: str, state: SessionState | None, cursor: str | None, limit: int
    ) -> SessionPage:
        clauses, args = ["tenant=?"], [tenant]
        if state is not None:
            clauses.append("state=?")
            args.append(state.value)
        if cursor:
            clauses.append("session_id<?")
            args.append(cursor)
        query = (
            f"SELECT session_id FROM sessions WHERE {' AND '.join(clauses)} "  # noqa: S608
            "ORDER BY session_id DESC LIMIT ?"
        )
        params: list[Any] = [*args, limit + 1]
        rows = await self._run(lambda c: c.execute(query, params).fetchall(), write=False)
        ids = [r[0] for r in rows[:limit]]
        return SessionPage(ids, ids[-1] if len(rows) > limit else None)
