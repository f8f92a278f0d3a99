"""The gateway judges a webhook from the snapshot's header (the open waits' routes), never
decompressing the session before the event is stored; a header written before 0.4 names
no routes and sends it to the whole snapshot, with the same verdicts."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

from storage import keys
from tests.runtime.test_answer_sources import ERP_SECRET, WITH_ERP
from tests.runtime.test_gateway import JSON, SECRET, body
from tests.support.harness import Env, local_env
from torpor.errors import SourceNotAllowed
from torpor.lifecycle import SessionState
from torpor.service.gateway import WebhookGateway
from torpor.webhooks.signing import Scheme, sign


def recorded(env: Env, calls: list[str]) -> None:
    """Note, in order, every snapshot load (whole or as stored), header read and inbox
    write."""
    snapshots, inbox = env.services.snapshots, env.services.inbox
    load, stored = snapshots.load, snapshots.load_stored
    header, stage = snapshots.header, inbox.stage

    async def loading(session_id: str) -> Any:
        calls.append("load")
        return await load(session_id)

    async def loading_stored(session_id: str) -> Any:
        calls.append("load")
        return await stored(session_id)

    async def heading(session_id: str) -> Any:
        calls.append("header")
        return await header(session_id)

    async def delivering(event: Any) -> Any:
        calls.append("deliver")
        return await stage(event)

    snapshots.load = loading  # type: ignore[method-assign]
    snapshots.load_stored = loading_stored  # type: ignore[method-assign]
    snapshots.header = heading  # type: ignore[method-assign]
    inbox.stage = delivering  # type: ignore[method-assign]


async def as_written_before_0_4(env: Env, session_id: str) -> None:
    """Rewrite the session's snapshot with a 0.3 header: no routes, no trace id."""
    store = env.services.snapshots.store  # type: ignore[attr-defined]
    key = keys.snapshot(session_id)
    data = (await store.get(key)).data
    magic, flags, length = struct.unpack_from(">4sBH", data)
    header = json.loads(data[7 : 7 + length])
    header.pop("waits"), header.pop("trace_id")
    old = json.dumps(header).encode()
    await store.put(key, struct.pack(">4sBH", magic, flags, len(old)) + old + data[7 + length :])
    assert (await env.services.snapshots.header(session_id)).waits is None


async def answer(env: Env, *, old_header: bool = False) -> tuple[str, bytes, dict[str, str]]:
    """A session waiting, and a signed answer to its wait (session id, body, headers)."""
    sid = await env.submit()
    wait = (await env.load(sid)).waits[0]
    if old_header:
        await as_written_before_0_4(env, sid)
    raw = body(wait.correlation_id, "e1")
    return sid, raw, signed(env, raw, SECRET)


def signed(env: Env, raw: bytes, secret: str) -> dict[str, str]:
    return {**sign(Scheme.TORPOR, raw, secret, now=env.clock.now()), "Content-Type": JSON}


@pytest.fixture
async def env(tmp_path: Path, redis_url: str, redis_prefix: str) -> Any:
    async with local_env(tmp_path, redis_url, redis_prefix, extra={"sources": WITH_ERP}) as e:
        yield e


async def test_a_webhook_is_judged_from_the_header_before_anything_is_decompressed(
    env: Env,
) -> None:
    gateway, now = WebhookGateway(env.control), env.clock.now()
    sid, raw, headers = await answer(env)
    calls: list[str] = []
    recorded(env, calls)
    with pytest.raises(SourceNotAllowed):
        await gateway.receive("erp", raw, signed(env, raw, ERP_SECRET), now=now)
    assert calls == ["header"], "refused from the header alone"
    calls.clear()
    assert (await gateway.receive("oa", raw, headers, now=now)).status == 202
    assert calls[:2] == ["header", "deliver"], calls  # the session loads only to run it
    assert (await env.load(sid)).state is SessionState.COMPLETED


async def test_a_header_from_before_0_4_sends_the_gateway_to_the_snapshot(env: Env) -> None:
    gateway, now = WebhookGateway(env.control), env.clock.now()
    sid, raw, headers = await answer(env, old_header=True)
    calls: list[str] = []
    recorded(env, calls)
    with pytest.raises(SourceNotAllowed):
        await gateway.receive("erp", raw, signed(env, raw, ERP_SECRET), now=now)
    assert calls == ["header", "load"], "an old header names no routes: the snapshot decides"
    assert (await gateway.receive("oa", raw, headers, now=now)).status == 202
    assert (await env.load(sid)).state is SessionState.COMPLETED
