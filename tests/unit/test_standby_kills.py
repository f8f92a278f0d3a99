"""A standby that does not answer (its start, a keeping round, its retire) is killed off
the event loop, with a deadline: ``ray.kill`` waits in its thread for the GCS, and on
the loop a slow one held every other coroutine of the holder's process (a Serve
replica's webhooks). No Ray is started: the standbys are fakes, and ``ray.kill`` is
replaced by one that blocks its thread as a slow GCS would.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import ray

from actors import named, standby
from actors.standby import StandbySet, _retire
from tests.conftest import eventually
from tests.unit.test_activation_kills import SilentActor
from tests.unit.test_named_lookups import SLOW_S, longest_stall
from torpor.threads import ProcessPool


@pytest.fixture(autouse=True)
def kill_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test its own kill threads: a kill given up at its deadline holds its thread
    for as long as the GCS takes, and a later test's kills queued behind it."""
    monkeypatch.setattr(named, "KILLS", ProcessPool(named.KILLS.threads, "test-kill"))
    monkeypatch.setattr(named, "_KILLING", {}, raising=False)  # its own record of kills under way


class SilentStandby(SilentActor):
    def __init__(self) -> None:
        super().__init__()
        self.keep = self.retire = self.ready  # every call unanswered


def spawning(handle: SilentStandby) -> Callable[[], Awaitable[Any]]:
    async def spawn() -> SilentStandby:
        return handle

    return spawn


async def start_given_up(handle: SilentStandby) -> None:
    await StandbySet(1, spawning(handle))._start()


async def keeping_round(handle: SilentStandby) -> None:
    standbys = StandbySet(1, spawning(SilentStandby()))  # never spawns: no refill here
    standbys._ready.append(handle)
    await standbys._keep_once(0.05)


async def retire_unanswered(handle: SilentStandby) -> None:
    await _retire(handle, timeout_s=0.05)


@pytest.mark.parametrize("operation", [start_given_up, keeping_round, retire_unanswered])
async def test_a_silent_standby_is_killed_without_stalling_the_loop(
    operation: Callable[[SilentStandby], Awaitable[None]], monkeypatch: pytest.MonkeyPatch
) -> None:
    killed: list[Any] = []

    def slow_kill(handle: Any, no_restart: bool = True) -> None:
        killed.append(handle)
        time.sleep(SLOW_S)

    monkeypatch.setattr(ray, "kill", slow_kill)
    monkeypatch.setattr(standby, "START_TIMEOUT_S", 0.05)
    monkeypatch.setattr(named, "LOOKUP_TIMEOUT_S", 0.2)
    handle = SilentStandby()
    stall = await longest_stall(lambda: operation(handle))
    assert killed == [handle], "the silent standby was not killed: this measured nothing"
    assert stall < SLOW_S / 2, f"the loop was held {stall:.2f} s by a {SLOW_S} s kill"


async def test_a_lookup_does_not_wait_behind_the_kills_of_a_keeping_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A round kills every silent standby at once; with the GCS slow to take the kills,
    a webhook's lookup made meanwhile still answers: it does not queue behind them for
    a thread (its deadline counts that wait: it failed with ``ClusterUnavailable``)."""
    taken = threading.Event()  # the GCS takes the kills once this is set
    killing: list[Any] = []

    def blocked_kill(handle: Any, no_restart: bool = True) -> None:
        killing.append(handle)
        taken.wait(30)

    found = object()
    monkeypatch.setattr(ray, "kill", blocked_kill)
    monkeypatch.setattr(ray, "get_actor", lambda name, namespace=None: found)
    monkeypatch.setattr(named, "LOOKUP_TIMEOUT_S", 2.0)
    silent = [SilentStandby() for _ in range(named.LOOKUPS.threads)]  # enough to fill it
    standbys = StandbySet(len(silent), spawning(SilentStandby()))
    standbys._ready.extend(silent)
    round_ = asyncio.create_task(standbys._keep_once(0.05))
    try:
        # Every kill that gets a thread has one: the kill threads are all held.
        busy = min(named.KILLS.threads, len(silent))
        await eventually(
            lambda: len(killing) >= busy, timeout_s=5, interval_s=0.01, what="the kills began"
        )
        started = time.monotonic()
        assert await named.get_actor("session:s_1", "t") is found
        waited = time.monotonic() - started
    finally:
        taken.set()
        await round_
    assert waited < 1.0, f"the lookup waited {waited:.2f} s behind the kills"
    assert sorted(map(id, killing)) == sorted(map(id, silent)), "not every silent one was killed"


@pytest.mark.parametrize("given_up", ["deadline", "cancelled"])
async def test_a_kill_still_queued_when_its_caller_gives_up_is_made_once_a_thread_frees(
    monkeypatch: pytest.MonkeyPatch, given_up: str
) -> None:
    """The kill threads all held by kills the GCS is slow to take: a kill queued behind
    them is given up by its caller (at its deadline: False, the caller goes on; or
    cancelled), and is still made when a thread frees. Dropped, its silent actor lived
    on. Asked again for the same actor meanwhile, it is made once."""
    monkeypatch.setattr(named, "KILLS", ProcessPool(1, "test-kill-one"))
    taken = threading.Event()
    killed: list[Any] = []

    def slow_kill(handle: Any, no_restart: bool = True) -> None:
        killed.append(handle)
        taken.wait(30)

    monkeypatch.setattr(ray, "kill", slow_kill)
    first, queued = SilentStandby(), SilentStandby()
    held = asyncio.create_task(named.kill(first, "the first", timeout_s=30))
    try:
        await eventually(lambda: killed == [first], timeout_s=5, interval_s=0.01, what="began")
        if given_up == "deadline":
            assert await named.kill(queued, "the queued one", timeout_s=0.05) is False
        else:
            asking = asyncio.create_task(named.kill(queued, "the queued one", timeout_s=30))
            await asyncio.sleep(0)  # it runs to its wait for the kill, queued behind the first
            assert queued in named._KILLING
            asking.cancel()
            with pytest.raises(asyncio.CancelledError):
                await asking
        made = named._KILLING.get(queued)
        assert made is not None and not made.cancelled(), "the kill given up was dropped"
        again = asyncio.create_task(named.kill(queued, "asked again", timeout_s=30))
        await asyncio.sleep(0)  # asked while the first kill of it is still queued
        assert named._KILLING.get(queued) is made, "asked again, its kill was queued again"
        assert killed == [first], "the queued kill ran before a thread was free"
    finally:
        taken.set()
    assert await held is True
    assert await again is True  # the kill given up, asked again: done once this is
    assert killed == [first, queued], "the kill given up was not made, or made twice"
    assert named._KILLING == {}, "a kill made is forgotten"


def test_a_kill_asked_while_the_interpreter_exits_is_made_not_raised(tmp_path: Any) -> None:
    """A real interpreter's exit: once ``concurrent.futures``' exit hook has run, a pool
    takes no new work, and ``kill`` (which promises to raise nothing: it is a clean-up)
    raised ``RuntimeError`` from an exit handler instead of making the kill."""
    script = tmp_path / "kill_at_exit.py"
    script.write_text(
        textwrap.dedent(
            """
            import asyncio, atexit
            import ray
            from actors import named

            killed = []
            ray.kill = lambda handle, no_restart=True: killed.append(handle)

            def at_exit():
                try:
                    made = asyncio.run(named.kill("actor-1", "a kill at exit"))
                except BaseException as error:
                    print("raised", type(error).__name__, error, flush=True)
                    return
                print("made", made, killed, flush=True)

            atexit.register(at_exit)
            """
        )
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(  # this checkout's code, not whatever the venv installed
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "made True ['actor-1']", done.stdout + done.stderr[-2000:]


async def test_a_kill_made_in_the_askers_thread_holds_no_lock_other_kills_need(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Once the kill threads take no more work (the interpreter exiting), a kill is made
    in the thread that asked, for as long as the GCS takes: not under the lock every
    other kill (another actor's, from another thread) must take first."""
    pool = ProcessPool(1, "test-kill-shut")
    pool.executor().shutdown()
    monkeypatch.setattr(named, "KILLS", pool)
    held: list[bool] = []

    def kill_checking(handle: Any, no_restart: bool = True) -> None:
        held.append(named._KILLING_LOCK.locked())

    monkeypatch.setattr(ray, "kill", kill_checking)
    assert await named.kill(SilentStandby(), "made here") is True
    assert held == [False], "the kill was made holding the kill record's lock"
    assert named._KILLING == {}


async def test_a_kill_no_thread_can_start_for_is_not_made_and_not_raised(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A thread that cannot start (a container's limit on threads) is the one refusal
    made after the call was queued: the kill is reported not made (False, logged), not
    raised and not made a second time here, and a later ask queues it afresh."""

    def no_thread(self: Any) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(named, "KILLS", ProcessPool(1, "test-kill-nothread"))
    monkeypatch.setattr(threading.Thread, "start", no_thread)
    killed: list[Any] = []
    monkeypatch.setattr(ray, "kill", lambda handle, no_restart=True: killed.append(handle))
    handle = SilentStandby()
    assert await named.kill(handle, "no thread") is False
    assert killed == [], "made here too, while it waits in the pool's queue"
    assert "could not be queued" in caplog.text
    assert named._KILLING == {}, "a kill never made stays on record: every later ask waits on it"


async def test_a_kill_interrupted_while_its_thread_starts_is_forgotten_not_waited_on_for_ever(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An interrupt (Ctrl-C) while the kill's thread starts is raised, and the kill is
    settled as not made: left pending on record, every later ask for the same actor
    waited on it to its deadline, and none was made."""
    monkeypatch.setattr(named, "KILLS", ProcessPool(1, "test-kill-interrupted"))
    start = threading.Thread.start

    def interrupted(self: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(threading.Thread, "start", interrupted)
    handle = SilentStandby()
    with pytest.raises(KeyboardInterrupt):
        named._killing(handle)
    assert named._KILLING == {}, "the interrupted kill stays on record, never settled"
    monkeypatch.setattr(threading.Thread, "start", start)
    killed: list[Any] = []
    monkeypatch.setattr(ray, "kill", lambda h, no_restart=True: killed.append(h))
    # The first pool's queue still holds the interrupted one: a pool of its own here.
    monkeypatch.setattr(named, "KILLS", ProcessPool(1, "test-kill-after"))
    assert await named.kill(handle, "asked again", timeout_s=5) is True
    assert killed == [handle]


async def test_a_kill_on_record_cannot_be_cancelled(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kill once asked is made: its record's future refuses a cancel (one that took
    dropped the record while the kill still waited, and a later ask queued it again)."""
    release = threading.Event()
    monkeypatch.setattr(named, "KILLS", ProcessPool(1, "test-kill-uncancellable"))
    killed: list[Any] = []
    monkeypatch.setattr(ray, "kill", lambda h, no_restart=True: killed.append(h))
    held = named.KILLS.submit(release.wait, 5)  # the one thread busy: the kill waits
    handle = SilentStandby()
    made = named._killing(handle)
    try:
        assert made.cancel() is False and not made.cancelled()
        assert named._killing(handle) is made
    finally:
        release.set()
    held.result(5)
    assert made.result(5) is True and killed == [handle]
    # Its record is dropped by a callback the pool's thread runs after the result is set.
    await eventually(lambda: named._KILLING == {}, timeout_s=5, what="the record dropped")
