"""The pure side of compute work as a tool: keys, resources, and the retry policy as the
reconciler's poll applies it (a runner in memory: Ray is not the point here)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from pydantic import JsonValue

from torpor.ids import business_idempotency_key
from torpor.models import Wait
from torpor.settings import Settings
from torpor.tools import ToolSpec
from torpor.work import (
    FAILED,
    FINISHED,
    Fail,
    OnLost,
    Rerun,
    Resources,
    RetryPolicy,
    WorkOrder,
    WorkState,
    WorkStatus,
    WorkTool,
    after_loss,
    work_id,
)

NOW = datetime(2026, 11, 30, tzinfo=UTC)


def test_the_work_id_is_one_per_business_key() -> None:
    key = business_idempotency_key("acme", "ocr:s1:call_1", 1)
    assert work_id(key) == work_id(key)
    assert work_id(key) != work_id(business_idempotency_key("acme", "ocr:s1:call_1", 2))


def test_resources_become_ray_options_with_only_what_was_declared() -> None:
    declared = Resources(num_gpus=1, memory=2**30, resources={"fake_gpu": 1})
    assert declared.ray_options() == {
        "num_cpus": 1.0,
        "num_gpus": 1.0,
        "memory": 2**30,
        "resources": {"fake_gpu": 1},
    }
    assert "runtime_env" not in Resources().ray_options()


def test_a_lost_run_is_run_again_until_the_policy_runs_out() -> None:
    policy = RetryPolicy(max_runs=2)
    assert after_loss(policy, WorkStatus(WorkState.LOST, runs=1)) == Rerun(run=2)
    spent = after_loss(policy, WorkStatus(WorkState.LOST, runs=2, cause="NodeDiedError"))
    assert isinstance(spent, Fail) and "NodeDiedError" in spent.cause
    never = after_loss(RetryPolicy(on_lost=OnLost.FAIL), WorkStatus(WorkState.LOST, runs=1))
    assert isinstance(never, Fail)
    # A run that may still go on where nothing can stop it is never run beside itself.
    beside = WorkStatus(WorkState.LOST, runs=1, cause="its call may still run", rerunnable=False)
    unsafe = after_loss(policy, beside)
    assert isinstance(unsafe, Fail) and "may still run" in unsafe.cause


class MemoryRunner:
    def __init__(self, status: WorkStatus) -> None:
        self.state = status
        self.started: list[WorkOrder] = []
        self.stopped: list[str] = []
        self.orders: dict[str, WorkOrder] = {}

    def configure(self, settings: Settings) -> None:
        return None

    async def start(self, order: WorkOrder) -> None:
        self.orders.setdefault(order.work_id, order)
        self.started.append(order)

    async def status(self, work: str) -> WorkStatus:
        return self.state

    async def stop(self, work: str, *, reason: str) -> None:
        self.stopped.append(work)

    async def order(self, work: str) -> WorkOrder | None:
        return self.orders.get(work)


def wait() -> Wait:
    return Wait(
        wait_id="w1",
        correlation_id="c" * 32,
        waiting_step_id="1",
        epoch=1,
        action_key="ocr:s1:call_1",
        tool_name="ocr",
        tool_call_id="call_1",
        opened_at=NOW,
        deadline=NOW + timedelta(hours=1),
        expected_duration_s=60,
    )


def order() -> WorkOrder:
    key = business_idempotency_key("acme", "ocr:s1:call_1", 1)
    return WorkOrder(
        work_id=work_id(key),
        idempotency_key=key,
        tool_name="ocr",
        session_id="s1",
        tenant="acme",
        correlation_id="c" * 32,
        epoch=1,
        request={},
        deadline=NOW + timedelta(hours=1),
        trace_id="t",
    )


def tool(runner: Any, **kw: Any) -> WorkTool:
    return WorkTool(ToolSpec(name="ocr"), runner, **kw)


async def test_the_poll_reruns_a_lost_work_under_the_same_key_then_fails_the_wait() -> None:
    runner = MemoryRunner(WorkStatus(WorkState.LOST, runs=1, cause="WorkerCrashedError"))
    runner.orders[order().work_id] = order()
    ocr = tool(runner, retry=RetryPolicy(max_runs=2))
    assert await ocr.poll(wait(), tenant="acme") is None
    assert [(o.work_id, o.idempotency_key, o.run) for o in runner.started] == [
        (order().work_id, order().idempotency_key, 2)
    ]
    runner.state = WorkStatus(WorkState.LOST, runs=2, cause="WorkerCrashedError")
    failed = await ocr.poll(wait(), tenant="acme")
    assert failed is not None and failed.type == FAILED
    error: JsonValue = failed.data["error"]  # type: ignore[index,call-overload]
    assert error["code"] == "work_lost" and "WorkerCrashedError" in error["message"]  # type: ignore[index,call-overload,operator]


async def test_the_poll_delivers_an_outcome_whose_delivery_was_lost() -> None:
    outcome: dict[str, JsonValue] = {"status": "ok", "result": {"pages": 3}}
    ocr = tool(MemoryRunner(WorkStatus(WorkState.DONE, runs=1, outcome=outcome)))
    found = await ocr.poll(wait(), tenant="acme")
    assert found is not None
    assert (found.event_id, found.type, found.data) == (order().work_id, FINISHED, outcome)


async def test_a_running_work_is_left_alone_and_compensation_stops_it() -> None:
    runner = MemoryRunner(WorkStatus(WorkState.RUNNING, runs=1))
    ocr = tool(runner)
    assert await ocr.poll(wait(), tenant="acme") is None
    assert runner.started == []
    await ocr.compensate(wait(), tenant="acme", reason="cancelled", idempotency_key="k")
    assert runner.stopped == [order().work_id]
