"""Time as a parameter: code that needs "now" takes a Clock, tests pass a ManualClock."""

from __future__ import annotations

from datetime import datetime
from typing import Protocol


class Clock(Protocol):
    def now(self) -> datetime: ...
