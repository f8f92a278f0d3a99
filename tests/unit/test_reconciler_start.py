"""Making sure the reconciler runs has a deadline (pure code, no Ray started: the actor
and ``ray.get`` are fakes)."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
from ray.exceptions import GetTimeoutError

from actors import reconciler
from actors.reconciler import ensure_reconciler
from torpor.settings import Settings


def test_a_reconciler_that_never_answers_its_start_does_not_hold_the_caller(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A driver's ``Client()`` and the Serve app's starter ask for the start in their
    constructor: a reconciler whose process never came up (its node gone, not yet
    declared dead) held them there for ever."""
    handle = SimpleNamespace(start=SimpleNamespace(remote=lambda: "start-ref"))
    made = SimpleNamespace(remote=lambda config: handle)
    monkeypatch.setattr(reconciler, "Reconciler", SimpleNamespace(options=lambda **_: made))

    def get(ref: Any, *, timeout: float | None = None) -> Any:
        # Ray's get of an answer that never comes: it raises after ``timeout``, or, with
        # none, waits for ever (here: long enough to tell, then the test fails).
        if timeout is None:
            threading.Event().wait(2.0)
            raise AssertionError("ray.get waited with no deadline")
        raise GetTimeoutError(f"no answer in {timeout} s")

    monkeypatch.setattr(reconciler.ray, "get", get)
    with pytest.raises(GetTimeoutError):
        ensure_reconciler(Settings.build({}))
