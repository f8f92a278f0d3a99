"""Lay the slowest one-at-a-time webhooks beside the machine's slow flushes.

    perf trace -T -a -e fdatasync,fsync,syncfs --duration 1.5 -o /tmp/flushes.txt &
    .venv/bin/python bench/bench_ingress.py --proxy haproxy --samples /tmp/samples.jsonl
    kill %1
    .venv/bin/python bench/tails.py /tmp/samples.jsonl /tmp/flushes.txt

A p99 of a few hundred webhooks is the third or fourth slowest: a handful of events
decide it. ``bench_ingress.py --samples`` writes each one-at-a-time webhook with the
``CLOCK_MONOTONIC`` millisecond it was sent at; ``perf trace -T`` stamps each syscall it
shows with the same clock (to about 2 ms here). For each pass this prints the median and
p99, the slowest webhooks with every slow call (any process, named from the bench's own
list of them) that overlapped their span, and how many webhooks of the pass had one
beside them at all. Reads a trace of any syscalls, not only flushes.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

# "12345.678 ( 3.210 ms): ray::IDLE/4321 fdatasync(fd: 9) = 0"
_CALL = re.compile(r"\s*([\d.]+) \(\s*([\d.]+) ms\): (\S+)/(\d+) (\w+)\(")
_UNFINISHED_MS = 1e6  # perf prints a call still running at its end as about 2**64 ns
_SLACK_MS = 2.0  # perf's clock against CLOCK_MONOTONIC, measured here


@dataclass(frozen=True)
class Call:
    at_ms: float
    took_ms: float
    pid: int
    comm: str
    name: str


@dataclass(frozen=True)
class Sample:
    run: str
    kind: str
    sent_ms: float
    accept_ms: float
    step_ms: float | None
    steal_ms: float | None = None  # the hypervisor's steal from this send to the next

    @property
    def span_ms(self) -> float:
        return self.step_ms if self.step_ms is not None else self.accept_ms


def read_calls(path: Path) -> list[Call]:
    calls = []
    for line in path.read_text(errors="replace").splitlines():
        found = _CALL.match(line)
        if found is None or float(found[2]) >= _UNFINISHED_MS:
            continue
        at, took, comm, pid, name = found.groups()
        calls.append(Call(float(at), float(took), int(pid), comm, name))
    return calls


def read_samples(path: Path) -> tuple[list[Sample], dict[int, str]]:
    samples, names = [], {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if "processes" in row:
            names.update({int(pid): name for pid, name in row["processes"].items()})
            continue
        samples.append(
            Sample(
                row["pass"],
                row["kind"],
                row["sent_ms"],
                row["accept_ms"],
                row.get("step_ms"),
                row.get("steal_ms"),
            )
        )
    return samples, names


def by_pass(samples: list[Sample]) -> dict[tuple[str, str], list[Sample]]:
    """The samples of each pass (its run and kind), in the order the passes ran."""
    passes: dict[tuple[str, str], list[Sample]] = {}
    for sample in samples:
        passes.setdefault((sample.run, sample.kind), []).append(sample)
    return passes


def beside(sample: Sample, calls: list[Call]) -> list[Call]:
    """The calls that ran at some point while ``sample`` was in flight."""
    start, end = sample.sent_ms - _SLACK_MS, sample.sent_ms + sample.span_ms + _SLACK_MS
    return [c for c in calls if c.at_ms < end and c.at_ms + c.took_ms > start]


def stolen(group: list[Sample], i: int) -> str:
    """The steal counted from this webhook's send to the next's, and in the next span
    (steal is counted at the tick after it happened), as a note; empty if none."""
    spans = [s.steal_ms for s in group[i : i + 2] if s.steal_ms]
    return f" stolen {'+'.join(f'{ms:.0f}' for ms in spans)} ms;" if spans else ""


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def report(samples: list[Sample], calls: list[Call], names: dict[int, str], worst: int) -> None:
    def who(call: Call) -> str:  # perf names a thread by its id and its own short name
        return f"{names.get(call.pid, call.comm).strip()} ({call.pid}) {call.name}"

    for (run, kind), group in by_pass(samples).items():
        accept = [s.accept_ms for s in group]
        line = f"{run}, {kind} (n={len(group)}): 202 p50 {percentile(accept, 0.5):.1f} ms"
        line += f", p99 {percentile(accept, 0.99):.1f} ms"
        steps = [s.step_ms for s in group if s.step_ms is not None]
        if steps:
            line += f"; step p50 {percentile(steps, 0.5):.1f} ms, p99 "
            line += f"{percentile(steps, 0.99):.1f} ms"
        print(line)
        slowest = sorted(enumerate(group), key=lambda item: -item[1].span_ms)[:worst]
        for i, s in slowest:
            step = f", step {s.step_ms:.1f}" if s.step_ms is not None else ""
            near = "; ".join(f"{who(c)} {c.took_ms:.1f} ms" for c in beside(s, calls))
            where = f"sent {i + 1}th:{stolen(group, i)}"
            print(f"  202 {s.accept_ms:5.1f}{step} ms, {where} {near or '-'}")
        if calls:
            hit = sum(1 for s in group if beside(s, calls))
            print(f"  with a slow call beside them: {hit} of {len(group)}")
        if any(s.steal_ms is not None for s in group):
            hit = sum(1 for i in range(len(group)) if stolen(group, i))
            print(f"  with the hypervisor's steal in their span or the next: {hit} of {len(group)}")
    if samples:
        start = min(s.sent_ms for s in samples)
        end = max(s.sent_ms + s.span_ms for s in samples)
        during = [c for c in calls if start <= c.at_ms <= end]
        counted = Counter(who(c) for c in during).most_common(8)
        print(f"slow calls while the passes ran ({(end - start) / 1000:.1f} s): {len(during)}")
        for name, n in counted:
            print(f"  {n:4d} {name}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("samples", type=Path, help="bench_ingress.py --samples file")
    parser.add_argument(
        "trace", type=Path, nargs="?", help="perf trace -T output (without: the steal alone)"
    )
    parser.add_argument("--worst", type=int, default=6, help="slowest webhooks shown per pass")
    args = parser.parse_args()
    samples, names = read_samples(args.samples)
    if not samples:
        sys.exit(f"no samples in {args.samples}")
    report(samples, read_calls(args.trace) if args.trace else [], names, args.worst)


if __name__ == "__main__":
    main()
