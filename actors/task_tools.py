"""Sync tools whose calls run as Ray tasks (``execution = "task"``) instead of inline.

:class:`RayTaskExecutor` names each task by the call's ``H(session:step:call)`` key and
joins it while in flight, so the loop only awaits its result.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import ray
from pydantic import JsonValue
from ray.exceptions import RayTaskError

from actors.work_launch import _spec
from torpor.tools import ToolContext
from torpor.work import ExecutedTool, TaskExecution

log = logging.getLogger(__name__)


def _call_tool(fn: Callable[..., Any], args: dict[str, Any], ctx: ToolContext) -> Any:
    out = fn(args, ctx)
    if asyncio.iscoroutine(out):
        return asyncio.run(out)
    return out


class RayTaskExecutor:
    """``torpor.work.TaskExecutor`` on Ray: each call is a task named by its call key."""

    def __init__(self) -> None:
        self._inflight: dict[str, Any] = {}

    async def run(
        self, fn: Any, args: dict[str, Any], ctx: ToolContext, *, execution: TaskExecution
    ) -> JsonValue:
        key = ctx.idempotency_key
        ref = self._inflight.get(key)
        if ref is None:  # joined while in flight: a retry in this process runs nothing twice
            options = {
                **execution.resources.ray_options(),
                "max_retries": execution.retries,
                "name": f"tool:{key}",
            }
            ref = ray.remote(_call_tool).options(**options).remote(fn, args, ctx)
            self._inflight[key] = ref
        started = time.monotonic()
        try:
            out: JsonValue = await ref
        except asyncio.CancelledError:
            # The loop's deadline passed: stop the task, its outcome is unknown.
            ray.cancel(ref, force=True)
            raise
        except RayTaskError as exc:
            raise exc.as_instanceof_cause() from None  # type: ignore[no-untyped-call]
        finally:
            # However it ended (a Ray failure too: a crashed worker, a memory kill), the
            # call is over: a ref kept would be joined by the same call again, dead.
            if self._inflight.get(key) is ref:
                del self._inflight[key]
        log.debug("task tool call %s took %.3f s", key, time.monotonic() - started)
        return out


def task_tool(
    name: str,
    *,
    description: str = "",
    parameters: dict[str, Any] | None = None,
    execution: TaskExecution | None = None,
    version: str = "1",
) -> Callable[[Callable[..., Any]], ExecutedTool]:
    """Decorator: a sync tool ``fn(args, ctx)`` whose calls run as Ray tasks
    (``execution="task"``) with the given resources, timeout and retries."""

    def wrap(fn: Callable[..., Any]) -> ExecutedTool:
        return ExecutedTool(
            fn,
            _spec(name, description or (fn.__doc__ or "").strip(), parameters),
            RayTaskExecutor(),
            execution or TaskExecution(execution="task"),
            version,
        )

    return wrap
