"""Who may answer a wait: only the sources it names, whatever the sender knows."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.runtime.test_gateway import JSON, SECRET, SOURCES, body
from tests.support.harness import local_env
from torpor.errors import SourceNotAllowed
from torpor.lifecycle import SessionState
from torpor.service.gateway import WebhookGateway
from torpor.webhooks.signing import Scheme, sign

# Another sender of the same tenant, which the test tool does not name.
WITH_ERP = {**SOURCES, "erp": {**SOURCES["oa"]}}


async def test_a_source_the_wait_does_not_name_cannot_answer_it(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    async with local_env(tmp_path, redis_url, redis_prefix, extra={"sources": WITH_ERP}) as env:
        gateway = WebhookGateway(env.control)
        sid = await env.submit()
        wait = (await env.load(sid)).waits[0]
        now = env.clock.now()
        raw = body(wait.correlation_id, "e1")
        headers = {**sign(Scheme.TORPOR, raw, SECRET, now=now), "Content-Type": JSON}
        with pytest.raises(SourceNotAllowed) as refused:
            await gateway.receive("erp", raw, headers, now=now)
        assert refused.value.status == 403
        assert (await env.load(sid)).state is SessionState.SUSPENDED
        assert (await gateway.receive("oa", raw, headers, now=now)).status == 202
