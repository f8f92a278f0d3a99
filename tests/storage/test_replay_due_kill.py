"""A process killed between a replay marker and its due entry (``keys.replay_due``): the
accepting process after the entry and before the marker, the retention sweep after a
due marker's delete and before its entry's. A real child process dies by SIGKILL at the
named point (``torpor.faults``) on the local folder store; a fresh store then finds no
marker that no sweep would list, an entry naming nothing that the next sweep drops
without error, and every marker still inside the replay window kept (a replayed
request is still refused)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from storage import keys
from storage.inbox import ObjectInbox, replay_hour
from storage.local_store import LocalObjectStore
from storage.retention import ObjectRetention
from tests.storage.conftest import killed_child
from tests.support.factories import NOW
from torpor.faults import CrashPoint

pytestmark = pytest.mark.timeout(60)

# The replay window and the retention period of the smallest settings: a day each.
WINDOWS = KEEP = timedelta(hours=24)
FIRST, OTHER = "a" * 64, "b" * 64  # the signed-content digests of two requests

REMEMBER = """
import asyncio, sys
from datetime import datetime
from storage.inbox import ObjectInbox
from storage.local_store import LocalObjectStore

async def main(folder, digest, at):
    inbox = ObjectInbox(LocalObjectStore(folder))
    await inbox.remember_accepted(source="oa", content_digest=digest, at=datetime.fromisoformat(at))
    print("survived", flush=True)

asyncio.run(main(*sys.argv[1:4]))
"""

SWEEP = """
import asyncio, sys
from datetime import datetime, timedelta
from storage.local_store import LocalObjectStore
from storage.retention import ObjectRetention

async def main(folder, now):
    day = timedelta(hours=24)
    retention = ObjectRetention(LocalObjectStore(folder))
    await retention.sweep(now=datetime.fromisoformat(now), keep=day, windows=day, limit=10)
    print("survived", flush=True)

asyncio.run(main(*sys.argv[1:3]))
"""


@pytest.fixture
async def folder(tmp_path: Path) -> AsyncIterator[Path]:
    """A store whose one-time pass over the markers is made (``keys.REPLAYS_LISTED``), as
    any store's is after its first sweep: markers are found through due entries only."""
    store = LocalObjectStore(tmp_path)
    await sweep(store, NOW)
    assert keys.REPLAYS_LISTED in (await store.list(keys.REPLAYS_LISTED)).keys
    await store.close()
    yield tmp_path


async def sweep(store: LocalObjectStore, now: datetime) -> None:
    await ObjectRetention(store).sweep(now=now, keep=KEEP, windows=WINDOWS, limit=10)


async def stored(store: LocalObjectStore, prefix: str) -> list[str]:
    return (await store.list(prefix)).keys


def entry(digest: str, at: datetime) -> str:
    return keys.replay_due(replay_hour(at), "oa", digest)


@pytest.mark.parametrize("retried", [False, True], ids=["never-retried", "retried-later"])
async def test_an_accept_killed_between_the_due_entry_and_its_marker(
    folder: Path, retried: bool
) -> None:
    """The entry is written first: the death leaves an entry naming no marker (the request
    was never remembered, so its retry is not refused), never a marker no sweep lists.
    The sender's retry two hours on is remembered by its own stamp and entry; the dead
    request's entry is dropped once due without taking that marker, which is kept, and
    refuses a replay, for the whole window after the retry, then goes."""
    killed_child(REMEMBER, str(folder), FIRST, NOW.isoformat(), at=CrashPoint.REPLAY_DUE_WRITTEN)
    store = LocalObjectStore(folder)
    inbox = ObjectInbox(store)
    assert await stored(store, keys.REPLAYS_DUE) == [entry(FIRST, NOW)]
    assert await stored(store, keys.REPLAYS) == []
    assert not await inbox.was_accepted(source="oa", content_digest=FIRST)

    again = NOW + timedelta(hours=2)
    if retried:  # the sender's retry, taken by another process
        assert await inbox.remember_accepted(source="oa", content_digest=FIRST, at=again)
    # Past the dead request's hour and window, inside the retry's.
    await sweep(store, again + WINDOWS - timedelta(minutes=1))
    assert await inbox.was_accepted(source="oa", content_digest=FIRST) is retried
    left = [entry(FIRST, again)] if retried else []
    assert await stored(store, keys.REPLAYS_DUE) == left, "the dead request's entry went"
    # Past the retry's window (and the hour it ends in): nothing is left behind.
    await sweep(store, again + WINDOWS + timedelta(hours=1))
    assert not await inbox.was_accepted(source="oa", content_digest=FIRST)
    assert await stored(store, keys.REPLAYS) == await stored(store, keys.REPLAYS_DUE) == []
    await store.close()


async def test_a_sweep_killed_between_a_markers_delete_and_its_entrys(folder: Path) -> None:
    """The marker goes first: the death leaves its entry naming nothing, which the next
    sweep drops without error. The same content accepted again meanwhile (its replay
    window long over) is judged by its own stamp, not the leftover entry's hour: kept,
    and a replay of it refused, as is one of a request still inside its window."""
    store = LocalObjectStore(folder)
    inbox = ObjectInbox(store)
    now = NOW + WINDOWS + timedelta(hours=1)  # FIRST's window and hour are over
    young = now - timedelta(hours=3)  # OTHER's window is not
    await inbox.remember_accepted(source="oa", content_digest=FIRST, at=NOW)
    await inbox.remember_accepted(source="oa", content_digest=OTHER, at=young)
    await store.close()

    killed_child(SWEEP, str(folder), now.isoformat(), at=CrashPoint.REPLAY_MARKER_SWEPT)
    store = LocalObjectStore(folder)
    inbox = ObjectInbox(store)
    assert await stored(store, keys.REPLAYS) == [keys.accepted_content("oa", OTHER)]
    assert await stored(store, keys.REPLAYS_DUE) == [entry(FIRST, NOW), entry(OTHER, young)]
    assert await inbox.was_accepted(source="oa", content_digest=OTHER), "inside its window"

    assert await inbox.remember_accepted(source="oa", content_digest=FIRST, at=now)
    await sweep(store, now)  # a restarted reconciler's
    assert await inbox.was_accepted(source="oa", content_digest=FIRST)
    assert await inbox.was_accepted(source="oa", content_digest=OTHER)
    assert await stored(store, keys.REPLAYS_DUE) == [entry(OTHER, young), entry(FIRST, now)]
    await sweep(store, now + WINDOWS + timedelta(hours=1))
    assert await stored(store, keys.REPLAYS) == await stored(store, keys.REPLAYS_DUE) == []
    await store.close()
