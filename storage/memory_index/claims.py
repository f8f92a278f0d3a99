"""Replay nonces and idempotency keys in memory: first claim wins until it expires."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from storage.memory_index.waits import MemoryWaits, ms
from torpor.clock import to_ms
from torpor.ports import Admission, IdempotencyRecord, IdempotencyStatus


@dataclass(slots=True)
class _Claim:
    session_id: str
    fingerprint: str
    status: IdempotencyStatus
    expires_ms: int


class MemoryClaims(MemoryWaits):
    def __init__(self) -> None:
        self._nonces: dict[tuple[str, str], int] = {}  # (scope, nonce) → expires ms
        self._claims: dict[tuple[str, str], _Claim] = {}  # (tenant, key) → claim
        super().__init__()

    async def admit(
        self,
        *,
        claims: list[tuple[str, str]],
        ttl: timedelta,
        now: datetime,
        tenant: str,
        correlation_id: str | None,
        business_key: str | None,
    ) -> Admission:
        now_ms = to_ms(now)
        # All or none: a replay must not consume one claim of a pair and fail on the other.
        if any(self._nonces.get(claim, 0) > now_ms for claim in claims):
            return Admission(False, None)
        for claim in claims:
            self._nonces[claim] = now_ms + ms(ttl)
        binding = await self.resolve(
            tenant=tenant, now=now, correlation_id=correlation_id, business_key=business_key
        )
        return Admission(True, binding)

    async def release_nonce(self, *, scope: str, nonce: str) -> None:
        self._nonces.pop((scope, nonce), None)

    async def holds_nonce(self, *, scope: str, nonce: str, now: datetime) -> bool:
        return self._nonces.get((scope, nonce), 0) > to_ms(now)

    async def claim_idempotency(
        self,
        *,
        tenant: str,
        key: str,
        fingerprint: str,
        session_id: str,
        ttl: timedelta,
        now: datetime,
    ) -> IdempotencyRecord:
        now_ms = to_ms(now)
        held = self._claims.get((tenant, key))
        if held is not None and held.expires_ms > now_ms:
            return IdempotencyRecord(key, held.session_id, held.fingerprint, held.status, False)
        status = IdempotencyStatus.IN_PROGRESS
        self._claims[(tenant, key)] = _Claim(session_id, fingerprint, status, now_ms + ms(ttl))
        return IdempotencyRecord(key, session_id, fingerprint, status, True)

    async def finish_idempotency(
        self, *, tenant: str, key: str, ttl: timedelta, now: datetime
    ) -> None:
        held = self._claims.get((tenant, key))
        if held is not None:
            held.status = IdempotencyStatus.DONE
            held.expires_ms = to_ms(now) + ms(ttl)

    async def release_idempotency(self, *, tenant: str, key: str) -> None:
        self._claims.pop((tenant, key), None)
