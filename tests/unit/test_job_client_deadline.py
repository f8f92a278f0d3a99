"""Every request of the Jobs API client has a deadline.

Ray's ``JobSubmissionClient`` sends with no timeout: against a dashboard that accepts a
connection and never answers (wedged, or a half-open connection behind a load balancer),
a watcher's status poll waited for ever, and its session waited on a job nobody watched.
A real client against a real socket that never answers: it gives up after the deadline.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from actors import work_jobs
from actors.work_jobs import _job_client
from actors.work_launch import Kind, Launch


@pytest.fixture
def silent_dashboard() -> Iterator[str]:
    """Accepts connections, reads what is sent, never answers; closed at the end (so a
    request that had no deadline is let go then, and no thread outlives the test)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    accepted: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            accepted.append(conn)

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        server.close()
        for conn in accepted:
            conn.close()


def test_a_dashboard_that_never_answers_fails_the_request_after_the_deadline(
    silent_dashboard: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(work_jobs, "JOB_CALL_TIMEOUT_S", 0.5)
    outcome: list[BaseException | None] = []

    def connect() -> None:
        try:  # the client's first request: its version check
            _job_client(Launch(Kind.JOB, job_address=silent_dashboard))
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    started = time.monotonic()
    caller = threading.Thread(target=connect, daemon=True)
    caller.start()
    caller.join(timeout=10.0)
    assert not caller.is_alive(), "the request had no deadline: still waiting after 10 s"
    [error] = outcome
    assert isinstance(error, OSError), error  # requests' timeout, seen as ConnectionError
    assert time.monotonic() - started < 5.0
