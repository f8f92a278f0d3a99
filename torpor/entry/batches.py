"""What the HTTP edge shows of a batch: its progress, caps, links and its sessions a page
at a time."""

from __future__ import annotations

from enum import StrEnum

from torpor.api import BatchAdmission, BatchOut, BatchSessionItem, BatchSessionList
from torpor.batches import SESSIONS_PAGE, sessions_page
from torpor.service.batches import BatchService


class ResultFormat(StrEnum):
    JSONL = "jsonl"
    PARQUET = "parquet"

    @property
    def media_type(self) -> str:
        return (
            "application/x-ndjson"
            if self is ResultFormat.JSONL
            else "application/vnd.apache.parquet"
        )


async def batch_out(batches: BatchService, batch_id: str, tenant: str) -> BatchOut:
    manifest = await batches.get(batch_id, tenant=tenant)
    # The retry generations once, for the progress and the sessions both: the two agree
    # on each document's current session, and a poll reads each generation once.
    attempts = await batches.attempts(manifest)
    progress = await batches.progress_of(manifest, attempts=attempts)
    usage = await batches.usage(manifest)
    # Each document's current session (its latest retry's), as progress counts it and the
    # results name it: the first ones led a client to a FAILED attempt after a retry. The
    # first page only: the rest are a walk of ``batch_sessions`` from ``next_cursor``.
    first = sessions_page(attempts, cursor=None, limit=SESSIONS_PAGE)
    settings = batches.settings
    base = f"/v1/batches/{batch_id}"
    return BatchOut(
        batch_id=batch_id,
        agent=manifest.agent,
        total=progress.total,
        done=progress.done,
        finished=progress.finished,
        by_state=progress.by_state,
        session_ids=first.session_ids,
        next_cursor=first.next_cursor,
        links={
            "self": base,
            "sessions": f"{base}/sessions",
            "cancel": f"{base}/cancel",
            "retry": f"{base}/retry",
            "results": f"{base}/results",
        },
        created=progress.created,
        cancelled=progress.cancelled,
        eta_s=progress.eta_s,
        purged=progress.purged,
        admission=None
        if usage is None
        else BatchAdmission(
            max_running=manifest.max_running or settings.max_running_per_batch,
            max_running_per_tenant=settings.max_running_per_tenant,
            running=usage[0].running,
            waiting=usage[0].waiting,
            tenant_running=usage[1].running,
        ),
    )


async def batch_sessions(
    batches: BatchService, batch_id: str, tenant: str, *, cursor: str | None, limit: int
) -> BatchSessionList:
    page = await batches.session_page(batch_id, tenant=tenant, cursor=cursor, limit=limit)
    return BatchSessionList(
        items=[
            BatchSessionItem(index=page.start + i, session_id=sid)
            for i, sid in enumerate(page.session_ids)
        ],
        next_cursor=page.next_cursor,
    )
