"""Where one webhook's time goes: the moment each stage of its path begins or ends.

``bench/profile_gateway.py --timeline`` wraps the coroutines the path goes through
(admission, the snapshot header, the inbox write, the wake timer, the durable writes, and
with ``--resume`` the activation up to the agent's next step) and prints, for each mark,
the median time since the request came in. A profile says what costs CPU; this says what
the sender waits for, stage by stage, which is what the latency targets are about.

Measurement only: the wrappers replace methods on their classes for the process's life.
"""

from __future__ import annotations

import functools
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Coroutine
from typing import Any

Marks = dict[str, float]


class Timeline:
    """The marks of the webhook in progress, and those of every finished one."""

    def __init__(self) -> None:
        self.done: list[Marks] = []
        self._current: Marks = {}

    def start(self) -> None:
        """A new webhook comes in: the last one's marks are kept."""
        if self._current:
            self.done.append(self._current)
        self._current = {"receive": time.perf_counter()}

    def mark(self, name: str) -> None:
        """The first time ``name`` is reached for the current webhook (a stage that runs
        twice, such as a second commit, keeps its first moment)."""
        self._current.setdefault(name, time.perf_counter())

    def wrap(self, owner: type, attr: str, *, before: str = "", after: str = "") -> None:
        """Mark when ``owner.attr`` (a coroutine function) is entered and/or returns."""
        original: Callable[..., Coroutine[Any, Any, Any]] = getattr(owner, attr)

        @functools.wraps(original)
        async def marked(*args: Any, **kwargs: Any) -> Any:
            if before:
                self.mark(before)
            try:
                return await original(*args, **kwargs)
            finally:
                if after:
                    self.mark(after)

        setattr(owner, attr, marked)

    def clear(self) -> None:
        """Forget every webhook so far (the warm-up)."""
        self.done, self._current = [], {}

    def report(self) -> list[str]:
        """One line per mark, in order of its median: ms since the request came in, median
        and 99th percentile (a tail that starts at a stage shows from there on)."""
        runs = [*self.done, self._current] if self._current else self.done
        names = {name for run in runs for name in run}
        rows = []
        for name in names:
            since = sorted((run[name] - run["receive"]) * 1000 for run in runs if name in run)
            p99 = since[min(len(since) - 1, int(len(since) * 0.99))]
            rows.append((statistics.median(since), name, p99, len(since)))
        return [
            f"  {name:<28} p50 {median:6.2f} ms, p99 {p99:6.2f} ms  (n={n})"
            for median, name, p99, n in sorted(rows)
        ]


def instrument(timeline: Timeline, *, resume: bool) -> None:
    """Put the marks on the gateway's path (and, with ``resume``, the activation's)."""
    from bench import plugins
    from storage.inbox import ObjectInbox
    from storage.redis_index.claims import RedisClaims
    from storage.snapshots import ObjectSnapshots
    from torpor.service.gateway import WebhookGateway
    from torpor.service.sessions import SessionService
    from torpor.session.activation import Activation
    from torpor.session.runtime import SessionRuntime
    from torpor.session.suspend import Suspender

    receive = WebhookGateway.receive

    @functools.wraps(receive)
    async def received(self: WebhookGateway, *args: Any, **kwargs: Any) -> Any:
        timeline.start()
        try:
            return await receive(self, *args, **kwargs)
        finally:
            timeline.mark("answered (202)")

    WebhookGateway.receive = received  # type: ignore[method-assign]
    timeline.wrap(RedisClaims, "admit", before="admission sent", after="admitted")
    timeline.wrap(WebhookGateway, "_header", after="snapshot header read")
    timeline.wrap(ObjectInbox, "stage", after="inbox event staged")
    timeline.wrap(SessionService, "arm_wake", after="wake timer armed")
    timeline.wrap(
        WebhookGateway, "_audited", before="durable writes awaited", after="audit+marker durable"
    )
    if resume:
        timeline.wrap(SessionRuntime, "activate", before="activation begins")
        timeline.wrap(ObjectSnapshots, "load", after="snapshot loaded")
        timeline.wrap(Activation, "drive", before="lease held, drive begins")
        timeline.wrap(ObjectInbox, "pending", after="inbox read")
        timeline.wrap(plugins.BenchAgent, "step", before="agent step begins")
        # The resume's tail, after the step: the session's last commit (its result, the
        # move to the ended markers), the lease given back, the slot left.
        timeline.wrap(plugins.BenchAgent, "step", after="agent step returned")
        timeline.wrap(Suspender, "finish", after="final commit done")
        timeline.wrap(Activation, "drive", after="drive returned")
        timeline.wrap(SessionRuntime, "activate", after="activation returned")


class RoundTrips:
    """The index's round trips on its lean connection, counted exactly (no clock): a batch
    written before any reply came back since the one before shares that one's trip (a
    gather's commands, written one by one, wait for the server together)."""

    def __init__(self) -> None:
        self.trips = 0
        self.commands = 0
        self._replies = 0
        self._seen = -1

    def install(self) -> None:
        """Count from now on, for the process's life (the wire's methods are replaced)."""
        from storage.redis_index import wire

        write, received = wire.WireConnection.write, wire._Replies.data_received

        @functools.wraps(write)
        def counted(conn: wire.WireConnection, commands: Any, into: Any = None) -> Any:
            if self._seen != self._replies:
                self.trips += 1
            self._seen = self._replies
            self.commands += len(commands)
            return write(conn, commands, into)

        @functools.wraps(received)
        def read(replies: Any, data: bytes) -> None:
            self._replies += 1
            received(replies, data)

        wire.WireConnection.write = counted  # type: ignore[method-assign]
        wire._Replies.data_received = read  # type: ignore[method-assign]

    def clear(self) -> None:
        self.trips = self.commands = 0
        self._seen = self._replies

    def report(self, n: int) -> str:
        return (
            f"  {'Redis round trips, each':<28} {self.trips / n:6.2f} "
            f"({self.commands / n:.2f} commands)"
        )


async def floors(batched: Callable[..., Coroutine[Any, Any, Any]], folder: str) -> list[str]:
    """What this machine charges for the two things every stage waits on: a Redis round
    trip through the index's own connection (``batched``: a PING in the next pipeline)
    and a flush of a small write to the store's disk (``fdatasync``). The stages above
    are read against these: on a VM whose loopback wake-ups are slow, a stage that is
    one round trip cannot be faster than the first figure."""
    trips = []
    for _ in range(500):
        started = time.perf_counter()
        await batched("PING")
        trips.append((time.perf_counter() - started) * 1000)
    flushes = []
    fd, path = tempfile.mkstemp(dir=folder)
    try:
        for _ in range(200):
            os.pwrite(fd, b"x" * 4096, 0)
            started = time.perf_counter()
            os.fdatasync(fd)
            flushes.append((time.perf_counter() - started) * 1000)
    finally:
        os.close(fd)
        os.unlink(path)
    return [
        f"  {'Redis round trip (PING)':<28} p50 {statistics.median(trips):6.2f} ms",
        f"  {'fdatasync of 4 KiB':<28} p50 {statistics.median(flushes):6.2f} ms",
    ]
