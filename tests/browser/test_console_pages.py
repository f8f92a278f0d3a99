"""The console's pages as an operator's HTTP client reads them (no browser needed):
webhook outcomes and verdicts from real gateway traffic, the audit chain's verification,
the due-within filter, cursor paging, retry now."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import secrets

import httpx
import pytest

from actors.wiring import open_services, session_runtime
from storage import keys
from storage.audit import ObjectAudit
from tests.browser.conftest import Console, csrf_of
from tests.conftest import eventually
from tests.runtime.test_gateway import JSON, SECRET, body
from tests.support.tools import World
from torpor import outbox
from torpor.clock import ManualClock
from torpor.errors import WebhookRejected
from torpor.events import EventKind, InboxEvent
from torpor.lifecycle import SessionState
from torpor.models import DispatchStatus, OutboxKind
from torpor.ports import Reason
from torpor.ports.services import Services
from torpor.service.activator import InlineActivator
from torpor.service.gateway import WebhookGateway
from torpor.service.sessions import SessionService
from torpor.service.sweeper import Sweeper
from torpor.webhooks.signing import Scheme, sign


async def submit(control: SessionService, tenant: str = "acme") -> str:
    doc = f"PR-{secrets.token_hex(3)}"
    result = await control.submit(tenant=tenant, agent="purchase", input={"doc": doc})
    return result.session_id


def session_ids(html: str) -> list[str]:
    return re.findall(r'class="sid" href="[^"]*/sessions/([^"]+)"', html)


async def test_webhook_outcomes_verdicts_and_the_audit_chain(
    console: Console,
    control: SessionService,
    services: Services,
    operator: httpx.AsyncClient,
) -> None:
    sid = await submit(control)
    wait = (await control.get(sid)).waits[0]
    gateway = WebhookGateway(control)
    now = services.clock.now()
    raw = body(wait.correlation_id, f"e-{secrets.token_hex(4)}")
    headers = {**sign(Scheme.TORPOR, raw, SECRET, now=now), "Content-Type": JSON}
    assert (await gateway.receive("oa", raw, headers, now=now)).status == 202
    forged = {**headers, "X-Torpor-Signature": "0" * 64, "X-Torpor-Nonce": secrets.token_hex(12)}
    with pytest.raises(WebhookRejected):
        await gateway.receive("oa", raw, forged, now=now)
    assert (await control.get(sid)).state is SessionState.COMPLETED
    # An answer to a wait that is gone: recorded, never applied.
    await control.deliver(
        InboxEvent.answering(
            wait,
            kind=EventKind.CALLBACK,
            session_id=sid,
            source="oa",
            event_id="too-late",
            type="oa.approval.decided",
            received_at=services.clock.now(),
            data={"status": "rejected"},
        )
    )

    front = (await operator.get("/", params={"verify": "1"})).text
    outcomes = front[front.index('id="outcomes"') : front.index('id="dead"')]
    assert re.search(r"<td>oa</td><td>accepted</td><td>[1-9]", outcomes)
    assert re.search(r"<td>oa</td><td>rejected:[a-z_]+</td><td>[1-9]", outcomes)
    chain = front[front.index('id="audit"') :]
    assert "<td>ok</td>" in chain
    assert "BROKEN" not in chain

    timeline = (await operator.get(f"/sessions/{sid}")).text
    verdicts = re.findall(r"class='verdict'>([^<]+)<", timeline)
    assert "applied" in verdicts
    assert any(v.startswith("observed: ") for v in verdicts), verdicts
    assert "accepted" in timeline[timeline.index('id="audit-records"') :]


async def test_due_within_filter_and_cursor_paging(
    control: SessionService, operator: httpx.AsyncClient
) -> None:
    ids = [await submit(control, tenant="beta") for _ in range(3)]  # SLA: one hour
    soon = await operator.get("/", params={"tenant": "beta", "due": "1"})
    assert not set(ids) & set(session_ids(soon.text))
    later = await operator.get("/", params={"tenant": "beta", "due": "120"})
    assert set(ids) <= set(session_ids(later.text))

    seen: list[str] = []
    params: dict[str, str] = {"tenant": "beta", "state": "SUSPENDED", "limit": "2"}
    for _ in range(50):
        page = (await operator.get("/", params=params)).text
        rows = session_ids(page)
        assert len(rows) <= 2
        seen += rows
        found = re.search(r'rel="next" href="[^"]*cursor=([^"&]+)', page)
        if found is None:
            break
        params["cursor"] = found.group(1)
    assert len(seen) == len(set(seen)), "a page repeated a session"
    assert set(ids) <= set(seen)
    assert seen == sorted(seen, reverse=True)  # newest first


async def test_retry_now_is_audited_with_who_and_why(
    console: Console, control: SessionService, services: Services, operator: httpx.AsyncClient
) -> None:
    sid = await submit(control)
    page = (await operator.get(f"/sessions/{sid}")).text
    missing = await operator.post(f"/sessions/{sid}/retry", data={"csrf": csrf_of(page)})
    assert missing.status_code == 400  # no reason, no action
    answer = await operator.post(
        f"/sessions/{sid}/retry", data={"csrf": csrf_of(page), "reason": "OA back online"}
    )
    assert answer.status_code == 303
    assert "activation%20requested" in answer.headers["location"]
    after = (await operator.get(f"/sessions/{sid}")).text
    records = after[after.index('id="audit-records"') :]
    assert "operator:retry" in records
    assert (await control.get(sid)).state is SessionState.SUSPENDED  # still waiting, intact

    # Who and why: the action record names the operator's key and the reason, and the
    # audit chain holds its hash (so the reason cannot be edited afterwards unseen).
    assert isinstance(services.audit, ObjectAudit)
    audited = [
        r
        for r in await services.audit.recent()
        if r.session_id == sid and r.verdict == "operator:retry"
    ]
    assert len(audited) == 1
    stored = (await services.store.get(keys.operator_action(audited[0].event_id))).data
    assert hashlib.sha256(stored).hexdigest() == audited[0].body_sha256
    action = json.loads(stored)
    key_id = console.settings.security.operator_keys[0].removeprefix("sha256:")[:12]
    assert action["who"] == f"operator:{key_id}"
    assert audited[0].source == f"operator:{key_id}"
    assert action["reason"] == "OA back online"


async def test_reconciler_health_shows_sweep_age_and_step_errors(
    console: Console, control: SessionService, operator: httpx.AsyncClient
) -> None:
    await Sweeper(control).sweep_once()  # a complete sweep, recorded in the index
    console.reconciler["step_errors"] = {
        "polls": {"at": "2026-11-30T22:00:00+00:00", "error": "ToolError: OA down"}
    }
    try:
        front = (await operator.get("/")).text
    finally:
        console.reconciler.clear()
    health = front[front.index('id="health"') :]
    assert re.search(r"Last complete sweep: \d+ s ago", health)
    assert "<td>polls</td><td>2026-11-30T22:00:00+00:00: ToolError: OA down</td>" in health


async def test_values_from_outside_are_escaped(
    control: SessionService, operator: httpx.AsyncClient
) -> None:
    hostile = '<img src=x onerror="alert(1)">'
    result = await control.submit(tenant="acme", agent="purchase", input={"doc": hostile})
    page = (await operator.get(f"/sessions/{result.session_id}")).text
    assert "&lt;img src=x onerror=&quot;alert(1)&quot;&gt;" in page  # the business key
    assert hostile not in page
    found = await operator.get("/search", params={"q": hostile})
    assert hostile not in found.text


async def test_a_quarantined_session_is_listed_and_taken_back_by_retry_now(
    control: SessionService, services: Services, operator: httpx.AsyncClient
) -> None:
    sid = await submit(control)
    key = keys.snapshot(sid)
    good = (await services.store.get(key)).data
    # Spoil the compressed body, keep the header: the snapshot no longer decodes.
    await services.store.put(key, good[:-16] + b"\x00" * 16)
    await control.activate(sid, reason=Reason.EVENT)
    assert (await services.index.session_states([sid]))[sid] is SessionState.QUARANTINED

    listed = (await operator.get("/", params={"state": "QUARANTINED"})).text
    assert sid in session_ids(listed)
    page = (await operator.get(f"/sessions/{sid}")).text
    assert "Quarantined:" in page and "snapshot_corrupt" in page

    await services.store.put(key, good)  # restored from a backup
    answer = await operator.post(
        f"/sessions/{sid}/retry", data={"csrf": csrf_of(page), "reason": "snapshot restored"}
    )
    assert answer.status_code == 303
    assert "quarantined%20session%20taken%20back" in answer.headers["location"]
    assert (await services.index.session_states([sid]))[sid] is SessionState.SUSPENDED


async def test_a_dead_outbox_entry_is_resent_from_the_timeline(
    console: Console, operator: httpx.AsyncClient
) -> None:
    # The session times out; its compensation (the OA undo) gives up: a dead letter.
    clock = ManualClock()
    driver = open_services(console.settings, clock=clock)
    world = World(console.settings.storage.index_url, console.settings.storage.redis_prefix)
    try:
        runtime = session_runtime(driver, "driver")
        control = SessionService(driver, InlineActivator(runtime))
        sid = (
            await control.submit(
                tenant="acme", agent="undo", input={"doc": f"PR-{secrets.token_hex(3)}"}
            )
        ).session_id
        clock.advance(61)
        await runtime.activate(sid, reason=Reason.TIMEOUT)
        for _ in range(outbox.MAX_DISPATCH_ATTEMPTS):
            [undo] = [e for e in (await control.get(sid)).outbox if e.kind is OutboxKind.COMPENSATE]
            if undo.status is not DispatchStatus.PENDING:
                break
            assert undo.next_attempt_at is not None
            clock.set(undo.next_attempt_at)
            await runtime.activate(sid, reason=Reason.RETRY)
        assert undo.status is DispatchStatus.DEAD
        assert await world.counts("compensate") == {}

        page = (await operator.get(f"/sessions/{sid}")).text
        action = f"/sessions/{sid}/outbox/{undo.entry_id}/resend"
        assert action in page
        await world.open_gate("undo-up")  # the OA system is back
        answer = await operator.post(
            action, data={"csrf": csrf_of(page), "reason": "OA undo endpoint restored"}
        )
        assert answer.status_code == 303

        async def sent() -> bool:
            return await world.counts("compensate") == {undo.idempotency_key: 1}

        await eventually(sent, what="the resent compensation reached the OA system")
        timeline = (await operator.get(f"/sessions/{sid}")).text
        assert "operator:resend_outbox" in timeline
    finally:
        await world.close()
        await driver.close()


async def test_reassign_approval_is_audited_and_opens_a_new_epoch(
    console: Console, control: SessionService, services: Services, operator: httpx.AsyncClient
) -> None:
    doc = f"PR-{secrets.token_hex(3)}"
    submitted = await control.submit(
        tenant="acme", agent="approval", input={"doc": doc, "amount": 500, "cc": "CC-7"}
    )
    sid = submitted.session_id
    [old] = (await control.get(sid)).waits
    assert old.request["approvers"] == ["fd"]

    page = (await operator.get(f"/sessions/{sid}")).text
    assert f"/sessions/{sid}/reassign" in page  # the button is offered
    form = {"csrf": csrf_of(page), "correlation_id": old.correlation_id, "approver": "bob"}
    missing = await operator.post(f"/sessions/{sid}/reassign", data=form)
    assert missing.status_code == 400  # no reason, no action
    answer = await operator.post(
        f"/sessions/{sid}/reassign", data={**form, "reason": "fd on leave"}
    )
    assert answer.status_code == 303, answer.text
    assert "approval%20reassigned" in answer.headers["location"]

    async def reissued() -> bool:
        waits = (await control.get(sid)).waits
        return len(waits) == 1 and waits[0].epoch > old.epoch

    await eventually(reissued, what="the reassigned approval opens in a new epoch")
    snap = await control.get(sid)
    [new] = snap.waits
    assert new.correlation_id != old.correlation_id and new.request["approvers"] == ["bob"]
    assert snap.state is SessionState.SUSPENDED

    # Who and why: one audit record naming the operator's key, its action record the reason.
    assert isinstance(services.audit, ObjectAudit)
    audited = [
        r
        for r in await services.audit.recent()
        if r.session_id == sid and r.verdict == "operator:reassign_approval"
    ]
    assert len(audited) == 1
    key_id = console.settings.security.operator_keys[0].removeprefix("sha256:")[:12]
    assert audited[0].source == f"operator:{key_id}"
    stored = (await services.store.get(keys.operator_action(audited[0].event_id))).data
    assert hashlib.sha256(stored).hexdigest() == audited[0].body_sha256
    action = json.loads(stored)
    assert action["who"] == f"operator:{key_id}" and action["reason"] == "fd on leave"
    assert action["detail"] == {"correlation_id": old.correlation_id, "approver": "bob"}
    timeline = (await operator.get(f"/sessions/{sid}")).text
    assert "operator:reassign_approval" in timeline


async def test_a_live_stream_open_at_logout_ends_with_the_login(
    operator: httpx.AsyncClient,
) -> None:
    """A tab left open kept its live counts streaming after its logout: the stream
    checked the login only when it opened. It now ends at its next tick."""
    async with operator.stream("GET", "/live") as live:
        assert live.status_code == 200
        lines = live.aiter_lines()
        assert (await anext(lines)).startswith("event: counts")
        csrf = csrf_of((await operator.get("/")).text)
        assert (await operator.post("/logout", data={"csrf": csrf})).status_code == 303

        async def rest() -> list[str]:
            return [line async for line in lines]

        # Bounded: the console's tick is 0.3 s; the old stream ran until the client left.
        await asyncio.wait_for(rest(), timeout=10)
