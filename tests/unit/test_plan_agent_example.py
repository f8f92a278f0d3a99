"""deploy/torpor.plan-agent.example.toml is a complete, valid plan-agent deployment."""

from __future__ import annotations

from pathlib import Path

from torpor.agents.plan import Plan, PlanAgent
from torpor.demo.tools import PLAN, tools
from torpor.settings import Settings, load_toml

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "deploy" / "torpor.plan-agent.example.toml"


def test_the_example_loads_builds_its_plan_agent_and_names_only_its_tools() -> None:
    settings = Settings.build(load_toml(EXAMPLE))
    agent_config = settings.agents["procurement"]
    assert agent_config.factory == "torpor.agents.plan:PlanAgent"
    agent = PlanAgent(**agent_config.options)
    assert agent.name == "procurement"
    assert agent.plan == Plan.model_validate(PLAN), "the example is the demo's plan"
    options = agent_config.tool_options["torpor.demo.tools:tools"]
    names = {tool.spec.name for tool in tools(**options)}
    called = {call.tool for step in agent.plan.steps for call in step.calls}
    assert called <= names
    assert settings.sources["oa"].tenant in settings.tenants
