"""Bytes written per commit as a session ages (issue 13, target 6: bounded snapshots).

    .venv/bin/python bench/bench_snapshots.py [--steps 1000]

A synthetic session takes ``--steps`` agent steps; each step appends what a real step
appends (an assistant tool call, the tool's result message, a tool-log entry and a
processed event id) and commits through ``ObjectSnapshots`` on the in-memory object store.
A counting wrapper around the store measures the bytes of every PUT of that commit (the
snapshot itself plus any history chunk sealed by it). Figures are from one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from storage.memory_store import MemoryObjectStore  # noqa: E402
from storage.snapshots import ObjectSnapshots  # noqa: E402
from tests.support.factories import NOW, snapshot  # noqa: E402
from torpor.ids import tool_call_key  # noqa: E402
from torpor.lifecycle import SessionState  # noqa: E402
from torpor.models import Message, ToolCall, ToolCallFunction, ToolLogEntry  # noqa: E402
from torpor.ports import ListPage, StoredObject  # noqa: E402

CHECKPOINTS = (10, 100, 1000, 3000, 10000)
MEAN_OF = 64  # one chunk of commits: a sealing commit neither hides nor fakes the trend
# Flat: a commit at step 1,000 writes at most 1.5x one at step 100 (before chunks: 8.6x;
# what still grows is the list of chunk digests, 15 B per 64 sealed items).
FLAT_RATIO_TARGET = 1.5


class CountingStore:
    """The in-memory store, counting the bytes every write sends."""

    def __init__(self) -> None:
        self.inner = MemoryObjectStore()
        self.written = 0
        self.puts = 0

    @property
    def url(self) -> str:
        return self.inner.url

    async def get(self, key: str, *, max_bytes: int | None = None) -> StoredObject:
        return await self.inner.get(key, max_bytes=max_bytes)

    async def put(self, key: str, data: bytes) -> str:
        self._count(data)
        return await self.inner.put(key, data)

    async def put_if_absent(self, key: str, data: bytes, *, durable: bool = True) -> str:
        self._count(data)
        return await self.inner.put_if_absent(key, data, durable=durable)

    async def put_if_match(self, key: str, data: bytes, *, etag: str) -> str:
        self._count(data)
        return await self.inner.put_if_match(key, data, etag=etag)

    async def list(
        self, prefix: str, *, start_after: str | None = None, limit: int = 1000
    ) -> ListPage:
        return await self.inner.list(prefix, start_after=start_after, limit=limit)

    async def delete(self, key: str) -> None:
        await self.inner.delete(key)

    async def delete_if_match(self, key: str, *, etag: str) -> bool:
        return await self.inner.delete_if_match(key, etag=etag)

    async def close(self) -> None:
        return None

    def _count(self, data: bytes) -> None:
        self.written += len(data)
        self.puts += 1


def one_step(i: int, sid: str) -> tuple[list[Message], str, ToolLogEntry]:
    call_id = f"call_{i:05d}"
    call = Message(
        role="assistant",
        tool_calls=[
            ToolCall(
                id=call_id,
                function=ToolCallFunction(
                    name="extract_fields",
                    arguments=json.dumps({"doc": f"PR-{i:05d}", "fields": ["vendor", "amount"]}),
                ),
            )
        ],
    )
    result = Message(
        role="tool",
        tool_call_id=call_id,
        content=json.dumps({"vendor": "Hengda Steel", "amount": 1000.0 + i, "currency": "CNY"}),
    )
    key = tool_call_key(sid, i, call_id)
    entry = ToolLogEntry(
        key=key,
        tool_name="extract_fields",
        tool_call_id=call_id,
        step=i,
        result={"ok": True, "amount": 1000.0 + i},
        completed_at=NOW,
    )
    return [call, result], f"oa:evt-{i:08d}", entry


async def run(steps: int) -> dict[int, tuple[int, int]]:
    store = CountingStore()
    snapshots = ObjectSnapshots(store)
    snap = await snapshots.create(snapshot(state=SessionState.RUNNING))
    per_commit: dict[int, tuple[int, int]] = {}
    window: list[int] = []
    for i in range(1, steps + 1):
        msgs, event, entry = one_step(i, snap.session_id)
        draft = snap.model_copy(
            update={
                "messages": [*snap.messages, *msgs],
                "processed_events": [*snap.processed_events, event],
                "tool_log": {**snap.tool_log, entry.key: entry},
                "step": i,
            }
        )
        before = store.written
        snap = await snapshots.save(draft, expected_generation=snap.generation)
        window.append(store.written - before)
        if i in CHECKPOINTS or i == steps:
            # Chunks are sealed now and then: report the mean over the last commits as
            # well as this one, so a sealing commit does not hide or fake the trend.
            per_commit[i] = (window[-1], sum(window[-MEAN_OF:]) // len(window[-MEAN_OF:]))
    loaded = await snapshots.load(snap.session_id)
    assert loaded.messages == snap.messages and loaded.tool_log == snap.tool_log
    assert loaded.processed_events == snap.processed_events
    return per_commit


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=1000)
    args = parser.parse_args()
    t0 = time.perf_counter()
    figures = await run(args.steps)
    print(
        f"bytes written per commit ({args.steps} steps, one run, {time.perf_counter() - t0:.1f} s)"
    )
    for step, (last, mean) in figures.items():
        print(
            f"  step {step:>5}: this commit {last:>7} B, "
            f"mean of the last {MEAN_OF} commits {mean:>7} B"
        )
    if 100 in figures and max(figures) > 100:
        ratio = figures[max(figures)][1] / figures[100][1]
        verdict = "met" if ratio <= FLAT_RATIO_TARGET else "NOT met"
        print(
            f"  growth of the mean, step {max(figures)} over step 100: {ratio:.2f}x "
            f"(target: flat, <= {FLAT_RATIO_TARGET}x) -> {verdict}"
        )
    else:
        print(
            f"  growth not judged: it compares a later step with step 100 (--steps > 100; "
            f"target: flat, <= {FLAT_RATIO_TARGET}x)"
        )


if __name__ == "__main__":
    asyncio.run(main())
