"""The compact binding encoding the Redis and SQLite indexes share (``storage.bindings``)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from storage.bindings import decode_binding, encode_binding
from torpor.clock import to_ms
from torpor.errors import InvalidKey
from torpor.ports import WaitBinding


def binding(deadline: datetime) -> WaitBinding:
    return WaitBinding(
        tenant="acme",
        correlation_id="c1",
        session_id="s_1",
        epoch=1,
        step_id="2",
        deadline=deadline,
    )


def test_a_deadline_round_trips() -> None:
    b = binding(datetime(2030, 1, 1, tzinfo=UTC))
    stored = decode_binding("c1", encode_binding(b, expires_ms=to_ms(b.deadline) + 3_600_000))
    assert stored is not None and stored.binding == b


def test_a_deadline_before_1970_is_refused_not_encoded_for_ever() -> None:
    """A negative time in base 36 never reached zero: the bind looped, growing a list,
    until the process ran out of memory (its event loop stopped meanwhile)."""
    b = binding(datetime(1969, 12, 31, tzinfo=UTC))
    with pytest.raises(InvalidKey, match="before 1970"):
        encode_binding(b, expires_ms=to_ms(b.deadline + timedelta(days=7)))
