"""An OpenAPI-driven fuzz run (schemathesis) against the running app: no 5xx, ever."""

from __future__ import annotations

from typing import Any

import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.ingress.conftest import Deployment

EXAMPLES_PER_OPERATION = 25


def test_no_server_errors_anywhere(deployment: Deployment) -> None:
    schema = schemathesis.openapi.from_url(deployment.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 12
    seen: dict[str, set[int]] = {}
    for operation in operations:
        fuzz(operation, deployment, seen)
    assert set(seen) == {op.label for op in operations}


def fuzz(operation: Any, deployment: Deployment, seen: dict[str, set[int]]) -> None:
    @settings(
        max_examples=EXAMPLES_PER_OPERATION,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    @given(case=operation.as_strategy(), authenticated=st.booleans())
    def run(case: Any, authenticated: bool) -> None:
        # Half the runs carry a valid key, so the fuzzer reaches past authentication.
        headers = dict(case.headers or {})
        if authenticated:
            headers.update(deployment.auth())
        case.headers = headers
        response = case.call(base_url=deployment.url, timeout=30)
        seen.setdefault(operation.label, set()).add(response.status_code)
        assert response.status_code < 500, (operation.label, response.text[:300])
        if response.status_code >= 400:
            content_type = response.headers.get("content-type", "")
            assert "application/problem+json" in str(content_type), operation.label

    run()
