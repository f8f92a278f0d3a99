"""An OpenAPI-driven fuzz run (schemathesis) against the running app: no 5xx, ever.

Random path parameters stop at the first lookup (404, 401), so half the runs put
realistic ones in: the id of a real (finished) session, so the SSE route streams its
history and ends, and capability tokens minted for it with the app's key (fresh and
expired), so the capability route gets past the token to the body.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import eventually
from tests.ingress.conftest import Deployment, unique
from tests.support.harness import CAPABILITY_KEY
from torpor.lifecycle import SessionState
from torpor.webhooks.capability import mint

EXAMPLES_PER_OPERATION = 25


@dataclass(frozen=True)
class Realistic:
    """Path parameter values that exist in the running app."""

    session_id: str
    tokens: tuple[str, ...]

    def strategy(self, name: str) -> st.SearchStrategy[str] | None:
        if name == "session_id":
            return st.just(self.session_id)
        if name == "token":
            return st.sampled_from(self.tokens)
        return None


async def realistic_ids(deployment: Deployment) -> Realistic:
    """A session that is submitted, then cancelled (so its event stream ends), and tokens."""
    async with httpx.AsyncClient(base_url=deployment.url, timeout=30) as http:
        auth = deployment.auth()
        created = await http.post(
            "/v1/sessions",
            headers={**auth, "Idempotency-Key": unique("fuzz")},
            json={"agent": "purchase", "input": {"doc": unique("FZ"), "amount": 1.0}},
        )
        assert created.status_code == 202, created.text
        sid = str(created.json()["session_id"])
        assert (await http.post(f"/v1/sessions/{sid}/cancel", headers=auth)).status_code < 300

        async def finished() -> bool:
            state = (await http.get(f"/v1/sessions/{sid}", headers=auth)).json()["state"]
            return SessionState(state).terminal

        await eventually(finished, what=f"{sid} is cancelled")

    def token(expires_at: datetime) -> str:
        return mint(
            key=CAPABILITY_KEY.encode(),
            tenant="acme",
            session_id=sid,
            wait_id="w-fuzz",
            correlation_id=unique("c-fuzz"),
            epoch=1,
            expires_at=expires_at,
        )

    soon = datetime.now(UTC) + timedelta(hours=1)
    return Realistic(sid, (token(soon), token(soon), token(soon - timedelta(hours=2))))


def test_no_server_errors_anywhere(deployment: Deployment) -> None:
    schema = schemathesis.openapi.from_url(deployment.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 12
    realistic = asyncio.run(realistic_ids(deployment))
    seen: dict[str, set[int]] = {}
    real: dict[str, set[int]] = {}  # statuses of the runs with realistic ids
    for operation in operations:
        fuzz(operation, deployment, realistic, seen, real)
    assert set(seen) == {op.label for op in operations}
    # The realistic ids got past the lookups (not only 401/404) on the two routes.
    assert real["GET /v1/sessions/{session_id}/events"] - {401, 404}
    assert real["POST /v1/callbacks/{token}"] - {401, 404}


def fuzz(
    operation: Any,
    deployment: Deployment,
    realistic: Realistic,
    seen: dict[str, set[int]],
    real_ids: dict[str, set[int]],
) -> None:
    names = re.findall(r"\{(\w+)\}", operation.path)
    real = {n: s for n in names if (s := realistic.strategy(n)) is not None}

    @settings(
        max_examples=EXAMPLES_PER_OPERATION,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    @given(
        case=operation.as_strategy(),
        authenticated=st.booleans(),
        ids=st.fixed_dictionaries(real) if real else st.just({}),
        use_ids=st.booleans(),
    )
    def run(case: Any, authenticated: bool, ids: dict[str, str], use_ids: bool) -> None:
        # Half the runs carry a valid key, so the fuzzer reaches past authentication.
        headers = dict(case.headers or {})
        if authenticated:
            headers.update(deployment.auth())
        case.headers = headers
        if use_ids and ids:
            case.path_parameters = {**(case.path_parameters or {}), **ids}
        response = case.call(base_url=deployment.url, timeout=30)
        seen.setdefault(operation.label, set()).add(response.status_code)
        if use_ids and ids:
            real_ids.setdefault(operation.label, set()).add(response.status_code)
        assert response.status_code < 500, (operation.label, response.text[:300])
        if response.status_code >= 400:
            content_type = response.headers.get("content-type", "")
            assert "application/problem+json" in str(content_type), operation.label

    run()
