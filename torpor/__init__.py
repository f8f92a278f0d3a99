"""torpor: agent sessions that sleep in object storage and wake once on a signed webhook.

The names in ``__all__`` are the public API: the client, what an agent and its tools are
made of, the settings and the errors worth catching. Everything else is internal. They are
imported on first use, so ``import torpor.settings`` (or any other module) does not pull
in the client, and nothing here starts Ray.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    # using torpor
    "Client": "torpor.client",
    "AsyncClient": "torpor.client",
    "SessionView": "torpor.client",
    "SessionState": "torpor.lifecycle",
    "Settings": "torpor.settings",
    # writing an agent
    "Agent": "torpor.agent",
    "AgentContext": "torpor.agent",
    "AgentTurn": "torpor.agent",
    # writing its tools
    "LongRunningTool": "torpor.tools",
    "Tool": "torpor.tools",
    "sync_tool": "torpor.tools",
    "ToolSpec": "torpor.tools",
    "WaitPlan": "torpor.tools",
    "ExternalState": "torpor.tools",
    "GuardBaseline": "torpor.models",
    # human approvals
    "ApprovalTool": "torpor.approval",
    "AuthorityPolicy": "torpor.approval",
    # errors
    "TorporError": "torpor.errors",
    "RetryableError": "torpor.errors",
    "PermanentError": "torpor.errors",
    "ConfigError": "torpor.errors",
    "ToolError": "torpor.errors",
    "AgentError": "torpor.errors",
    "InvalidRequest": "torpor.errors",
    "SessionNotFound": "torpor.errors",
}

__all__ = [
    "Agent",
    "AgentContext",
    "AgentError",
    "AgentTurn",
    "ApprovalTool",
    "AsyncClient",
    "AuthorityPolicy",
    "Client",
    "ConfigError",
    "ExternalState",
    "GuardBaseline",
    "InvalidRequest",
    "LongRunningTool",
    "PermanentError",
    "RetryableError",
    "SessionNotFound",
    "SessionState",
    "SessionView",
    "Settings",
    "Tool",
    "ToolError",
    "ToolSpec",
    "TorporError",
    "WaitPlan",
    "__version__",
    "sync_tool",
]

if TYPE_CHECKING:  # for type checkers and IDEs; at run time __getattr__ imports on demand
    from torpor.agent import Agent, AgentContext, AgentTurn
    from torpor.approval import ApprovalTool, AuthorityPolicy
    from torpor.client import AsyncClient, Client, SessionView
    from torpor.errors import (
        AgentError,
        ConfigError,
        InvalidRequest,
        PermanentError,
        RetryableError,
        SessionNotFound,
        ToolError,
        TorporError,
    )
    from torpor.lifecycle import SessionState
    from torpor.models import GuardBaseline
    from torpor.settings import Settings
    from torpor.tools import (
        ExternalState,
        LongRunningTool,
        Tool,
        ToolSpec,
        WaitPlan,
        sync_tool,
    )


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'torpor' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once imported, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
