"""The agent protocol: a step function over the message history.

An agent looks at the conversation so far (OpenAI chat format) and answers with one
assistant message. If that message carries ``tool_calls`` the runtime executes them and
calls the agent again; if it does not, the session is finished and ``result`` (or the
message content) is its result. Agents keep no state between steps except what they put
in ``ctx.variables``, which is saved in the snapshot: that is what lets a session leave
memory between any two steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from pydantic import JsonValue

from torpor.models import Message
from torpor.tools import ToolSpec


@dataclass
class AgentContext:
    session_id: str
    tenant: str
    step: int
    input: JsonValue
    metadata: dict[str, str]
    tools: list[ToolSpec]
    # Mutable on purpose: whatever the agent stores here is checkpointed with the session.
    variables: dict[str, JsonValue] = field(default_factory=dict)
    # When the runtime abandons this step (``time.monotonic()`` seconds; None: never). An
    # agent that calls out and retries must end by then: past it, its answer is not
    # waited for, and an attempt still running is a thread and a request wasted.
    deadline: float | None = None


@dataclass(frozen=True)
class AgentTurn:
    message: Message  # an assistant message
    result: JsonValue = None  # the session's result when ``message`` has no tool calls

    @property
    def final(self) -> bool:
        return not self.message.tool_calls


@runtime_checkable
class Agent(Protocol):
    """An agent may also set ``reads_tool_results_as_json = True`` (the plan agent): its
    tool messages then carry a str result that JSON reads as another value quoted, so it
    parses back to the str (``torpor.session.working.message_content``)."""

    name: str
    version: str

    async def step(self, messages: Sequence[Message], ctx: AgentContext) -> AgentTurn: ...

    def initial_messages(self, input: JsonValue, ctx: AgentContext) -> list[Message]:
        """The conversation a new session starts with."""
        ...


def default_initial_messages(input: JsonValue, system_prompt: str | None) -> list[Message]:
    import json

    content = input if isinstance(input, str) else json.dumps(input, ensure_ascii=False)
    messages = [Message(role="system", content=system_prompt)] if system_prompt else []
    messages.append(Message(role="user", content=content))
    return messages
