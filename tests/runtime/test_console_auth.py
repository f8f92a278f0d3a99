"""Console logins at the HTTP edge, driven in-process (``tests.runtime.api_app``): what a
login cookie still opens once its login has ended."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.runtime.api_app import App, api_app
from tests.runtime.test_http_edge_input import FORM, suspended
from torpor.entry.console.login import COOKIE
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
