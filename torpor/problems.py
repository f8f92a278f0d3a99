"""The one map from torpor errors to HTTP problem details (RFC 9457).

Everything the HTTP edge answers with on failure goes through ``problem_for``. Each error
class carries its status and title (``torpor.errors``); the detail is the error's own
message only for errors whose message is written for the caller, and never a traceback.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torpor.errors import TorporError

TYPE_BASE = "https://torpor.dev/problems/"
UNAVAILABLE_RETRY_AFTER_S = 5


@dataclass(frozen=True)
class ProblemSpec:
    status: int
    code: str
    title: str
    detail: str | None
    retry_after: int | None = None

    def body(self, instance: str | None) -> dict[str, object]:
        return {
            "type": TYPE_BASE + self.code,
            "title": self.title,
            "status": self.status,
            "detail": self.detail,
            "instance": instance,
        }


INTERNAL = ProblemSpec(500, "internal", "Internal error", None)


def problem_for(exc: BaseException) -> ProblemSpec:
    if not isinstance(exc, TorporError):
        return INTERNAL
    if exc.status == 503:
        wait = exc.retry_after
        retry_after = max(1, math.ceil(wait)) if wait is not None else UNAVAILABLE_RETRY_AFTER_S
        return ProblemSpec(503, exc.problem_type, exc.title, "try again shortly", retry_after)
    if exc.status >= 500:  # internal: say nothing about it
        return INTERNAL
    if exc.status == 429 and exc.retry_after is not None:  # say when to come back
        wait_s = max(1, math.ceil(exc.retry_after))
        return ProblemSpec(429, exc.problem_type, exc.title, exc.problem_detail, wait_s)
    return ProblemSpec(exc.status, exc.problem_type, exc.title, exc.problem_detail)


def problem(status: int, code: str, title: str, detail: str | None = None) -> ProblemSpec:
    return ProblemSpec(status, code, title, detail)
