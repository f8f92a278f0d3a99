"""runtime.log_format = "json": one JSON object a line, attributed to its session,
correlation and trace ids; plain text stays the default."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from actors.observer import RayObserver
from tests.support.harness import local_env
from torpor import logs
from torpor.settings import Settings


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    buffer = io.StringIO()
    try:
        yield buffer
    finally:
        logs.configure("text")


async def test_a_guard_alert_is_one_json_line_with_the_session_wait_and_trace_ids(
    tmp_path: Path, redis_url: str, redis_prefix: str, captured: io.StringIO
) -> None:
    extra = {"runtime": {"log_format": "json"}}
    async with local_env(tmp_path, redis_url, redis_prefix, extra=extra, on_drift="block") as env:
        logs.configure("json", stream=captured)  # open_services installed it on stderr
        env.services.observer = RayObserver()
        sid = await env.submit()
        snap = await env.load(sid)
        await env.world.set_version("PR-1", "v9")
        await env.answer(sid, {"status": "approved"})
    lines = [json.loads(line) for line in captured.getvalue().splitlines()]
    [alert] = [line for line in lines if line["logger"] == "torpor.security"]
    assert alert["level"] == "warning" and "guard blocked" in alert["message"]
    assert alert["session_id"] == sid
    assert alert["correlation_id"] == snap.waits[0].correlation_id
    assert alert["trace_id"] == snap.trace_id and len(snap.trace_id) == 32
    assert alert["ts"].endswith("+00:00")


def test_ids_bound_around_work_reach_lines_logged_inside(captured: io.StringIO) -> None:
    logs.configure("json", stream=captured)
    log = logging.getLogger("torpor.test")
    with logs.bind(session_id="s_1", trace_id="ab" * 16):
        logs.update(correlation_id="c_1")
        log.info("inside")
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("failed")
    log.info("outside")
    inside, failed, outside = (json.loads(line) for line in captured.getvalue().splitlines())
    assert (inside["session_id"], inside["correlation_id"], inside["trace_id"]) == (
        "s_1",
        "c_1",
        "ab" * 16,
    )
    assert "ValueError: boom" in failed["error"]
    assert outside == {k: outside[k] for k in ("ts", "level", "logger", "message")}


def test_text_is_the_default_and_leaves_torpors_loggers_alone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert Settings.build({}).runtime.log_format == "text"
    logs.configure("json", stream=io.StringIO())
    logs.configure("text")
    assert not any(h.get_name() == "torpor-json" for h in logging.getLogger("torpor").handlers)
    with caplog.at_level(logging.INFO, logger="torpor"):
        logging.getLogger("torpor.test").info("plain")
    assert [r.getMessage() for r in caplog.records] == ["plain"]
