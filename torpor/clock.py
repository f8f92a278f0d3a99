"""Time as a parameter: code that needs "now" takes a Clock, tests pass a ManualClock."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta


class SystemClock:
    def now(self) -> datetime:
        return datetime.now(UTC)


class ManualClock:
    """A clock that moves only when told to."""

    def __init__(self, start: datetime | None = None) -> None:
        # The indexes decide expiry by the ``now`` they are given, so any start works for
        # them; the default is the real now only because tests check outbound signatures
        # with third-party verifiers that read the wall clock.
        self._now = start or datetime.now(UTC)

    def now(self) -> datetime:
        return self._now

    def advance(self, seconds: float) -> datetime:
        self._now += timedelta(seconds=seconds)
        return self._now

    def set(self, value: datetime) -> None:
        self._now = value


def to_ms(value: datetime) -> int:
    return int(value.timestamp() * 1000)


def from_ms(value: int) -> datetime:
    return datetime.fromtimestamp(value / 1000, tz=UTC)


def trunc_ms(value: datetime) -> datetime:
    """Millisecond precision, as the indexes store times: a value read back compares equal."""
    return value.replace(microsecond=value.microsecond // 1000 * 1000)
