"""Console logins at the HTTP edge, driven in-process (``tests.runtime.api_app``): what a
login cookie still opens once its login has ended."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from tests.runtime.api_app import App, api_app, csrf_in
from tests.runtime.test_http_edge_input import FORM, suspended
from torpor.entry.console.login import COOKIE, LOGIN_COOKIE
from torpor.lifecycle import SessionState


@pytest.fixture
async def app(
    tmp_path: Path, redis_url: str, redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[App]:
    async with api_app(tmp_path, redis_url, redis_prefix, monkeypatch) as a:
        yield a


async def test_a_cookie_replayed_after_logout_opens_nothing(app: App) -> None:
    session_id = await suspended(app)
    csrf = await app.console_login(app.operator_key)
    cookie = app.http.cookies[COOKIE]
    assert (
        await app.http.post("/console/logout", content=f"csrf={csrf}", headers=FORM)
    ).is_redirect
    assert COOKIE not in app.http.cookies
    # A copy of the cookie taken before the logout (a shared machine, a proxy's log, a
    # saved HAR file) is no login: not a page, not an action, not a live stream.
    copied = {"Cookie": f"{COOKIE}={cookie}"}
    page = await app.http.get("/console/", headers=copied)
    assert (page.status_code, page.headers["location"]) == (303, "/console/login")
    cancel = await app.http.post(
        f"/console/sessions/{session_id}/cancel",
        content=f"csrf={csrf}&reason=replayed",
        headers={**FORM, **copied},
    )
    assert cancel.status_code == 401
    assert (await app.http.get("/console/live", headers=copied)).status_code == 401
    assert (await app.env.load(session_id)).state is SessionState.SUSPENDED
    # The key itself still signs in: a new login, a new cookie.
    await app.console_login(app.operator_key)
    assert (await app.http.get(f"/console/sessions/{session_id}")).status_code == 200


async def test_a_sign_in_posted_without_its_forms_token_signs_nobody_in(app: App) -> None:
    """A page on another site can post a key of its own to ``/login`` (login CSRF): the
    browser would then be signed in as the attacker's tenant, and what the operator typed
    went there. A sign-in needs the token of a form this console served to this browser."""
    key = f"key={app.operator_key}"
    forged = await app.http.post("/console/login", content=key, headers=FORM)
    assert forged.status_code == 403 and COOKIE not in app.http.cookies
    # The token of another browser's form (its cookie is not this one's) is no better.
    async with httpx.AsyncClient(transport=app.http._transport, base_url="http://test") as other:
        theirs = csrf_in((await other.get("/console/login")).text)
    await app.http.get("/console/login")  # this browser's form cookie, a nonce of its own
    forged = await app.http.post("/console/login", content=f"{key}&csrf={theirs}", headers=FORM)
    assert forged.status_code == 403 and COOKIE not in app.http.cookies
    mine = csrf_in((await app.http.get("/console/login")).text)
    signed = await app.http.post("/console/login", content=f"{key}&csrf={mine}", headers=FORM)
    assert signed.status_code == 303 and COOKIE in app.http.cookies
    assert LOGIN_COOKIE not in app.http.cookies  # used once


async def test_every_console_answer_forbids_type_sniffing(app: App) -> None:
    csrf = await app.console_login(app.operator_key)
    session_id = await suspended(app)
    answers = [
        await app.http.get("/console/login"),
        await app.http.get("/console/"),
        await app.http.get(f"/console/sessions/{session_id}"),
        await app.http.get("/console/static/console.js"),
        await app.http.get("/console/static/nothing.js"),  # 404
        await app.http.post(  # a refused form: problem+json
            f"/console/sessions/{session_id}/cancel", content="reason=x", headers=FORM
        ),
        await app.http.post("/console/logout", content=f"csrf={csrf}", headers=FORM),
        await app.http.get("/console/live"),  # 401 once logged out
    ]
    assert [a.headers.get("x-content-type-options") for a in answers] == ["nosniff"] * len(
        answers
    ), [(a.request.url.path, a.status_code) for a in answers]
