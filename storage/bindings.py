"""Compact text encoding of a WaitBinding, shared by the Redis and SQLite indexes.

A bound wait is the index's hottest and most numerous entry, so it is stored as one short
``|``-separated string rather than JSON (the target is ≤ 300 bytes of Redis memory per
bound wait, keys included). The business key goes last because it is the only field
that may itself contain ``|``.
"""

from __future__ import annotations

from torpor.clock import from_ms, to_ms
from torpor.errors import InvalidKey
from torpor.ports import WaitBinding

_VERSION = "1"


def encode_binding(binding: WaitBinding) -> str:
    fixed = (binding.tenant, binding.session_id, binding.wait_id, binding.step_id)
    if any("|" in part for part in fixed):
        raise InvalidKey("tenant, session, wait and step ids may not contain '|'")
    return "|".join(
        (
            _VERSION,
            *fixed[:3],
            str(binding.epoch),
            binding.step_id,
            str(to_ms(binding.deadline)),
            binding.business_key or "",
        )
    )


def decode_binding(correlation_id: str, raw: str) -> WaitBinding | None:
    """None for anything unreadable: a damaged index entry is a miss, never a crash
    (the caller falls back to the durable correlation record)."""
    parts = raw.split("|", 7)
    if len(parts) != 8 or parts[0] != _VERSION:
        return None
    _, tenant, session_id, wait_id, epoch, step_id, deadline_ms, business_key = parts
    try:
        return WaitBinding(
            tenant=tenant,
            correlation_id=correlation_id,
            session_id=session_id,
            wait_id=wait_id,
            epoch=int(epoch),
            step_id=step_id,
            deadline=from_ms(int(deadline_ms)),
            business_key=business_key or None,
        )
    except ValueError:
        return None
