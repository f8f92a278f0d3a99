"""kill -9 of a webhook replica mid-accept, then the sender's retry.

A real process (``tests.faults.replica``) takes the webhook and is SIGKILLed at a named
crash point: after the replay claim, after the inbox write, after the wake timer. The
sender then retries, byte-identically or freshly signed, to a surviving replica. Whatever
the point: no accepted event is lost, the session wakes and applies the event once, a
request that stored nothing is not refused as a replay, and once the retry was accepted
the same bytes again are.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.support.harness import Env, local_env
from torpor.errors import RejectReason, WebhookRejected
from torpor.ids import event_key
from torpor.lifecycle import SessionState
from torpor.ports import TimerKind
from torpor.service.gateway import WebhookGateway
from torpor.webhooks.signing import Scheme, generate_secret, sign

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SECRET = generate_secret(Scheme.TORPOR)
JSON = "application/json"
MAPPING = {
    "event_id_path": "eventId",
    "type_path": "eventType",
    "correlation_id_path": "correlationId",
    "status_path": "decision.status",
    "data_path": "decision",
}
EXTRA: dict[str, Any] = {
    "sources": {
        "oa": {"tenant": "acme", "scheme": "torpor", "secrets": [SECRET], "mapping": MAPPING}
    }
}


@pytest.fixture
async def env(tmp_path: Path, redis_url: str, redis_prefix: str) -> AsyncIterator[Env]:
    async with local_env(tmp_path, redis_url, redis_prefix, extra=EXTRA) as e:
        yield e


def kill_replica_at(
    point: str,
    env: Env,
    tmp: Path,
    redis_url: str,
    prefix: str,
    raw: bytes,
    headers: dict[str, str],
    **more: str,
) -> subprocess.CompletedProcess[bytes]:
    request = {
        **more,
        "tmp": str(tmp),
        "redis_url": redis_url,
        "prefix": prefix,
        "extra": EXTRA,
        "now": env.clock.now().isoformat(),
        "source": "oa",
        "body": raw.decode(),
        "headers": headers,
    }
    path = tmp / f"request-{point}.json"
    path.write_text(json.dumps(request), encoding="utf-8")
    child_env = {**os.environ, "PYTHONPATH": str(ROOT), "TORPOR_CRASH_AT": point}
    return subprocess.run(
        [sys.executable, "-m", "tests.faults.replica", str(path)],
        cwd=ROOT,
        env=child_env,
        capture_output=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize("retry", ["byte_identical", "freshly_signed"])
@pytest.mark.parametrize(
    ("point", "stored"),
    [("gateway.after_claim", False), ("gateway.after_inbox", True), ("gateway.after_wake", True)],
)
async def test_a_replica_killed_mid_accept_loses_nothing(
    env: Env,
    tmp_path: Path,
    redis_url: str,
    redis_prefix: str,
    point: str,
    stored: bool,
    retry: str,
) -> None:
    sid = await env.submit()
    cid = (await env.load(sid)).waits[0].correlation_id
    raw = json.dumps(
        {
            "eventId": "e-kill",
            "eventType": "oa.approval.decided",
            "correlationId": cid,
            "decision": {"status": "approved"},
        }
    ).encode()
    headers = {**sign(Scheme.TORPOR, raw, SECRET, now=env.clock.now()), "Content-Type": JSON}

    done = kill_replica_at(point, env, tmp_path, redis_url, redis_prefix, raw, headers)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
    key = event_key("oa", "e-kill")
    assert (await env.services.inbox.find(sid, key) is not None) is stored
    if point == "gateway.after_wake":  # even with no retry at all, the reconciler would wake it
        grace = env.services.settings.reconciler.wake_grace_s + 1
        due = await env.services.index.due(
            kind=TimerKind.WAKE, now=env.clock.now() + timedelta(seconds=grace), limit=100
        )
        assert sid in due
    assert (await env.load(sid)).state is SessionState.SUSPENDED

    gateway = WebhookGateway(env.control)
    again = (
        headers
        if retry == "byte_identical"
        else {
            **sign(Scheme.TORPOR, raw, SECRET, now=env.clock.now() + timedelta(seconds=1)),
            "Content-Type": JSON,
        }
    )
    result = await gateway.receive("oa", raw, again, now=env.clock.now())
    assert result.status == (200 if stored else 202), result.body
    snap = await env.load(sid)
    assert snap.state is SessionState.COMPLETED
    assert snap.processed_events.count(key) == 1
    assert [h.state for h in snap.history].count(SessionState.RESUMING) == 1  # woke once
    assert snap.result == {"decision": "approved", "doc": "PR-1"}
    # The retry was accepted in full: the same bytes again are a replay now.
    with pytest.raises(WebhookRejected) as replay:
        await gateway.receive("oa", raw, again, now=env.clock.now())
    assert replay.value.reason is RejectReason.REPLAYED


@pytest.mark.parametrize("point", ["gateway.after_inbox", "gateway.after_wake"])
async def test_a_replica_killed_mid_capability_callback_loses_nothing(
    env: Env, tmp_path: Path, redis_url: str, redis_prefix: str, point: str
) -> None:
    sid = await env.submit()
    token = await env.capability_link(sid)
    raw, headers = b'{"status": "approved"}', {"Content-Type": JSON}
    done = kill_replica_at(point, env, tmp_path, redis_url, redis_prefix, raw, headers, token=token)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
    assert (await env.load(sid)).state is SessionState.SUSPENDED
    # The link's holder retries the same answer: settled and woken, not "token used".
    result = await WebhookGateway(env.control).capability(token, raw, headers, now=env.clock.now())
    assert result.status == 200 and result.body["duplicate"] is True
    snap = await env.load(sid)
    assert snap.state is SessionState.COMPLETED
    assert [h.state for h in snap.history].count(SessionState.RESUMING) == 1
