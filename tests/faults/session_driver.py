"""A session process for the crash tests: ``python -m tests.faults.session_driver SPEC``.

It opens the services from settings the way every torpor process does (the real Redis
index, a local-folder object store under the test's tmp path, the test tools from
``tests.support.tools``, whose World records each side effect in Redis so the test sees
it across processes), runs one action through ``SessionService`` with the runtime inline,
and exits 0. With ``TORPOR_CRASH_AT`` set it dies by SIGKILL at that point instead.

SPEC is JSON: ``tmp``, ``redis_url``, ``prefix``, ``action`` ("submit", "deliver" or
"cancel"), ``session_id`` (for "cancel"), ``event`` (an ``InboxEvent`` as JSON, for
"deliver"), and optionally ``approval`` (options of the approval tool), ``extra``
(more settings) and ``callback_url`` (for "submit": where the session's notices go).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from actors.wiring import open_services, session_runtime
from tests.support.harness import settings_for
from torpor.events import InboxEvent
from torpor.service.activator import InlineActivator
from torpor.service.sessions import SessionService


async def run(spec: dict[str, Any]) -> None:
    settings = settings_for(
        Path(spec["tmp"]),
        spec["redis_url"],
        spec["prefix"],
        extra=spec.get("extra"),
        **spec.get("approval", {}),
    )
    services = open_services(settings)
    runtime = session_runtime(services, f"driver:{os.getpid()}")
    control = SessionService(services, InlineActivator(runtime))
    try:
        if spec["action"] == "submit":
            submitted = await control.submit(
                tenant="acme",
                agent="purchase",
                input={"doc": "PR-1", "amount": 100.0},
                callback_url=spec.get("callback_url"),
            )
            print(submitted.session_id)
        elif spec["action"] == "deliver":
            await control.deliver(InboxEvent.model_validate(spec["event"]))
        elif spec["action"] == "cancel":
            await control.cancel(spec["session_id"])
        else:
            raise SystemExit(f"unknown action {spec['action']!r}")
    finally:
        await services.close()


if __name__ == "__main__":
    asyncio.run(run(json.loads(sys.argv[1])))
