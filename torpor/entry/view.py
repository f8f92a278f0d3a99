"""The demo's live terminal view: a few lines redrawn in place, never a log flood."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, TextIO

STATES = [
    "PENDING",
    "RUNNING",
    "SUSPENDED",
    "RESUMING",
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMED_OUT",
]


@dataclass
class Frame:
    title: str
    elapsed_s: float
    total: int
    by_state: dict[str, int]
    live_actors: int
    max_actors_all_waiting: int | None
    responses: dict[str, dict[str, int]] = field(default_factory=dict)
    replans: int = 0
    released: bool = False


def _count(responses: dict[str, dict[str, int]], kind: str, status: str | None = None) -> int:
    codes = responses.get(kind, {})
    return sum(n for s, n in codes.items() if status is None or s == status)


def render(frame: Frame, width: int = 30) -> list[str]:
    done = sum(frame.by_state.get(s, 0) for s in ("COMPLETED", "FAILED", "CANCELLED", "TIMED_OUT"))
    filled = int(width * done / frame.total) if frame.total else width
    bar = "#" * filled + "." * (width - filled)
    states = "  ".join(f"{s} {frame.by_state.get(s, 0)}" for s in STATES)
    r = frame.responses
    waited = "-" if frame.max_actors_all_waiting is None else str(frame.max_actors_all_waiting)
    phase = "decisions flowing" if frame.released else "finance director busy: every session asleep"
    return [
        frame.title,
        f"  sessions  [{bar}] {done}/{frame.total}   {states}",
        f"  actors    live session actors {frame.live_actors}   "
        f"(fewest while every session slept: {waited})   {phase}",
        f"  webhooks  accepted {_count(r, 'decision', '202') + _count(r, 'capability', '202')}"
        f"   duplicates absorbed {_count(r, 'duplicate', '200')}"
        f"   late/stale absorbed {_count(r, 'late') + _count(r, 'stale')}"
        f"   forged rejected {_count(r, 'forged', '401')}"
        f"   replays rejected {_count(r, 'replay', '409') + _count(r, 'capability_reuse', '409')}",
        f"  guard     drifts caught and re-planned {frame.replans}"
        f"   elapsed {frame.elapsed_s:.0f} s",
    ]


class Screen:
    """Redraws in place on a terminal; prints a line now and then otherwise."""

    def __init__(self, out: TextIO = sys.stdout) -> None:
        self.out = out
        self.tty = out.isatty()
        self._drawn = 0
        self._last_plain = -1e9

    def draw(self, lines: list[str], *, elapsed_s: float) -> None:
        if self.tty:
            if self._drawn:
                self.out.write(f"\x1b[{self._drawn}F")
            for line in lines:
                self.out.write("\x1b[2K" + line + "\n")
            self._drawn = len(lines)
        elif elapsed_s - self._last_plain >= 10:
            self.out.write(" | ".join(line.strip() for line in lines[1:3]) + "\n")
            self._last_plain = elapsed_s
        self.out.flush()

    def summary(self, rows: list[tuple[str, str, Any]]) -> None:
        width = max(len(r[0]) for r in rows)
        self.out.write("\n")
        for label, verdict, detail in rows:
            self.out.write(f"  {label:<{width}}  {verdict:4}  {detail}\n")
        self.out.flush()
