"""Who may answer a wait: only the sources it names, whatever the sender knows."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest

from tests.runtime.test_gateway import JSON, SECRET, SOURCES, body
from tests.support.harness import local_env
from torpor.errors import RejectReason, SourceNotAllowed, WebhookRejected
from torpor.lifecycle import SessionState
from torpor.service.gateway import WebhookGateway
from torpor.webhooks.signing import Scheme, generate_secret, sign

MAPPING = {**SOURCES["oa"]["mapping"], "business_key_path": "businessKey"}  # type: ignore[dict-item]

# Another sender of the same tenant, which the test tool does not name; with its own
# secret, as settings refuse two sources that would accept each other's deliveries.
ERP_SECRET = generate_secret(Scheme.TORPOR)
WITH_ERP = {**SOURCES, "erp": {**SOURCES["oa"], "secrets": [ERP_SECRET]}}


async def test_a_source_the_wait_does_not_name_cannot_answer_it(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    async with local_env(tmp_path, redis_url, redis_prefix, extra={"sources": WITH_ERP}) as env:
        gateway = WebhookGateway(env.control)
        sid = await env.submit()
        wait = (await env.load(sid)).waits[0]
        now = env.clock.now()
        raw = body(wait.correlation_id, "e1")
        from_erp = {**sign(Scheme.TORPOR, raw, ERP_SECRET, now=now), "Content-Type": JSON}
        with pytest.raises(SourceNotAllowed) as refused:
            await gateway.receive("erp", raw, from_erp, now=now)
        assert refused.value.status == 403
        assert (await env.load(sid)).state is SessionState.SUSPENDED
        headers = {**sign(Scheme.TORPOR, raw, SECRET, now=now), "Content-Type": JSON}
        assert (await gateway.receive("oa", raw, headers, now=now)).status == 202


async def test_a_captured_signed_body_cannot_be_retargeted_by_ce_headers(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    async with local_env(tmp_path, redis_url, redis_prefix, extra={"sources": SOURCES}) as env:
        gateway = WebhookGateway(env.control)
        sid = await env.submit()
        wait = (await env.load(sid)).waits[0]
        now = env.clock.now()
        raw = b'{"status": "approved"}'
        headers = {
            **sign(Scheme.TORPOR, raw, SECRET, now=now),
            "Content-Type": JSON,
            "ce-specversion": "1.0",
            "ce-id": "forged",
            "ce-source": "/oa",
            "ce-type": "oa.approval.decided",
            "ce-correlationid": wait.correlation_id,  # not covered by the signature
        }
        with pytest.raises(WebhookRejected) as refused:
            await gateway.receive("oa", raw, headers, now=now)
        assert refused.value.reason is RejectReason.UNSUPPORTED_MEDIA_TYPE
        assert (await env.load(sid)).state is SessionState.SUSPENDED


@pytest.mark.parametrize("receives_result", [False, True])
async def test_a_duplicate_answer_carries_the_result_only_where_configured(
    tmp_path: Path, redis_url: str, redis_prefix: str, receives_result: bool
) -> None:
    sources = {"oa": {**SOURCES["oa"], "receives_result": receives_result}}
    async with local_env(tmp_path, redis_url, redis_prefix, extra={"sources": sources}) as env:
        gateway = WebhookGateway(env.control)
        sid = await env.submit()
        wait = (await env.load(sid)).waits[0]
        now = env.clock.now()
        raw = body(wait.correlation_id, "e1")
        for later in (0, 1):  # the first answer, then the sender's retry
            at = now + timedelta(seconds=later)
            headers = {**sign(Scheme.TORPOR, raw, SECRET, now=at), "Content-Type": JSON}
            answer = await gateway.receive("oa", raw, headers, now=now)
        assert answer.status == 200 and answer.body["duplicate"] is True
        told = answer.body["session"]
        assert told["state"] == SessionState.COMPLETED.value
        assert ("result" in told) is receives_result


async def test_a_github_delivery_must_name_the_correlation_id(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    github = {"tenant": "acme", "scheme": "github", "secrets": [SECRET], "mapping": MAPPING}
    async with local_env(
        tmp_path, redis_url, redis_prefix, extra={"sources": {"gh": github}}
    ) as env:
        gateway = WebhookGateway(env.control)
        sid = await env.submit()
        wait = (await env.load(sid)).waits[0]
        assert wait.business_key is not None
        now = env.clock.now()
        # Replayable forever (no timestamp), so the business key alone must not route it.
        raw = json.dumps(
            {"eventId": "e1", "eventType": "oa.approval.decided", "businessKey": wait.business_key}
        ).encode()
        headers = {**sign(Scheme.GITHUB, raw, SECRET, now=now), "Content-Type": JSON}
        with pytest.raises(WebhookRejected) as refused:
            await gateway.receive("gh", raw, headers, now=now)
        assert refused.value.reason is RejectReason.MALFORMED_BODY
        assert (await env.load(sid)).state is SessionState.SUSPENDED
