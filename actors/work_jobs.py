"""A Ray Job as a work's run (``ray_job_tool``), through the Jobs API: a client whose
every request has a deadline, a job's stop, how Ray says it lost a job (rather than
the job failing on its own), and the end of a job's driver log.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from actors.work_launch import Launch
from torpor.errors import WorkStopFailed

# Each request to the Jobs API (connect, then each read); a submit that uploads a
# working directory streams it in reads of its own, so this bounds silence, not size.
JOB_CALL_TIMEOUT_S = 30.0


async def _stop_job(client: Any, submission_id: str) -> None:
    """Stop a job. One never submitted, or over already (the dashboard may refuse to stop
    it: its agent went with it), is stopped; any other failure is ``WorkStopFailed``:
    it may still run, and the caller asks again."""
    try:
        await asyncio.to_thread(client.stop_job, submission_id)
        return
    except RuntimeError as exc:  # the client's every refused request
        if _no_such_job(exc):
            return
        failure: Exception = exc
    except OSError as exc:  # requests' own: no connection, no answer in time
        failure = exc
    try:
        status = await asyncio.to_thread(client.get_job_status, submission_id)
    except (RuntimeError, OSError):
        status = None  # not known to have ended: the stop's failure stands
    if status is not None and status.is_terminal():
        return
    raise WorkStopFailed(
        f"job {submission_id} could not be stopped: {type(failure).__name__}: {failure}"[:1000]
    ) from failure


# How Ray says it lost a job rather than the job failing on its own: its supervisor died
# (with its node) or the job never started. Not a runtime_env that could not be set up,
# nor the entrypoint's own error: a run again would meet those again.
_LOST_JOB_ERRORS = frozenset(
    {
        "JOB_SUPERVISOR_ACTOR_DIED",
        "JOB_SUPERVISOR_ACTOR_START_TIMEOUT",
        "JOB_SUPERVISOR_ACTOR_START_FAILURE",
        "JOB_SUPERVISOR_ACTOR_UNSCHEDULABLE",
    }
)


def _lost_to_ray(info: Any) -> bool:
    """Whether a FAILED job's info says Ray lost it (``_LOST_JOB_ERRORS``)."""
    from ray.job_submission import JobStatus

    error = getattr(info, "error_type", None)
    name = str(getattr(error, "value", error) or "")
    return getattr(info, "status", None) is JobStatus.FAILED and name in _LOST_JOB_ERRORS


def _no_such_job(exc: RuntimeError) -> bool:
    """The Jobs API's answer for a submission id it never had (its client raises every
    failed request as a ``RuntimeError`` carrying the status code)."""
    return "status code 404" in str(exc)


def _job_client(launch: Launch) -> Any:
    """A Jobs API client whose every request has a deadline (``JOB_CALL_TIMEOUT_S``)."""
    address = launch.job_address or _dashboard_url()
    return _deadline_client()(address)


@functools.cache
def _deadline_client() -> type:
    """Ray's ``JobSubmissionClient`` sends its requests with no timeout: a dashboard that
    accepts and never answers held the watcher's status poll (and a thread) for ever,
    and the session waited on a job nobody watched until its SLA. Each request now
    fails after the deadline; the watcher's run is then lost, and the next run adopts
    the job still running (``_running_job``)."""
    from ray.job_submission import JobSubmissionClient

    class DeadlineJobClient(JobSubmissionClient):
        def _do_request(self, method: str, endpoint: str, **kwargs: Any) -> Any:
            kwargs.setdefault("timeout", JOB_CALL_TIMEOUT_S)
            return super()._do_request(method, endpoint, **kwargs)

    return DeadlineJobClient


def _dashboard_url() -> str:
    from ray._private.services import get_webui_url_from_internal_kv
    from ray._private.worker import get_dashboard_url

    # The address the dashboard registered in the cluster's KV: a worker's own view
    # (``get_dashboard_url``) assumes the default port even when the dashboard is elsewhere.
    url = get_webui_url_from_internal_kv() or get_dashboard_url()  # type: ignore[no-untyped-call]
    return str(url) if str(url).startswith("http") else f"http://{url}"


LOGS_TAIL_CHARS = 2000
LOGS_TAIL_LINES = 200


def _logs_tail(submission_id: str, node_id: str | None) -> str:
    """The end of a job's driver log, read from its end: ``get_job_logs`` returned the
    whole log, and a job that ran for hours logging gigabytes took the watcher's memory
    (it declares none) to keep 2,000 characters of it."""
    from ray.util.state import get_log  # only a job's end needs the state API

    tail = ""
    try:
        for chunk in get_log(
            submission_id=submission_id,
            node_id=node_id,
            tail=LOGS_TAIL_LINES,
            errors="replace",
            timeout=30,
        ):
            tail = (tail + chunk)[-LOGS_TAIL_CHARS:]
    except Exception as exc:  # the answer stands without its logs
        return f"(logs unavailable: {type(exc).__name__})"
    return tail
