"""Blocking storage calls run off the loop in the caller's context."""

from __future__ import annotations

import contextvars
import threading

from storage.blocking import off_loop

request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")


async def test_a_call_off_the_loop_sees_the_callers_log_fields_on_a_thread_of_its_own() -> None:
    request_id.set("r-42")

    def where() -> tuple[str, str]:
        return request_id.get(), threading.current_thread().name

    seen, thread = await off_loop(where)
    assert seen == "r-42"
    assert thread.startswith("torpor-io")
