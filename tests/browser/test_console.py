"""The operator console in a real browser: sign in, list and filter, open a timeline,
take over a wait, resend a dead letter; a tenant key sees its own tenant only."""

from __future__ import annotations

import secrets

import httpx
from playwright.async_api import Page, expect

from tests.browser.conftest import ROOT, Console, sign_in
from torpor.deliveries import Delivery, DeliveryStatus
from torpor.lifecycle import SessionState
from torpor.ports.services import Services
from torpor.service.sessions import SessionService

SCREENSHOT = ROOT / "docs" / "console.png"


async def submit(control: SessionService, tenant: str = "acme", doc: str | None = None) -> str:
    doc = doc or f"PR-{secrets.token_hex(3)}"
    result = await control.submit(
        tenant=tenant, agent="purchase", input={"doc": doc, "amount": 1200.0}
    )
    return result.session_id


async def test_operator_lists_filters_and_opens_a_timeline(
    console: Console, control: SessionService, page: Page
) -> None:
    doc = f"PR-{secrets.token_hex(3)}"
    waiting = await submit(control, doc=doc)
    other = await submit(control, tenant="beta")
    assert (await control.get(waiting)).state is SessionState.SUSPENDED

    await sign_in(page, console, console.operator_key)
    rows = page.locator("table.sessions tbody tr")
    await expect(rows.filter(has_text=waiting)).to_have_count(1)
    await expect(rows.filter(has_text=other)).to_have_count(1)

    # Filter by tenant: beta's session stays, acme's goes.
    await page.select_option("select[name=tenant]", "beta")
    await page.click("form.filters button")
    await expect(rows.filter(has_text=other)).to_have_count(1)
    await expect(rows.filter(has_text=waiting)).to_have_count(0)
    # Filter by state: nothing of acme is COMPLETED yet.
    await page.select_option("select[name=tenant]", "acme")
    await page.select_option("select[name=state]", "COMPLETED")
    await page.click("form.filters button")
    await expect(rows.filter(has_text=waiting)).to_have_count(0)

    # Search by business key lands on the timeline.
    await page.fill("input[name=q]", doc)
    await page.click("form.search button")
    await expect(page.locator("#session-id")).to_have_text(waiting)
    wait = page.locator(".wait")
    await expect(wait).to_contain_text("request_approval")
    await expect(wait).to_contain_text("Guard baseline")
    await expect(page.locator("#tools")).to_contain_text("extract_fields")
    await expect(page.locator("#transitions")).to_contain_text("SUSPENDED")
    await expect(page.locator("#outbox")).to_contain_text("dispatched")


async def test_force_resolve_completes_the_session_through_the_gates(
    console: Console, control: SessionService, services: Services, page: Page
) -> None:
    sid = await submit(control)
    snapshot = await control.get(sid)
    correlation_id = snapshot.waits[0].correlation_id
    await sign_in(page, console, console.operator_key)

    # Search by correlation id, then take the wait over with a payload.
    await page.fill("input[name=q]", correlation_id)
    await page.click("form.search button")
    await expect(page.locator("#session-id")).to_have_text(sid)
    form = page.locator("form.resolve")
    await form.locator("textarea[name=payload]").fill('{"status": "approved", "by": "ops"}')
    await form.locator("input[name=reason]").fill("approver on leave, confirmed by phone")
    await form.locator("button").click()

    await expect(page.locator("#session-state")).to_have_text("COMPLETED", timeout=20_000)
    done = await control.get(sid)
    assert done.state is SessionState.COMPLETED
    assert done.result == {"decision": "approved", "doc": snapshot.input["doc"]}  # type: ignore[index]
    await page.reload()
    await expect(page.locator("#inbox")).to_contain_text("operator")
    await expect(page.locator("#inbox .verdict")).to_have_text("applied")
    audit = page.locator("#audit-records")
    await expect(audit).to_contain_text("operator:force_resolve")


async def test_tenant_key_sees_only_its_tenant_and_cannot_act(
    console: Console, control: SessionService, page: Page
) -> None:
    acme = await submit(control)
    beta = await submit(control, tenant="beta")
    await sign_in(page, console, console.keys["beta"])
    rows = page.locator("table.sessions tbody tr")
    await expect(rows.filter(has_text=beta)).to_have_count(1)
    await expect(rows.filter(has_text=acme)).to_have_count(0)
    await expect(page.locator("select[name=tenant] option")).to_have_count(2)  # "all", beta

    # Another tenant's session is simply not found, by URL or by search.
    answer = await page.goto(f"{console.url}/sessions/{acme}")
    assert answer is not None and answer.status == 404
    await page.goto(f"{console.url}/search?q={acme}")
    await expect(page.locator(".error")).to_contain_text("Nothing found")

    # Its own session reads, without a single action form; posting one anyway is refused.
    await page.goto(f"{console.url}/sessions/{beta}")
    await expect(page.locator("#session-id")).to_have_text(beta)
    await expect(page.locator("form.action")).to_have_count(0)
    csrf = await page.locator("input[name=csrf]").first.get_attribute("value")
    refused = await page.request.post(
        f"{console.url}/sessions/{beta}/cancel", form={"csrf": csrf or "", "reason": "x"}
    )
    assert refused.status == 403
    assert (await control.get(beta)).state is SessionState.SUSPENDED
    # Acting on another tenant's session is as not found as viewing it: a 403 there
    # (the role checked first) told that the id exists.
    form = {"csrf": csrf or "", "reason": "x", "payload": "{}", "correlation_id": "c"}
    for action in ("cancel", "retry", "resolve"):
        foreign = await page.request.post(f"{console.url}/sessions/{acme}/{action}", form=form)
        missing = await page.request.post(
            f"{console.url}/sessions/s_00000000000000000000/{action}", form=form
        )
        assert (foreign.status, missing.status) == (404, 404), action
    assert (await control.get(acme)).state is SessionState.SUSPENDED


async def test_actions_need_the_csrf_token_and_a_login(
    console: Console, control: SessionService, page: Page
) -> None:
    sid = await submit(control)
    await sign_in(page, console, console.operator_key)
    # The browser holds a valid login cookie, but the form lacks the token.
    forged = await page.request.post(f"{console.url}/sessions/{sid}/cancel", form={"reason": "x"})
    assert forged.status == 400
    async with httpx.AsyncClient() as anonymous:
        answer = await anonymous.post(f"{console.url}/sessions/{sid}/cancel", data={"reason": "x"})
        assert answer.status_code == 401
    forged_cookie = {"torpor_console": "eyJyIjoib3BlcmF0b3IifQ.00"}
    async with httpx.AsyncClient(cookies=forged_cookie) as tampering:
        tampered = await tampering.get(f"{console.url}/")
        assert tampered.status_code == 303  # back to the login page
    # Any bytes at all, from anyone: no 500 (compare_digest refused non-ASCII str).
    for mac in ("%C3%A9", "\u00e9"):
        raw = {"Cookie": f"torpor_console=e30.{mac}".encode()}  # sent as UTF-8 bytes
        async with httpx.AsyncClient() as odd:
            for path in ("/", "/live"):
                answer = await odd.get(f"{console.url}{path}", headers=raw)
                assert answer.status_code in (303, 401), (path, answer.status_code)
            answer = await odd.post(f"{console.url}/logout", headers=raw)
            assert answer.status_code < 500
    assert (await control.get(sid)).state is SessionState.SUSPENDED


async def dead_delivery(services: Services, session_id: str) -> Delivery:
    """A notification that gave up, as the delivery worker leaves one."""
    delivery = Delivery(
        delivery_id=f"d_{secrets.token_hex(6)}",
        tenant="acme",
        session_id=session_id,
        url="https://hooks.example.com/torpor",
        event_type="session.completed",
        payload={"session_id": session_id},
        created_at=services.clock.now(),
    )
    assert await services.deliveries.create(delivery)
    return await services.deliveries.update(
        "acme",
        delivery.delivery_id,
        lambda d: d.model_copy(
            update={"status": DeliveryStatus.DEAD, "attempts": 8, "last_error": "HTTP 503"}
        ),
    )


async def test_operator_resends_a_dead_letter(
    console: Console, control: SessionService, services: Services, page: Page
) -> None:
    sid = await submit(control)
    dead = await dead_delivery(services, sid)
    await sign_in(page, console, console.operator_key)
    row = page.locator(f"#dead tr[data-delivery='{dead.delivery_id}']")
    await expect(row).to_contain_text("HTTP 503")
    await row.locator("input[name=reason]").fill("receiver fixed their TLS certificate")
    await row.locator("button").click()

    await expect(page.locator(f"#dead tr[data-delivery='{dead.delivery_id}']")).to_have_count(0)
    resent = await services.deliveries.get("acme", dead.delivery_id)
    assert resent.status is DeliveryStatus.PENDING
    assert resent.attempts == 0
    # Who and why: the audit record names the operator's key, its action record the reason.
    await page.goto(f"{console.url}/sessions/{sid}")
    await expect(page.locator("#audit-records")).to_contain_text("operator:resend_delivery")


async def test_operator_cancels_with_a_reason(
    console: Console, control: SessionService, page: Page
) -> None:
    sid = await submit(control)
    await sign_in(page, console, console.operator_key)
    await page.goto(f"{console.url}/sessions/{sid}")
    form = page.locator("form.danger")
    await form.locator("button").click()  # no reason: the browser refuses to send it
    await expect(page.locator("#session-state")).to_have_text("SUSPENDED")
    await form.locator("input[name=reason]").fill("duplicate purchase request")
    await form.locator("button").click()
    await expect(page.locator("#session-state")).to_have_text("CANCELLED", timeout=20_000)
    assert (await control.get(sid)).state is SessionState.CANCELLED


async def test_counts_update_without_reload(
    console: Console, control: SessionService, page: Page
) -> None:
    await sign_in(page, console, console.operator_key)
    suspended = page.locator("[data-count=SUSPENDED]")
    before = int(await suspended.inner_text())
    await expect(page.locator("body[data-live='1']")).to_have_count(1)  # stream is open
    await submit(control)
    await submit(control, tenant="beta")
    await expect(suspended).to_have_text(str(before + 2), timeout=20_000)


async def test_the_cli_login_link_signs_in_without_sending_the_key(
    console: Console, page: Page
) -> None:
    """`torpor console` prints `{public_url}/console/login#key=...`: the page signs in
    with the key from the fragment, which no request carries, and drops it from the URL."""
    requested: list[str] = []
    page.on("request", lambda request: requested.append(request.url))
    await page.goto(console.url + "/login#key=" + console.operator_key)
    await page.wait_for_url(console.url + "/")
    await expect(page.locator("table.sessions")).to_be_visible()
    assert "#key=" not in page.url
    assert all(console.operator_key not in url for url in requested)


async def test_session_list_screenshot(console: Console, page: Page) -> None:
    """Last in this module, so the list holds what the tests above left: completed,
    cancelled and waiting sessions of two tenants. The README shows the file."""
    await sign_in(page, console, console.operator_key)
    await expect(page.locator("table.sessions .s-COMPLETED").first).to_be_visible()
    await expect(page.locator("body[data-live='1']")).to_have_count(1)
    SCREENSHOT.parent.mkdir(exist_ok=True)
    await page.screenshot(path=str(SCREENSHOT), full_page=False)
    assert SCREENSHOT.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
