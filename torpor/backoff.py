"""Retry delays: exponential, capped, with jitter so that a fleet does not retry in step."""

from __future__ import annotations

import random


def backoff_s(
    attempt: int,
    *,
    base_s: float,
    cap_s: float,
    jitter: float = 0.2,
    rng: random.Random | None = None,
) -> float:
    """Delay before retry number ``attempt`` (0-based): base·2^attempt, capped, ±jitter."""
    raw = min(cap_s, base_s * float(1 << min(attempt, 62)))
    r = rng or random
    return max(0.0, raw * (1 + float(r.uniform(-jitter, jitter))))


def schedule_delay_s(
    attempt: int,
    schedule: list[float],
    *,
    jitter: float = 0.2,
    rng: random.Random | None = None,
) -> float | None:
    """Delay from a fixed schedule (e.g. 5 s, 5 min, 30 min …); None once it is exhausted."""
    if attempt >= len(schedule):
        return None
    r = rng or random
    return max(0.0, schedule[attempt] * (1 + float(r.uniform(-jitter, jitter))))
