"""Where the replica's and the pool hosts' threads slept while one webhook at a time ran.

    .venv/bin/python bench/bench_ingress.py --proxy haproxy --offcpu /tmp/offcpu.perf \\
        --samples /tmp/samples.jsonl
    .venv/bin/python bench/offcpu.py /tmp/offcpu.perf [--samples /tmp/samples.jsonl]

A syscall trace says which call was slow, not why; a CPU profile does not see a thread
that is asleep. ``bench_ingress.py --offcpu FILE`` records every context switch of the
machine with its kernel and user stack (``perf record -e sched:sched_switch -g -a -k
mono``) around the one-at-a-time passes, and beside it ``FILE.json``: the pass's window
and the process ids of the replicas and pool hosts. This script reads both and prints,
per process, how long its threads were off the CPU in that window by the state they left
it in (``D``: waiting on the kernel — a lock, a page, a flush; ``R``: preempted; ``S``: a
sleep the thread asked for, its loop's wait included), and the kernel stacks that held
them longest in ``D`` and ``R``. With ``--samples`` (``bench_ingress.py --samples``), the
slowest webhooks each with the longest ``D``/``R`` waits inside their span.

This is how the seventeenth pass found its two tail causes (the descriptor table's growth
waiting an RCU grace period, a new replica's first write reading inode tables from disk),
then with a throwaway copy of the bench.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.tails import Sample, by_pass, read_samples  # noqa: E402

# "ray::ServeRepli  4321/4327  2891.141734: sched:sched_switch: prev_comm=... prev_pid=4327
#  prev_prio=120 prev_state=D ==> next_comm=swapper/1 next_pid=0 next_prio=120"
_SWITCH = re.compile(
    r"^(?P<comm>.+?)\s+(?P<pid>\d+)/(?P<tid>\d+)\s+(?P<at>[\d.]+): sched:sched_switch: "
    r".*\bprev_pid=(?P<prev>\d+) .*\bprev_state=(?P<state>\S+) ==> .*\bnext_pid=(?P<next>\d+)"
)
# Frames every switch goes through: left out of a stack's name.
_SCHEDULER = frozenset({"__schedule", "schedule", "preempt_schedule_common", "__cond_resched"})
FIELDS = "comm,pid,tid,time,event,trace,ip,sym"
_FRAMES = 6  # kernel frames named per stack (the innermost, after the scheduler's own)


@dataclass(frozen=True)
class Switch:
    """A thread leaving the CPU (``pid``/``tid``, in ``state``) and who took it over."""

    at_ms: float
    pid: int
    tid: int
    state: str
    next_tid: int
    stack: tuple[str, ...]


@dataclass(frozen=True)
class OffCpu:
    """One stretch a thread spent off the CPU."""

    pid: int
    tid: int
    state: str
    from_ms: float
    to_ms: float
    stack: tuple[str, ...]

    @property
    def ms(self) -> float:
        return self.to_ms - self.from_ms


@dataclass
class Totals:
    ms: float = 0.0
    count: int = 0
    longest_ms: float = 0.0
    by_state: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def add(self, stretch: OffCpu) -> None:
        self.ms += stretch.ms
        self.count += 1
        self.longest_ms = max(self.longest_ms, stretch.ms)
        self.by_state[stretch.state] += stretch.ms


def parse(text: str) -> list[Switch]:
    """The switches of ``perf script -F`` :data:`FIELDS` output, in the order printed."""
    switches: list[Switch] = []
    head: re.Match[str] | None = None
    frames: list[str] = []

    def close() -> None:
        if head is not None:
            switches.append(
                Switch(
                    at_ms=float(head["at"]) * 1000,
                    pid=int(head["pid"]),
                    tid=int(head["prev"]),
                    state=_state(head["state"]),
                    next_tid=int(head["next"]),
                    stack=_kernel_frames(frames),
                )
            )

    for line in text.splitlines():
        if not line.strip():
            continue
        if line[0].isspace():
            if head is not None:
                frames.append(line.split()[-1] if len(line.split()) > 1 else "")
            continue
        close()
        head, frames = _SWITCH.match(line), []
    close()
    return switches


def _state(raw: str) -> str:
    """``R+`` (preempted, runnable) is ``R``; ``D|K`` and the like keep their first letter."""
    return raw[:1] if raw else "?"


def _kernel_frames(symbols: list[str]) -> tuple[str, ...]:
    """The innermost kernel frames past the scheduler's own, up to the syscall entry."""
    named = []
    for symbol in symbols:
        if symbol in _SCHEDULER:
            continue
        if symbol.startswith(("do_syscall_64", "entry_SYSCALL")) or symbol == "[unknown]":
            break
        named.append(symbol.split("+")[0])
        if len(named) == _FRAMES:
            break
    return tuple(named)


def stretches(
    switches: list[Switch], pids: set[int], window: tuple[float, float] | None = None
) -> list[OffCpu]:
    """Every stretch off the CPU of a thread of ``pids``: from its switch out to the
    switch that put it back, clipped to ``window`` (ms) when given. A thread still off
    at the end of the recording is left out (when it came back is not known)."""
    out: list[OffCpu] = []
    away: dict[int, Switch] = {}
    for switch in switches:
        back = away.pop(switch.next_tid, None)
        if back is not None:
            start, end = back.at_ms, switch.at_ms
            if window is not None:
                start, end = max(start, window[0]), min(end, window[1])
            if end > start:
                out.append(OffCpu(back.pid, back.tid, back.state, start, end, back.stack))
        if switch.pid in pids and switch.tid != 0:
            away[switch.tid] = switch
    return out


def by_stack(found: list[OffCpu], states: str = "DR") -> list[tuple[tuple[str, ...], Totals]]:
    """Stretches in ``states`` summed by their kernel stack, longest total first."""
    totals: dict[tuple[str, ...], Totals] = defaultdict(Totals)
    for stretch in found:
        if stretch.state in states:
            totals[(stretch.state, *stretch.stack)].add(stretch)
    return sorted(totals.items(), key=lambda item: -item[1].ms)


def report(
    found: list[OffCpu], names: dict[int, str], window_ms: float, *, top: int = 8
) -> list[str]:
    """Per process: its threads' time off the CPU by state, then its longest stacks."""
    lines = []
    for pid in sorted({s.pid for s in found}, key=lambda p: names.get(p, "")):
        mine = [s for s in found if s.pid == pid]
        totals = Totals()
        for stretch in mine:
            totals.add(stretch)
        ordered = sorted(totals.by_state.items(), key=lambda x: -x[1])
        states = ", ".join(f"{state} {ms:.0f} ms" for state, ms in ordered)
        lines.append(f"{names.get(pid, '?')} (pid {pid}), {window_ms / 1000:.1f} s: {states}")
        for stack, t in by_stack(mine)[:top]:
            state, frames = stack[0], " <- ".join(stack[1:]) or "(user space)"
            lines.append(
                f"  {state} {t.ms:8.1f} ms in {t.count:5d}, longest {t.longest_ms:6.2f} ms:"
                f" {frames}"
            )
    return lines


def beside_slowest(
    found: list[OffCpu], samples: list[Sample], names: dict[int, str], *, worst: int = 5
) -> list[str]:
    """The slowest webhooks of each pass, each with the longest D/R stretches of the
    watched processes inside its span (sent → step, or → 202 without a step)."""
    lines = []
    for (run, kind), mine in by_pass(samples).items():
        lines.append(f"{run}, {kind}: the {worst} slowest")
        for sample in sorted(mine, key=lambda s: s.span_ms, reverse=True)[:worst]:
            sent, end = sample.sent_ms, sample.sent_ms + sample.span_ms
            inside = sorted(
                (s for s in found if s.state in "DR" and s.to_ms > sent and s.from_ms < end),
                key=lambda s: -s.ms,
            )[:3]
            lines.append(f"  {sample.span_ms:6.1f} ms sent at {sent:.1f}")
            for s in inside:
                frames = " <- ".join(s.stack[:4]) or "(user space)"
                lines.append(
                    f"      {names.get(s.pid, '?')}/{s.tid} {s.state} {s.ms:.2f} ms: {frames}"
                )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recording", type=Path, help="perf.data of bench_ingress.py --offcpu")
    parser.add_argument("--samples", type=Path, help="bench_ingress.py --samples' file")
    parser.add_argument("--top", type=int, default=8, help="stacks per process")
    parser.add_argument("--worst", type=int, default=5, help="slowest webhooks per pass")
    args = parser.parse_args()
    sidecar = args.recording.with_name(args.recording.name + ".json")
    try:
        meta = json.loads(sidecar.read_text())
    except (OSError, ValueError) as exc:
        sys.exit(f"offcpu: cannot read {sidecar} (written by bench_ingress.py --offcpu): {exc}")
    names = {int(pid): name for pid, name in meta["pids"].items()}
    window = (float(meta["from_ms"]), float(meta["to_ms"]))
    script = subprocess.run(
        ["perf", "script", "-i", str(args.recording), "-F", FIELDS],
        capture_output=True,
        text=True,
        check=False,
    )
    if script.returncode != 0:
        sys.exit(f"offcpu: perf script failed: {script.stderr.strip()[-500:]}")
    found = stretches(parse(script.stdout), set(names), window)
    print(*report(found, names, window[1] - window[0], top=args.top), sep="\n")
    if args.samples:
        samples, _ = read_samples(args.samples)
        inside = [s for s in samples if window[0] <= s.sent_ms <= window[1]]
        print(*beside_slowest(found, inside, names, worst=args.worst), sep="\n")


if __name__ == "__main__":
    main()
