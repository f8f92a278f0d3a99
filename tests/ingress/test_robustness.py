"""Input robustness at the HTTP edge (issue 10): malformed input is a 4xx problem+json,
refused before anything is claimed or stored, and capability tokens stay out of logs."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest
from fastapi import FastAPI

from tests.ingress.conftest import Deployment, unique
from tests.ingress.test_http_api import (
    assert_problem,
    oa_body,
    reaches,
    session,
    signed,
    submit,
    waiting,
)
from tests.support.tools import World
from torpor.entry.http import install_problem_handlers

SURROGATE = '"\\ud800"'  # valid JSON text, but no Unicode string: a lone UTF-16 surrogate


def with_surrogate(body: bytes, field: str) -> bytes:
    """``body`` with the JSON string value of ``field`` replaced by a lone surrogate."""
    document = json.loads(body)
    marker = "@@SURROGATE@@"
    if field == "status":
        document["decision"]["status"] = marker
    else:
        document[field] = marker
    return json.dumps(document).replace(json.dumps(marker), SURROGATE).encode()


# -- lone surrogates ------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["eventId", "correlationId", "status"])
async def test_a_lone_surrogate_in_a_signed_webhook_is_400_and_claims_nothing(
    http: httpx.AsyncClient, deployment: Deployment, world: World, field: str
) -> None:
    sid = await waiting(http, deployment, world, unique("PR"))
    before = await session(http, deployment, sid)
    cid = before["waits"][0]["correlation_id"]
    event_id = unique("evt")
    good = oa_body(cid, event_id=event_id)
    bad = with_surrogate(good, field)
    nonce = unique("nonce-0123456789")
    response = await http.post(
        "/v1/hooks/oa", content=bad, headers=signed(deployment, "oa", bad, nonce=nonce)
    )
    assert_problem(response, 400)
    after = await session(http, deployment, sid)
    assert after["generation"] == before["generation"] and after["state"] == "SUSPENDED"
    # Nothing was claimed: the sender's corrected delivery, same nonce, gets in.
    fixed = await http.post(
        "/v1/hooks/oa", content=good, headers=signed(deployment, "oa", good, nonce=nonce)
    )
    assert fixed.status_code == 202, fixed.text
    await reaches(http, deployment, sid, "COMPLETED")


async def test_a_lone_surrogate_in_a_capability_answer_is_400_and_uses_nothing(
    http: httpx.AsyncClient, deployment: Deployment, world: World
) -> None:
    doc = unique("PR")
    sid = await waiting(http, deployment, world, doc)
    token = (await world.entries("dispatch"))[f"acme:approve:{doc}:1"]["token"]
    bad = ('{"status": ' + SURROGATE + "}").encode()
    response = await http.post(
        f"/v1/callbacks/{token}", content=bad, headers={"Content-Type": "application/json"}
    )
    assert_problem(response, 400)
    ok = await http.post(f"/v1/callbacks/{token}", json={"status": "approved"})
    assert ok.status_code == 202, ok.text
    await reaches(http, deployment, sid, "COMPLETED")


async def test_a_lone_surrogate_in_session_input_is_400(
    http: httpx.AsyncClient, deployment: Deployment
) -> None:
    body = ('{"agent": "purchase", "input": {"doc": ' + SURROGATE + "}}").encode()
    response = await http.post(
        "/v1/sessions",
        content=body,
        headers={
            **deployment.auth(),
            "Idempotency-Key": unique("k"),
            "Content-Type": "application/json",
        },
    )
    assert_problem(response, 400)


# -- Last-Event-ID ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    ["²".encode("latin-1"), b"9" * 5000, b"-1", b"1e3"],
    ids=["superscript", "5000", "neg", "exp"],
)
async def test_a_malformed_last_event_id_is_400(
    http: httpx.AsyncClient, deployment: Deployment, value: bytes
) -> None:
    sid = await submit(http, deployment, unique("PR"))
    headers: dict[str, str | bytes] = {**deployment.auth(), "Last-Event-ID": value}
    # Bounded: a value read as "no id" would open a stream that never ends (keep-alives).
    response = await asyncio.wait_for(
        http.get(f"/v1/sessions/{sid}/events", headers=headers), timeout=20
    )
    assert_problem(response, 400)


# -- reading bodies only for authenticated senders ------------------------------------------


async def test_noop_is_off_unless_the_benchmark_turns_it_on(http: httpx.AsyncClient) -> None:
    assert_problem(await http.post("/v1/noop", content=b"x" * 1000), 404)


async def test_capability_token_is_checked_before_the_body_is_read(
    http: httpx.AsyncClient, deployment: Deployment, world: World
) -> None:
    # A forged token with a declared 2 MiB body: refused for the token, not for the size,
    # so the token was looked at first.
    big = b'{"pad": "' + b"x" * (2 * 1024 * 1024) + b'"}'
    forged = await http.post(
        "/v1/callbacks/v1.e30.AAAA", content=big, headers={"Content-Type": "application/json"}
    )
    assert_problem(forged, 401)
    # A real token may send a small answer only: the capability limit, not the API one.
    doc = unique("PR")
    sid = await waiting(http, deployment, world, doc)
    token = (await world.entries("dispatch"))[f"acme:approve:{doc}:1"]["token"]
    padded = json.dumps({"status": "approved", "pad": "x" * 100_000}).encode()
    response = await http.post(
        f"/v1/callbacks/{token}", content=padded, headers={"Content-Type": "application/json"}
    )
    assert_problem(response, 413)
    assert (await session(http, deployment, sid))["state"] == "SUSPENDED"


# -- duplicate signature headers ---------------------------------------------------------------


async def test_two_signature_headers_are_refused_end_to_end(
    http: httpx.AsyncClient, deployment: Deployment, world: World
) -> None:
    sid = await waiting(http, deployment, world, unique("PR"))
    before = await session(http, deployment, sid)
    body = oa_body(before["waits"][0]["correlation_id"])
    headers = list(signed(deployment, "oa", body).items())
    # The valid signature first: a layer that keeps only one value would accept it.
    headers.append(("X-Torpor-Signature", "0" * 64))
    response = await http.post("/v1/hooks/oa", content=body, headers=headers)
    assert assert_problem(response, 401)["type"].endswith("/malformed_signature")
    after = await session(http, deployment, sid)
    assert after["generation"] == before["generation"] and after["state"] == "SUSPENDED"


# -- capability tokens stay out of logs and problem bodies ------------------------------------


async def test_a_failing_capability_request_echoes_no_token(
    http: httpx.AsyncClient, deployment: Deployment, world: World
) -> None:
    doc = unique("PR")
    await waiting(http, deployment, world, doc)
    token = (await world.entries("dispatch"))[f"acme:approve:{doc}:1"]["token"]
    response = await http.post(
        f"/v1/callbacks/{token}", content=b"x", headers={"Content-Type": "text/plain"}
    )
    body = assert_problem(response, 415)
    assert token not in response.text
    assert body["instance"] == "/v1/callbacks/[redacted]"


async def test_an_unexpected_error_on_a_capability_path_logs_no_token(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = FastAPI()
    install_problem_handlers(app)

    @app.post("/v1/callbacks/{token}")
    async def explode(token: str) -> None:
        raise RuntimeError("boom")

    token = "v1.eyJ0IjoiYWNtZSJ9.c2VjcmV0LW1hYy1ieXRlcw"
    with caplog.at_level(logging.ERROR, logger="torpor.ingress"):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            response = await client.post(f"/v1/callbacks/{token}")
    assert response.status_code == 500
    assert token not in response.text
    assert any("/v1/callbacks/[redacted]" in r.getMessage() for r in caplog.records)
    assert all(token not in r.getMessage() for r in caplog.records)
    assert response.json()["instance"] == "/v1/callbacks/[redacted]"
