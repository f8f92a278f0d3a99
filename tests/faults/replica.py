"""A webhook replica in a process of its own, for kill -9 tests.

Run as ``python -m tests.faults.replica REQUEST.json``: it wires the real services (Redis
and the local object store of the test, as ``tests.support.harness`` configures them),
takes one webhook or capability callback through ``WebhookGateway`` and prints the answer
as JSON. With ``TORPOR_CRASH_AT`` set it dies at that crash point, SIGKILLed mid-accept, as a Serve
replica would. Activation requests go to the session actors in production; here they
are lost with the process, so only durable state (the inbox, the wake timer) survives.
"""

from __future__ import annotations

import asyncio
import json
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

from actors.wiring import open_services
from tests.support.harness import settings_for
from torpor.clock import ManualClock
from torpor.ports import Reason
from torpor.service.gateway import WebhookGateway
from torpor.service.sessions import SessionService


class LostActivator:
    """Activation requests that never arrive (they die with the replica)."""

    async def request(self, session_id: str, *, reason: Reason, agent: str | None = None) -> None:
        return None


async def main(request: dict[str, Any]) -> dict[str, Any]:
    settings = settings_for(
        Path(request["tmp"]), request["redis_url"], request["prefix"], extra=request["extra"]
    )
    now = datetime.fromisoformat(request["now"])
    services = open_services(settings, clock=ManualClock(now))
    try:
        gateway = WebhookGateway(SessionService(services, LostActivator()))
        raw, headers = request["body"].encode(), request["headers"]
        if "token" in request:  # a capability link instead of a signed webhook
            result = await gateway.capability(request["token"], raw, headers, now=now)
        else:
            result = await gateway.receive(request["source"], raw, headers, now=now)
        return {"status": result.status, "body": result.body}
    finally:
        await services.close()


if __name__ == "__main__":
    answer = asyncio.run(main(json.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))))
    print(json.dumps(answer, default=str))
