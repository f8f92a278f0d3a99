"""The one retry-delay policy: capped exponential, jittered so a fleet does not retry in step.

Every retry loop in torpor asks a ``Backoff`` how long to wait before attempt ``n``; none
computes its own delays. The jitter draws from an injectable random source, and tests
can make every delay exact or zero (``fixed``) instead of sleeping or asserting ranges.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

# When set (by ``fixed``), every delay is its un-jittered value times this factor.
_fixed_scale: float | None = None


@dataclass(frozen=True)
class Backoff:
    """Delay before attempt ``n`` (0-based): ``base_s·factor^n`` capped at ``cap_s``, or
    the n-th step of ``schedule`` when one is given; then jittered.

    ``jitter`` is None for full jitter (uniform over [0, delay]) or a fraction ``f`` (uniform over
    delay·[1-f, 1+f]; 0 makes the policy deterministic). ``rng`` is the random source.
    """

    base_s: float = 0.0
    cap_s: float = math.inf
    factor: float = 2.0
    schedule: Sequence[float] = ()
    jitter: float | None = None
    rng: random.Random | None = field(default=None, compare=False, repr=False)

    def exhausted(self, attempt: int) -> bool:
        """True once a fixed schedule has no step for ``attempt`` (never without one)."""
        return bool(self.schedule) and attempt >= len(self.schedule)

    def ceiling_s(self, attempt: int) -> float:
        """The un-jittered delay before ``attempt``."""
        if self.schedule:
            return float(self.schedule[min(attempt, len(self.schedule) - 1)])
        # Capping the exponent first keeps a huge attempt number from overflowing.
        exponent = min(max(attempt, 0), 1024)
        try:
            raw = self.base_s * self.factor**exponent
        except OverflowError:
            raw = math.inf
        return min(self.cap_s, raw)

    def attempt_at(self, elapsed_s: float) -> int:
        """The attempt a run of this policy is at ``elapsed_s`` after its first (attempt
        0, at 0 s): for a caller that keeps time, not a count. Each attempt is taken to
        come at its un-jittered time, give or take half its step, so a jittered one is
        counted as the attempt it was. Once the steps stop growing (the cap, a schedule's
        last step) the rest are counted in one division."""
        attempt, started = 0, 0.0  # ``started``: when ``attempt`` comes, un-jittered
        while True:
            step = self.ceiling_s(attempt)
            if step <= 0.0 or not math.isfinite(step):
                return attempt
            if step == self.ceiling_s(attempt + 1):  # flat from here on
                return attempt + max(0, math.floor((elapsed_s - started) / step + 0.5))
            if elapsed_s < started + step / 2:
                return attempt
            attempt, started = attempt + 1, started + step

    def delay_s(self, attempt: int) -> float:
        ceiling = self.ceiling_s(attempt)
        if _fixed_scale is not None:
            return ceiling * _fixed_scale
        r = self.rng or random
        if self.jitter is None:
            return float(r.uniform(0.0, ceiling))
        return max(0.0, ceiling * (1 + float(r.uniform(-self.jitter, self.jitter))))


@contextmanager
def fixed(scale: float = 1.0) -> Iterator[None]:
    """In tests: every delay is exact (its un-jittered value times ``scale``; 0 means no
    waiting at all) while the block runs."""
    global _fixed_scale
    previous, _fixed_scale = _fixed_scale, scale
    try:
        yield
    finally:
        _fixed_scale = previous
