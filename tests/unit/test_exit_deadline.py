"""An exiting actor's process ends within its grace (``actors.exit_deadline``), once,
and only in an actor's process. No Ray: its context and ``os._exit`` are stand-ins; the
Ray test of a standby held by a call that never ends is in ``tests/ray/test_standby.py``."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from actors import exit_deadline


class Ended:
    """``os._exit``'s stand-in: when it was called, and with what."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, float]] = []
        self.done = threading.Event()

    def __call__(self, code: int) -> None:
        self.calls.append((code, time.monotonic()))
        self.done.set()


@pytest.fixture
def ended(monkeypatch: pytest.MonkeyPatch) -> Iterator[Ended]:
    monkeypatch.setattr(exit_deadline, "_ending", None)
    monkeypatch.setattr(exit_deadline.ray, "is_initialized", lambda: True)
    stand_in = Ended()
    monkeypatch.setattr(exit_deadline.os, "_exit", stand_in)
    armed: list[threading.Timer] = []

    class Recorded(threading.Timer):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            armed.append(self)

    monkeypatch.setattr(exit_deadline.threading, "Timer", Recorded)
    yield stand_in
    # Every timer made, the module's or not (one armed twice), stopped before the real
    # ``os._exit`` is put back: one left armed would end the whole run, with exit code 0.
    for timer in armed:
        timer.cancel()
        if timer.ident is not None:  # started
            timer.join(5)


def in_actor(monkeypatch: pytest.MonkeyPatch, actor_id: str | None) -> None:
    context = SimpleNamespace(get_actor_id=lambda: actor_id)
    monkeypatch.setattr(exit_deadline.ray, "get_runtime_context", lambda: context)


def test_the_process_ends_after_the_grace_and_the_deadline_is_armed_once(
    monkeypatch: pytest.MonkeyPatch, ended: Ended
) -> None:
    in_actor(monkeypatch, "a" * 32)
    armed = time.monotonic()
    exit_deadline.end_by(0.2, "session actor")
    first = exit_deadline._ending
    exit_deadline.end_by(0.01, "session actor")  # a second exit keeps the first deadline
    assert exit_deadline._ending is first and first is not None
    assert ended.done.wait(5), "the process was never ended"
    [(code, at)] = ended.calls
    assert code == 0 and at - armed >= 0.2


@pytest.mark.parametrize("where", ["driver", "no-ray"])
def test_no_deadline_outside_an_actor_process(
    monkeypatch: pytest.MonkeyPatch, ended: Ended, where: str
) -> None:
    # Not connected to Ray, it is asked nothing of Ray (a call would start a Ray).
    in_actor(monkeypatch, None if where == "driver" else "a" * 32)
    if where == "no-ray":
        monkeypatch.setattr(exit_deadline.ray, "is_initialized", lambda: False)
    exit_deadline.end_by(0.01, "session actor")
    assert exit_deadline._ending is None


def test_a_deadline_whose_thread_cannot_start_does_not_stop_the_exit(
    monkeypatch: pytest.MonkeyPatch, ended: Ended
) -> None:
    in_actor(monkeypatch, "a" * 32)

    def no_thread(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Timer, "start", no_thread)
    exit_deadline.end_by(0.01, "session actor")  # logged, not raised
    assert exit_deadline._ending is None  # tried again by a later exit
