"""Group commit of the local folder store: writers waiting together share one flush, and
no writer is released by a flush that started before it arrived (its bytes might not be
in it)."""

from __future__ import annotations

import threading

from storage.group_sync import GroupSync


class SlowSync:
    """A ``syncfs`` stand-in that holds each flush until the test lets it go, recording
    which flush each writer was released after."""

    def __init__(self) -> None:
        self.started = threading.Semaphore(0)
        self.go = threading.Semaphore(0)
        self.calls = 0

    def __call__(self, fd: int) -> int:
        self.calls += 1
        self.started.release()
        self.go.acquire()
        return 0


def test_writers_arriving_during_a_flush_share_the_next_one(tmp_path: object) -> None:
    fake = SlowSync()
    group = GroupSync(str(tmp_path), syncfs=fake)
    released: list[tuple[str, int]] = []

    def writer(name: str) -> None:
        group.wait()
        released.append((name, fake.calls))

    first = threading.Thread(target=writer, args=("first",))
    first.start()
    fake.started.acquire()  # the first writer's flush is running
    late = [threading.Thread(target=writer, args=(f"w{i}",)) for i in range(8)]
    for t in late:
        t.start()
    while group._arrived < 9:  # every late writer is waiting (no sleep: a busy wait)
        threading.Event().wait(0.001)
    fake.go.release()  # flush 1 ends: it covers only the first writer
    fake.started.acquire()  # one late writer leads flush 2 for all eight
    fake.go.release()
    first.join()
    for t in late:
        t.join()
    assert fake.calls == 2, "eight writers waiting together cost one flush"
    assert ("first", 1) in released
    assert all(calls == 2 for name, calls in released if name != "first"), (
        "a writer that arrived during flush 1 is released only after flush 2"
    )


def test_a_failed_flush_is_retried_by_the_next_writer_not_reported_durable(
    tmp_path: object,
) -> None:
    results = iter([-1, 0])
    group = GroupSync(str(tmp_path), syncfs=lambda fd: next(results))
    try:
        group.wait()
    except OSError:
        pass
    else:
        raise AssertionError("a failed flush must reach its writer")
    group.wait()  # the next flush succeeds and covers it
    assert group.flushes == 1


def test_the_local_store_writes_through_one_shared_flush(tmp_path: object) -> None:
    import asyncio

    from storage.local_store import LocalObjectStore

    store = LocalObjectStore(str(tmp_path))
    before = store._sync.flushes

    async def burst() -> None:
        await asyncio.gather(*(store.put_if_absent(f"k/{i}", b"x") for i in range(32)))

    asyncio.run(burst())
    flushes = store._sync.flushes - before
    assert store._sync.shared, "this machine's libc has syncfs"
    assert 1 <= flushes < 32, f"32 concurrent writes took {flushes} flushes"
