"""The batch routes of the HTTP edge, driven in-process (``tests.runtime.api_app``): what
a client reads of a batch, and what it is refused (problem+json, never a 500)."""

from __future__ import annotations

import io
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from tests.conftest import eventually
from tests.runtime.api_app import App, api_app


@pytest.fixture
async def app(
    tmp_path: Path, redis_url: str, redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[App]:
    async with api_app(tmp_path, redis_url, redis_prefix, monkeypatch) as a:
        yield a


async def a_batch(app: App, n: int = 3) -> dict[str, Any]:
    """Tenant acme's batch of ``n`` documents, as its 202 answers it."""
    answer = await app.http.post(
        "/v1/batches",
        headers={**app.auth(), "Idempotency-Key": f"batch-of-{n}"},
        json={
            "agent": "purchase",
            "documents": [{"doc": f"PR-{i}", "amount": 5} for i in range(n)],
        },
    )
    assert answer.status_code == 202, answer.text
    batch: dict[str, Any] = answer.json()
    return batch


async def test_a_batchs_sessions_are_walked_a_page_at_a_time_to_the_end(app: App) -> None:
    batch = await a_batch(app, 3)
    assert batch["next_cursor"] is None, "a batch of one page lists it whole, as before"
    walked: list[dict[str, Any]] = []
    url, params = batch["links"]["sessions"], {"limit": "2"}
    while True:
        answer = await app.http.get(url, params=params, headers=app.auth())
        assert answer.status_code == 200, answer.text
        page = answer.json()
        assert len(page["items"]) <= 2
        walked.extend(page["items"])
        if page["next_cursor"] is None:
            break
        params = {"limit": "2", "cursor": page["next_cursor"]}
    assert walked == [{"index": i, "session_id": s} for i, s in enumerate(batch["session_ids"])]


@pytest.mark.parametrize(
    "params",
    [{"cursor": "x"}, {"cursor": "3"}, {"cursor": "9" * 200}, {"limit": "0"}, {"limit": "1001"}],
    ids=["text", "past-the-end", "too-long", "zero", "over-max"],
)
async def test_a_bad_cursor_or_limit_of_a_batchs_sessions_is_a_400_problem(
    app: App, params: dict[str, str]
) -> None:
    batch = await a_batch(app)
    answer = await app.http.get(batch["links"]["sessions"], params=params, headers=app.auth())
    assert answer.status_code == 400, answer.text
    assert answer.headers["content-type"] == "application/problem+json"
    problem = answer.json()
    assert problem["type"].endswith("/invalid_request")
    assert next(iter(params)) in problem["detail"], "it says which parameter"


async def test_another_tenants_batch_has_no_sessions_to_list(app: App) -> None:
    batch = await a_batch(app)
    answer = await app.http.get(batch["links"]["sessions"], headers=app.auth("beta"))
    assert answer.status_code == 404, answer.text
    assert answer.headers["content-type"] == "application/problem+json"


async def test_a_finished_batchs_results_are_sent_a_page_of_documents_at_a_time(
    app: App, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The export was built whole and sent from one buffer: Parquet as one row group of
    every document. Each page of documents is now its own row group, encoded as sent."""
    monkeypatch.setattr("torpor.service.batch_export.EXPORT_PAGE", 2)
    batch = await a_batch(app, 5)
    cancel = await app.http.post(batch["links"]["cancel"], headers=app.auth())
    assert cancel.status_code == 202, cancel.text

    async def exported() -> bool:  # its fan-out and cancel end every session first
        answer = await app.http.get(batch["links"]["results"], headers=app.auth())
        return answer.status_code == 200

    await eventually(exported, timeout_s=10, what="the cancelled batch's results")
    jsonl = await app.http.get(batch["links"]["results"], headers=app.auth())
    assert jsonl.headers["content-type"] == "application/x-ndjson"
    rows = [json.loads(line) for line in jsonl.content.splitlines()]
    assert [(r["index"], r["session_id"], r["state"]) for r in rows] == [
        (i, sid, "CANCELLED") for i, sid in enumerate(batch["session_ids"])
    ]
    answer = await app.http.get(
        batch["links"]["results"], params={"format": "parquet"}, headers=app.auth()
    )
    assert answer.status_code == 200, answer.text
    parquet = pq.ParquetFile(io.BytesIO(answer.content))
    assert parquet.num_row_groups == 3
    assert parquet.read().column("session_id").to_pylist() == batch["session_ids"]
