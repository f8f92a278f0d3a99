"""Compute-work tools for the Ray work tests: an "OCR model" on a fake GPU node.

Every run counts itself in Redis under the work's idempotency key (starts and
completions), records its node and process, and can be held at a gate until the test
lets it finish, so a test can kill its process, its node or its session meanwhile.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import ray
import redis

from actors.ray_work import WorkContext, ray_actor_tool, ray_task_tool, task_tool
from torpor.tools import DispatchRequest, ToolContext
from torpor.work import Resources, RetryPolicy, TaskExecution, WorkTool

HOLD_LIMIT_S = 120.0


def _redis(args: dict[str, Any]) -> tuple[redis.Redis, str]:
    return redis.Redis.from_url(str(args["redis"]), decode_responses=True), str(args["prefix"])


@ray_task_tool(
    "ocr",
    description="Read every page of a scanned document on a GPU node.",
    resources=Resources(num_cpus=0.5, resources={"fake_gpu": 1}),
    retry=RetryPolicy(max_runs=2),
    expected_duration_s=1.0,  # overdue after 2 s: the reconciler's poll then looks
)
def ocr(args: dict[str, Any], ctx: WorkContext) -> dict[str, Any]:
    r, p = _redis(args)
    key = ctx.idempotency_key
    node = ray.get_runtime_context().get_node_id()
    r.hincrby(p + "work:starts", key, 1)
    r.hset(p + "work:where", key, json.dumps({"node": node, "pid": os.getpid(), "run": ctx.run}))
    ctx.progress(0.4, "page 12/30")
    deadline = time.monotonic() + HOLD_LIMIT_S
    while args.get("hold") and not r.exists(f"{p}work:gate"):
        if time.monotonic() > deadline:
            raise RuntimeError("the gate never opened")
        time.sleep(0.05)
    if args.get("fail"):
        raise ValueError("page 13 is unreadable")
    r.hincrby(p + "work:completions", key, 1)
    r.close()
    if args.get("odd"):  # a result Python holds and JSON cannot: a key that is no string
        return {(1, 2): "pages 1 and 2"}
    return {"pages": 30, "node": node, "run": ctx.run, "text": "x" * int(args.get("size", 0))}


class CrashingOcr(WorkTool):
    """``ocr``, but the first dispatch kills the session's process right after the work was
    started and before the outbox entry is settled: the next activation dispatches again."""

    def __init__(self) -> None:
        super().__init__(ocr.spec, ocr.runner, retry=ocr.retry, expected_duration_s=1.0)

    async def dispatch(self, request: DispatchRequest) -> None:
        await super().dispatch(request)
        r, p = _redis(dict(request.request))
        r.hincrby(p + "work:dispatches", request.idempotency_key, 1)
        if r.set(p + "work:crashed", "1", nx=True):
            os.kill(os.getpid(), signal.SIGKILL)


MODEL_NAMESPACE = "torpor-test-models"


class OcrModel:
    """A model server: a named actor holding its (fake) GPU between calls."""

    def read(self, args: dict[str, Any], ctx: WorkContext) -> dict[str, Any]:
        r, p = _redis(args)
        r.hincrby(p + "model:calls", ctx.idempotency_key, 1)
        deadline = time.monotonic() + HOLD_LIMIT_S
        while args.get("hold") and not r.exists(f"{p}work:gate"):
            if time.monotonic() > deadline:
                raise RuntimeError("the gate never opened")
            time.sleep(0.05)
        r.close()
        ctx.progress(1.0, "read")
        return {"pages": 7, "pid": os.getpid(), "node": ray.get_runtime_context().get_node_id()}


ocr_model = ray_actor_tool(
    "ocr_model",
    actor="ocr-model",
    method="read",
    namespace=MODEL_NAMESPACE,
    retry=RetryPolicy(max_runs=2),
    expected_duration_s=1.0,  # overdue after 2 s: the reconciler's poll then looks
)


def crashing_ocr() -> list[Any]:
    return [CrashingOcr()]


@task_tool(
    "heavy_parse",
    execution=TaskExecution(execution="task", resources=Resources(num_cpus=0.5), timeout_s=30),
)
def heavy_parse(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    r, p = _redis(args)
    r.hincrby(p + "task:runs", ctx.idempotency_key, 1)
    r.close()
    return {"pid": os.getpid(), "key": ctx.idempotency_key}


@task_tool(
    "slow_parse",
    execution=TaskExecution(execution="task", resources=Resources(num_cpus=0.5), timeout_s=1.0),
)
def slow_parse(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    r, p = _redis(args)
    r.hincrby(p + "task:slow_starts", ctx.idempotency_key, 1)
    time.sleep(60)
    r.hincrby(p + "task:slow_done", ctx.idempotency_key, 1)
    return {"done": True}


def where_am_i(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    return {"pid": os.getpid()}


def _inline_pid() -> Any:
    from torpor.tools import sync_tool

    return sync_tool("where_am_i")(where_am_i)


inline_pid = _inline_pid()

OCR_ARGS = {
    "doc": "${input.doc}",
    "redis": "${input.redis}",
    "prefix": "${input.prefix}",
    "hold": "${input.hold}",
    "fail": "${input.fail}",
    "size": "${input.size}",
    "odd": "${input.odd}",
}

OCR_PLAN: dict[str, Any] = {
    "steps": [
        {"id": "ocr", "calls": [{"tool": "ocr", "args": OCR_ARGS}], "on_error": "done"},
        {"id": "done", "finish": {"ocr": "${results.ocr}"}},
    ]
}


def model_plan() -> dict[str, Any]:
    return {
        "steps": [
            {"id": "ocr", "calls": [{"tool": "ocr_model", "args": OCR_ARGS}]},
            {"id": "done", "finish": {"ocr": "${results.ocr}"}},
        ]
    }


def task_plan(tool: str) -> dict[str, Any]:
    """Where the inline tool runs (the session's process), then ``tool`` as a task."""
    args = {"redis": "${input.redis}", "prefix": "${input.prefix}"}
    return {
        "steps": [
            {"id": "here", "calls": [{"tool": "where_am_i", "args": {}}]},
            {"id": "parse", "calls": [{"tool": tool, "args": args}], "on_error": "done"},
            {"id": "done", "finish": {"here": "${results.here}", "parse": "${results.parse}"}},
        ]
    }


def work_agents() -> dict[str, Any]:
    """Settings fragment: the agents of the Ray work tests."""
    return {
        "scan": {
            "factory": "torpor.agents.plan:PlanAgent",
            "options": {"plan": OCR_PLAN, "name": "scan", "version": "1"},
            "tools": ["tests.support.work_tools:ocr"],
        },
        "scan_model": {
            "factory": "torpor.agents.plan:PlanAgent",
            "options": {"plan": model_plan(), "name": "scan_model", "version": "1"},
            "tools": ["tests.support.work_tools:ocr_model"],
        },
        "scan_crash": {
            "factory": "torpor.agents.plan:PlanAgent",
            "options": {"plan": OCR_PLAN, "name": "scan_crash", "version": "1"},
            "tools": ["tests.support.work_tools:crashing_ocr"],
        },
        **{
            agent: {
                "factory": "torpor.agents.plan:PlanAgent",
                "options": {"plan": task_plan(tool), "name": agent, "version": "1"},
                "tools": [
                    "tests.support.work_tools:inline_pid",
                    f"tests.support.work_tools:{tool}",
                ],
            }
            for agent, tool in (("parse", "heavy_parse"), ("parse_slow", "slow_parse"))
        },
    }
