"""The agents configuration names (``torpor.settings``): where each is imported from,
its tools, its placement and its limits."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import Field

from torpor.models import FanInSpec
from torpor.settings_sections import _Section


class Placement(StrEnum):
    DEDICATED = "dedicated"  # one named actor per live session, exits when the session sleeps
    POOLED = "pooled"  # a few long-lived hosts run activations routed by session id


class AgentConfig(_Section):
    """An agent as configuration names it: where to import it and its tools from."""

    factory: str = Field(description='`"package.module:callable"` returning the Agent')
    options: dict[str, Any] = Field(
        default_factory=dict, description='keyword arguments for the factory (`"env:NAME"` ok)'
    )
    tools: list[str] = Field(
        default_factory=list, description='`"package.module:callable"` returning tool(s)'
    )
    tool_options: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="keyword arguments per entry of `tools`"
    )
    placement: Placement = Field(
        Placement.DEDICATED, description="`dedicated` (one actor per session) or `pooled`"
    )
    max_tool_retries: int = Field(3, ge=0, description="attempts of a failing sync tool call")
    max_steps: int = Field(
        1000,
        ge=1,
        description="agent steps one session may take in all; past them it fails "
        "(`step_limit`): a model that never stops calling tools does not run for ever",
    )
    answer_sources: dict[str, list[str]] = Field(
        default_factory=dict,
        description="webhook sources that may answer each long-running tool's waits, by tool",
    )
    fan_in: FanInSpec = Field(
        default_factory=FanInSpec,
        description="several long-running calls in one turn: one fan-in group with this "
        "condition (`all`, `any`, `n_of_m` with `n`) and expiry policy",
    )
