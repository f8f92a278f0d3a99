"""kill -9 of a batch's results export between its pages and its done record.

An export is written a page of ``EXPORT_PAGE`` documents at a time (2 here, 256 in a
deployment), then the record that it is whole (``keys.batch_export``). A real child
process (``local_env``: the local folder store and the test Redis) asks for a finished
batch's results and dies by SIGKILL after a page: the first of three, or the last, with
every page written and no done record (``batch.export_page.<page>``). No reader serves
what it left as the export; the next read exports again, once, and answers every
document once, in order; reads after it answer that export without writing it again.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from storage import keys
from tests.support.crash import run_killed_at
from tests.support.harness import Env, local_env
from torpor.faults import CrashPoint
from torpor.service.batches import BatchService

pytestmark = pytest.mark.redis

DOCS, PAGE, PAGES = 5, 2, 3  # three pages: two of two documents, one of one
EXTRA: dict[str, Any] = {
    "agents": {
        "fin": {
            "factory": "torpor.agents.plan:PlanAgent",
            "options": {
                "plan": {"steps": [{"id": "done", "finish": "${input}"}]},
                "name": "fin",
                "version": "1",
            },
            "tools": [],
        }
    }
}
EXPORT_IN_CHILD = """
import asyncio, json, sys
from pathlib import Path
from tests.support.harness import local_env
from torpor.service import batch_export, batches

async def main() -> None:
    batch_export.EXPORT_PAGE = int(sys.argv[5])
    extra = json.loads(sys.argv[4])
    async with local_env(Path(sys.argv[1]), sys.argv[2], sys.argv[3], extra=extra) as env:
        await batches.BatchService(env.control).results("b_export", "jsonl")
    print("survived", flush=True)

asyncio.run(main())
"""


async def finished_batch(env: Env) -> BatchService:
    """A batch of ``DOCS`` documents whose sessions all completed, never exported."""
    batches = BatchService(env.control)
    docs = [{"id": f"d{i}", "doc": i} for i in range(DOCS)]
    await batches.submit(tenant="acme", agent="fin", batch_id="b_export", documents=docs)
    progress = await batches.progress("b_export")
    assert progress.finished and progress.by_state == {"COMPLETED": DOCS}
    return batches


async def exported(env: Env) -> dict[str, str]:
    """The export's objects (generation 0) and their etags."""
    store = env.services.store
    prefix = keys.batch_export("b_export", generation=0).removesuffix("done")
    return {k: (await store.get(k)).etag for k in (await store.list(prefix)).keys}


@pytest.mark.parametrize("killed_after", [0, PAGES - 1], ids=["first-page", "last-page"])
async def test_an_export_killed_before_its_done_record_is_never_served_and_redone_once(
    tmp_path: Path,
    redis_url: str,
    redis_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    killed_after: int,
) -> None:
    monkeypatch.setattr("torpor.service.batch_export.EXPORT_PAGE", PAGE)
    async with local_env(tmp_path, redis_url, redis_prefix, extra=EXTRA) as env:
        batches = await finished_batch(env)
        run_killed_at(
            f"{CrashPoint.BATCH_EXPORT_PAGE}.{killed_after}",
            EXPORT_IN_CHILD,
            str(tmp_path),
            redis_url,
            redis_prefix,
            json.dumps(EXTRA),
            str(PAGE),
        )
        pages = [keys.batch_export_page("b_export", p, generation=0) for p in range(PAGES)]
        done = keys.batch_export("b_export", generation=0)
        assert sorted(await exported(env)) == pages[: killed_after + 1], "no done record"
        # No reader takes the pages for the export, in any format.
        for fmt in ("jsonl", "parquet"):
            assert await env.services.batches.results("b_export", fmt, generation=0) is None

        lines = (await batches.results("b_export", "jsonl")).decode().splitlines()
        rows = [json.loads(line) for line in lines]
        assert [(r["index"], r["document_id"], r["state"], r["result"]) for r in rows] == [
            (i, f"d{i}", "COMPLETED", {"id": f"d{i}", "doc": i}) for i in range(DOCS)
        ]
        written = await exported(env)
        assert sorted(written) == [done, *pages]
        record = json.loads((await env.services.store.get(done)).data)
        assert record == {"pages": PAGES}

        # Whole now: read again, in either format, it is answered as it is, not redone.
        assert (await batches.results("b_export", "jsonl")).decode().splitlines() == lines
        table = pq.read_table(io.BytesIO(await batches.results("b_export", "parquet")))
        assert table.column("index").to_pylist() == list(range(DOCS))
        assert await exported(env) == written, "exported once"
