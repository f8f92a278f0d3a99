"""Compact text encoding of a WaitBinding, shared by the Redis and SQLite indexes.

A bound wait is the index's hottest and most numerous entry, so it is stored as one short
``|``-separated string rather than JSON (the target is ≤ 300 bytes of Redis memory per
bound wait, everything included). Times are base-36 milliseconds. The business key goes
last because it is the only field that may itself contain ``|``.
"""

from __future__ import annotations

from dataclasses import dataclass

from torpor.clock import from_ms, to_ms
from torpor.errors import InvalidKey
from torpor.ports import WaitBinding

_VERSION = "2"
_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"


def _b36(value: int) -> str:
    out = []
    while True:
        value, rem = divmod(value, 36)
        out.append(_DIGITS[rem])
        if value == 0:
            return "".join(reversed(out))


@dataclass(frozen=True, slots=True)
class StoredBinding:
    binding: WaitBinding
    expires_ms: int  # the entry's logical TTL: deadline + grace


def encode_binding(binding: WaitBinding, *, expires_ms: int) -> str:
    fixed = (binding.tenant, binding.session_id, binding.wait_id, binding.step_id)
    if any("|" in part for part in fixed):
        raise InvalidKey("tenant, session, wait and step ids may not contain '|'")
    return "|".join(
        (
            _VERSION,
            *fixed[:3],
            str(binding.epoch),
            binding.step_id,
            _b36(to_ms(binding.deadline)),
            _b36(expires_ms),
            binding.business_key or "",
        )
    )


def decode_binding(correlation_id: str, raw: str) -> StoredBinding | None:
    """None for anything unreadable: a damaged index entry is a miss, never a crash
    (the caller falls back to the durable correlation record)."""
    parts = raw.split("|", 8)
    if len(parts) != 9 or parts[0] != _VERSION:
        return None
    _, tenant, session_id, wait_id, epoch, step_id, deadline, expires, business_key = parts
    try:
        binding = WaitBinding(
            tenant=tenant,
            correlation_id=correlation_id,
            session_id=session_id,
            wait_id=wait_id,
            epoch=int(epoch),
            step_id=step_id,
            deadline=from_ms(int(deadline, 36)),
            business_key=business_key or None,
        )
        return StoredBinding(binding, int(expires, 36))
    except ValueError:
        return None
