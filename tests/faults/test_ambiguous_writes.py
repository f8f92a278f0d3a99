"""Ambiguous object-store writes at the webhook edge, end to end through the fault proxy.

The first PUT of the inbox event (or of the audit block, or of the replay marker) lands,
its answer is lost, boto3 retries and meets its own object. The sender must still be told
"accepted", and the session must wake, exactly as if nothing had happened.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import pytest

from storage.audit import ObjectAudit
from tests.support.fault_proxy import FaultProxy, path_contains
from tests.support.harness import Env, local_env
from tests.support.s3_server import S3TestServer
from torpor.lifecycle import SessionState
from torpor.service.gateway import WebhookGateway
from torpor.webhooks.signing import Scheme, generate_secret, sign

pytestmark = pytest.mark.s3

SECRET = generate_secret(Scheme.TORPOR)
JSON = "application/json"
MAPPING = {
    "event_id_path": "eventId",
    "type_path": "eventType",
    "correlation_id_path": "correlationId",
    "status_path": "decision.status",
    "data_path": "decision",
}
SOURCES = {"oa": {"tenant": "acme", "scheme": "torpor", "secrets": [SECRET], "mapping": MAPPING}}


@pytest.fixture
async def env(
    tmp_path: Path,
    redis_url: str,
    redis_prefix: str,
    s3_server: S3TestServer,
    s3_proxy: FaultProxy,
    s3_bucket: str,
) -> AsyncIterator[Env]:
    s3 = {**s3_server.boto_kwargs(), "endpoint_url": s3_proxy.endpoint}
    storage = {"object_store_url": f"s3://{s3_bucket}/edge", "s3": s3}
    extra = {"sources": SOURCES, "storage": storage}
    async with local_env(tmp_path, redis_url, redis_prefix, extra=extra) as e:
        yield e


@pytest.mark.parametrize("where", ["/inbox/", "/audit/", "/replays/"])
async def test_a_webhook_whose_write_was_ambiguous_is_accepted_and_woken(
    env: Env, s3_proxy: FaultProxy, where: str
) -> None:
    gateway = WebhookGateway(env.control)
    sid = await env.submit()
    cid = (await env.load(sid)).waits[0].correlation_id
    raw = json.dumps(
        {
            "eventId": "e-amb",
            "eventType": "oa.approval.decided",
            "correlationId": cid,
            "decision": {"status": "approved"},
        }
    ).encode()
    headers = {**sign(Scheme.TORPOR, raw, SECRET, now=env.clock.now()), "Content-Type": JSON}
    s3_proxy.reset_after_commit(match=path_contains(where, "PUT"))
    result = await gateway.receive("oa", raw, headers, now=env.clock.now())
    assert s3_proxy.stats.reset == 1, s3_proxy.stats.log
    assert result.status == 202 and result.body["duplicate"] is False
    assert (await env.load(sid)).state is SessionState.COMPLETED
    await env.services.audit.close()
    checks = await ObjectAudit(env.services.store).verify_all()
    assert [c.records for c in checks.values()] == [1] and all(c.ok for c in checks.values())
    # The sender's freshly signed retry is a duplicate, told the outcome.
    later = env.clock.now() + timedelta(seconds=1)
    retry = {**sign(Scheme.TORPOR, raw, SECRET, now=later), "Content-Type": JSON}
    again = await gateway.receive("oa", raw, retry, now=later)
    assert again.status == 200 and again.body["session"]["state"] == "COMPLETED"


async def test_a_capability_links_first_use_with_an_ambiguous_write_is_accepted(
    env: Env, s3_proxy: FaultProxy
) -> None:
    gateway = WebhookGateway(env.control)
    sid = await env.submit()
    token = await env.capability_link(sid)
    s3_proxy.reset_after_commit(match=path_contains("/inbox/", "PUT"))
    result = await gateway.capability(
        token, b'{"status": "approved"}', {"Content-Type": JSON}, now=env.clock.now()
    )
    assert s3_proxy.stats.reset == 1, s3_proxy.stats.log
    assert result.status == 202 and result.body["duplicate"] is False
    assert (await env.load(sid)).state is SessionState.COMPLETED
