"""Compact text encoding of a WaitBinding, shared by the Redis and SQLite indexes.

A bound wait is the index's hottest and most numerous entry, so it is stored as one short
``|``-separated string rather than JSON (the target is ≤ 300 bytes of Redis memory per
bound wait, everything included), short enough (≤ 64 bytes for ids of usual length) for
Redis to keep the hash buckets holding it in the compact listpack encoding. Times are
base-36 milliseconds; the expiry is stored as seconds after the deadline.
"""

from __future__ import annotations

from dataclasses import dataclass

from torpor.clock import from_ms, to_ms
from torpor.errors import InvalidKey
from torpor.ports import WaitBinding

# The encoding's version, its first field (the index's unbind script reads it too).
VERSION = "3"
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
    fixed = (binding.tenant, binding.session_id, binding.step_id)
    if any("|" in part for part in fixed):
        raise InvalidKey("tenant, session and step ids may not contain '|'")
    deadline = to_ms(binding.deadline)
    if deadline < 0:  # base 36 here has no sign: a negative number was divided for ever
        raise InvalidKey("a wait's deadline before 1970 cannot be indexed")
    return "|".join(
        (
            VERSION,
            binding.tenant,
            binding.session_id,
            str(binding.epoch),
            binding.step_id,
            _b36(deadline),
            _b36(max(0, (expires_ms - deadline) // 1000)),
        )
    )


def decode_binding(correlation_id: str, raw: str) -> StoredBinding | None:
    """None for anything unreadable: a damaged index entry is a miss, never a crash
    (the caller falls back to the durable correlation record)."""
    parts = raw.split("|")
    if len(parts) != 7 or parts[0] != VERSION:
        return None
    _, tenant, session_id, epoch, step_id, deadline, grace = parts
    try:
        deadline_ms = int(deadline, 36)
        binding = WaitBinding(
            tenant=tenant,
            correlation_id=correlation_id,
            session_id=session_id,
            epoch=int(epoch),
            step_id=step_id,
            deadline=from_ms(deadline_ms),
        )
        return StoredBinding(binding, deadline_ms + int(grace, 36) * 1000)
    except ValueError:
        return None
