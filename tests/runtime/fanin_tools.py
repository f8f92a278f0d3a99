"""Long-running probe tools for the fan-in tests, imported by path by the plugin resolver.

``quote`` asks one vendor (one wait per call: several calls in one turn form a group);
``quotes`` asks every vendor in its arguments at once (one wait per member, one group,
one aggregated result). Both can compensate, and record every dispatch and every undo
in ``RECORD`` so a test can count them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torpor.errors import ToolError
from torpor.models import DriftPolicy, FanInSpec, GuardBaseline, Wait
from torpor.tools import (
    DispatchRequest,
    ExternalState,
    LongRunningTool,
    MemberPlan,
    ToolContext,
    ToolSpec,
    WaitPlan,
)


@dataclass
class Record:
    dispatched: list[str] = field(default_factory=list)  # idempotency keys
    compensated: list[tuple[str, str, str]] = field(default_factory=list)  # (action, reason, key)


RECORD = Record()


def reset() -> Record:
    global RECORD
    RECORD = Record()
    return RECORD


class _Recording(LongRunningTool):
    answered_by = ("vendor",)
    can_compensate = True

    async def dispatch(self, request: DispatchRequest) -> None:
        RECORD.dispatched.append(request.idempotency_key)

    async def compensate(
        self, wait: Wait, *, tenant: str, reason: str, idempotency_key: str
    ) -> None:
        RECORD.compensated.append((wait.action_key, reason, idempotency_key))


class Quote(_Recording):
    """One vendor's quote; ``sla`` maps a vendor to its own SLA in seconds."""

    spec = ToolSpec(name="quote")

    def __init__(self, sla: dict[str, float] | None = None) -> None:
        self.sla = sla or {}

    async def begin(self, args: dict[str, Any], ctx: ToolContext) -> WaitPlan:
        vendor = str(args["vendor"])
        return WaitPlan(
            action_key=f"quote:{vendor}",
            request={"vendor": vendor},
            sla_s=self.sla.get(vendor, 3600.0),
        )


class Quotes(_Recording):
    """Every vendor of ``args["vendors"]`` at once, under ``args["fan_in"]``."""

    spec = ToolSpec(name="quotes")

    def __init__(
        self,
        sla: dict[str, float] | None = None,
        refuse: list[str] | None = None,
        drifted: list[str] | None = None,
        unreadable: list[str] | None = None,
    ) -> None:
        self.sla = sla or {}
        self.refuse = refuse or []  # vendors whose request is refused for good
        # Either given: every member is guarded (version v1, on_drift compensate). The
        # drifted vendors' quotes are found at v2 when their answer comes; the unreadable
        # vendors' state cannot be read at all.
        self.drifted = drifted or []
        self.unreadable = unreadable or []
        self.guarded = drifted is not None or unreadable is not None

    async def dispatch(self, request: DispatchRequest) -> None:
        if request.request["vendor"] in self.refuse:
            raise ToolError("the vendor portal refused the request", retryable=False)
        await super().dispatch(request)

    async def begin(self, args: dict[str, Any], ctx: ToolContext) -> WaitPlan:
        return WaitPlan(
            action_key="quotes:rfq-1",
            members=[
                MemberPlan(
                    label=vendor,
                    action_key=f"quote:{vendor}",
                    request={"vendor": vendor},
                    sla_s=self.sla.get(vendor),
                )
                for vendor in args["vendors"]
            ],
            fan_in=FanInSpec.model_validate(args.get("fan_in") or {}),
            guard=(GuardBaseline(version_tag="v1", captured_at=ctx.now) if self.guarded else None),
            on_drift=DriftPolicy.COMPENSATE,
        )

    async def current_state(self, wait: Wait, *, tenant: str) -> ExternalState | None:
        if wait.request["vendor"] in self.unreadable:
            raise ConnectionError("the vendor portal does not answer")
        drifted = wait.request["vendor"] in self.drifted
        return ExternalState(version_tag="v2" if drifted else "v1")
