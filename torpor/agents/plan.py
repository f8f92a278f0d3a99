"""A deterministic, plan-driven agent: a declared sequence of tool calls with branches.

It is what the demo and the tests run, and what a team uses when the workflow is known
and no model is needed. The plan is data (from configuration)::

    steps:
      - id: extract
        calls: [{tool: extract_fields, args: {doc: "${input.doc}"}}]
      - id: approve
        calls: [{tool: request_approval, args: {amount: "${results.extract.amount}"}}]
        branches: [{when: {path: results.approve.status, value: drift}, goto: approve}]
      - id: done
        finish: {status: "${results.approve.status}"}

A call whose result is a tool error (``{"error": ...}``) goes where a branch that matches
it says, else to the step's ``on_error``; with neither, the session fails with the cause.
``${path}`` alone in a string is replaced by the value (any JSON type); inside a longer
string it is interpolated as text. Paths start at ``input``, ``results`` or ``vars``. In a
call's arguments one that names nothing fails the session (``PlanPathMissing``) rather
than go out as a null argument (a tool acting on ``doc_id: null``); a path that may name
nothing says so, ``${input.note?}``: null alone, no text inside a longer string. In a
``finish`` (the session's result: data, not an action) every path may name nothing, as
if marked. ``exists``/``missing`` branch on either.
Tool-call ids are derived from the step and its visit count, so a replay after a crash
produces the very same calls.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationError, model_validator

from torpor.agent import AgentContext, AgentTurn, default_initial_messages
from torpor.errors import AgentError, ConfigError, PlanPathMissing, UnhandledToolError
from torpor.models import Message, ToolCall, ToolCallFunction

# ``${path}``, or ``${path?}``: a path that may name nothing.
_WHOLE = re.compile(r"^\$\{([A-Za-z0-9_.\-]+)(\??)\}$")
_PART = re.compile(r"\$\{([A-Za-z0-9_.\-]+)(\??)\}")
_MISSING = object()


class _Plan(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class Condition(_Plan):
    path: str
    op: Literal["eq", "ne", "in", "not_in", "gt", "ge", "lt", "le", "exists", "missing"] = "eq"
    value: JsonValue = None


class Branch(_Plan):
    when: list[Condition]
    goto: str

    @model_validator(mode="before")
    @classmethod
    def _one_or_many(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("when"), dict):
            return {**data, "when": [data["when"]]}
        return data


class PlanCall(_Plan):
    tool: str
    args: dict[str, JsonValue] = Field(default_factory=dict)
    name: str | None = Field(default=None, alias="as")  # where the result is stored


class PlanStep(_Plan):
    id: str
    calls: list[PlanCall] = Field(default_factory=list)  # none: a finish step
    branches: list[Branch] = Field(default_factory=list)
    next: str | None = None  # default: the step that follows in the list
    finish: JsonValue = None
    # Where a failed call goes when no branch matched; none: the session fails with it.
    on_error: str | None = None
    max_visits: int = 5  # a loop (e.g. re-plan after drift) cannot spin forever


class Plan(_Plan):
    steps: list[PlanStep]

    @model_validator(mode="after")
    def _targets_exist(self) -> Plan:
        ids = [s.id for s in self.steps]
        if not ids or len(set(ids)) != len(ids):
            raise ValueError("a plan needs at least one step and unique step ids")
        for step in self.steps:
            for target in [step.next, step.on_error, *(b.goto for b in step.branches)]:
                if target is not None and target not in ids:
                    raise ValueError(f"step {step.id!r} points to unknown step {target!r}")
        return self


def lookup(scope: dict[str, Any], path: str) -> Any:
    node: Any = scope
    for part in path.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return _MISSING
    return node


def render(template: Any, scope: dict[str, Any], *, where: str, strict: bool = True) -> Any:
    """``template`` with each ``${path}`` replaced from ``scope``; ``where`` names the
    template's place in the plan for the error a path that names nothing raises (only
    when ``strict``, and not marked ``?``)."""
    if isinstance(template, str):
        whole = _WHOLE.match(template)
        if whole:
            optional = bool(whole.group(2)) or not strict
            return _resolve(scope, whole.group(1), optional, where)

        def text(match: re.Match[str]) -> str:
            optional = bool(match.group(2)) or not strict
            value = _resolve(scope, match.group(1), optional, where)
            if value is None:
                return ""
            return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)

        return _PART.sub(text, template)
    if isinstance(template, dict):
        return {k: render(v, scope, where=where, strict=strict) for k, v in template.items()}
    if isinstance(template, list):
        return [render(v, scope, where=where, strict=strict) for v in template]
    return template


def _resolve(scope: dict[str, Any], path: str, optional: bool, where: str) -> Any:
    # A missing value rendered as null went on as the argument (a call with
    # ``doc_id: null``, a finish with a null field) and failed, if at all, far from here;
    # only a path marked optional may name nothing.
    value = lookup(scope, path)
    if value is not _MISSING:
        return value
    if optional:
        return None
    parts = path.split(".")
    # The longest part of the path that is there, to say which step of it found nothing.
    known = next(
        (
            n
            for n in range(len(parts) - 1, 0, -1)
            if lookup(scope, ".".join(parts[:n])) is not _MISSING
        ),
        0,
    )
    why = (
        f"{'.'.join(parts[:known])} has no {parts[known]!r}"
        if known
        else f"paths start at input, results or vars, not {parts[0]!r}"
    )
    raise PlanPathMissing(f"{where}: ${{{path}}} names nothing ({why})"[:500], path=path[:200])


def holds(cond: Condition, scope: dict[str, Any]) -> bool:
    value = lookup(scope, cond.path)
    if cond.op == "exists":
        return value is not _MISSING and value is not None
    if cond.op == "missing":
        return value is _MISSING or value is None
    if value is _MISSING:
        return False
    try:
        match cond.op:
            case "eq":
                return bool(value == cond.value)
            case "ne":
                return bool(value != cond.value)
            case "in":
                return isinstance(cond.value, list) and value in cond.value
            case "not_in":
                return isinstance(cond.value, list) and value not in cond.value
            case "gt":
                return bool(value > cond.value)
            case "ge":
                return bool(value >= cond.value)
            case "lt":
                return bool(value < cond.value)
            case _:
                return bool(value <= cond.value)
    except TypeError:  # comparing a number with a string: the branch simply does not hold
        return False


def _is_error(result: Any) -> bool:
    """A tool's failure as the runtime reports it: ``{"error": {...}}``."""
    return isinstance(result, dict) and result.get("error") is not None


def _parse_content(content: str | None) -> JsonValue:
    if content is None:
        return None
    try:
        parsed: JsonValue = json.loads(content)
    except ValueError:
        return content
    except RecursionError:
        # Valid JSON nested past Python's parser: the tool's own str, as sent before str
        # results that read as JSON were encoded (old snapshots hold such messages still);
        # raised, it failed the step at every replay.
        return content
    return parsed


class PlanAgent:
    # Reads each tool message back as JSON (``_parse_content``): a str result that JSON
    # reads as something else is sent quoted, so it comes back the str it was.
    reads_tool_results_as_json: ClassVar[bool] = True

    def __init__(
        self,
        *,
        plan: dict[str, Any] | Plan,
        name: str = "plan",
        version: str = "1",
        system_prompt: str | None = None,
    ) -> None:
        try:
            self.plan = plan if isinstance(plan, Plan) else Plan.model_validate(plan)
        except ValidationError as exc:
            raise ConfigError(
                f"plan of agent {name!r} is invalid: {exc.errors()[0]['msg']}"
            ) from exc
        self.name = name
        self.version = version
        self._system_prompt = system_prompt
        self._steps = {s.id: s for s in self.plan.steps}
        self._order = [s.id for s in self.plan.steps]

    def initial_messages(self, input: JsonValue, ctx: AgentContext) -> list[Message]:
        return default_initial_messages(input, self._system_prompt)

    async def step(self, messages: Sequence[Message], ctx: AgentContext) -> AgentTurn:
        state = ctx.variables.get("plan")
        if not isinstance(state, dict):
            state = {"cursor": None, "visits": {}, "results": {}}
        results: dict[str, Any] = dict(state.get("results") or {})  # type: ignore[arg-type]
        visits: dict[str, Any] = dict(state.get("visits") or {})  # type: ignore[arg-type]
        cursor = state.get("cursor")
        scope = {"input": ctx.input, "results": results, "vars": ctx.variables}
        if cursor is None:
            target: str | None = self._order[0]
        else:
            current = self._steps.get(str(cursor))
            if current is None:
                # The plan changed under a session that stood at a step it no longer has:
                # said so, where a bare KeyError failed the session as the agent's crash.
                raise AgentError(
                    f"the plan has no step {str(cursor)[:100]!r}, where this session stood:"
                    " a plan a running session follows needs a new version, not an edit"
                )
            answers = self._answers(messages)
            answered: list[tuple[str, Any]] = []
            for i, call in enumerate(current.calls):
                call_id = self._call_id(current.id, int(visits.get(current.id, 1)), i)
                answered.append((call.name or current.id, answers.get(call_id)))
                results[call.name or current.id] = answers.get(call_id)
            target = self._next(current, scope, answered)
        turn = self._enter(target, visits, scope)
        ctx.variables["plan"] = {"cursor": target, "visits": visits, "results": results}
        return turn

    # -- helpers ---------------------------------------------------------------------

    @staticmethod
    def _call_id(step_id: str, visit: int, index: int) -> str:
        return f"call_{step_id}_{visit}_{index}"

    @staticmethod
    def _answers(messages: Sequence[Message]) -> dict[str, JsonValue]:
        return {
            m.tool_call_id: _parse_content(m.content)
            for m in messages
            if m.role == "tool" and m.tool_call_id
        }

    def _next(
        self, step: PlanStep, scope: dict[str, Any], answered: list[tuple[str, Any]]
    ) -> str | None:
        for branch in step.branches:
            if all(holds(c, scope) for c in branch.when):
                return branch.goto
        # A failed call that no branch took must not flow on: the next step would run on
        # the missing values (an approval asked for ``doc_id: null``). Each call's own
        # answer, not ``results``: calls of one step without ``as`` share a name there,
        # and a later one's success hid an earlier one's failure.
        failed = [(name, result) for name, result in answered if _is_error(result)]
        if failed:
            if step.on_error is not None:
                return step.on_error
            name, result = failed[0]
            raise UnhandledToolError(
                f"plan step {step.id!r}: call {name!r} failed and no branch handles it: "
                f"{json.dumps(result['error'], ensure_ascii=False, default=str)[:500]}",
                step=step.id,
                call=name,
            )
        if step.next is not None:
            return step.next
        position = self._order.index(step.id) + 1
        return self._order[position] if position < len(self._order) else None

    def _enter(
        self, target: str | None, visits: dict[str, Any], scope: dict[str, Any]
    ) -> AgentTurn:
        step = self._steps[target] if target is not None else None
        if step is None or not step.calls:
            result = (
                # Lenient: the result is data, and a plan's error path (a finish naming
                # what a failed step did not give) must still end the session with it.
                render(step.finish, scope, where=f"plan step {step.id!r}, finish", strict=False)
                if step and step.finish is not None
                else None
            )
            if result is None:
                result = scope["results"]
            text = json.dumps(result, ensure_ascii=False, sort_keys=True)
            return AgentTurn(Message(role="assistant", content=text), result=result)
        visit = int(visits.get(step.id, 0)) + 1
        if visit > step.max_visits:
            raise AgentError(f"plan step {step.id!r} visited more than {step.max_visits} times")
        visits[step.id] = visit
        calls = [
            ToolCall(
                id=self._call_id(step.id, visit, i),
                function=ToolCallFunction(
                    name=call.tool,
                    arguments=json.dumps(
                        render(
                            call.args, scope, where=f"plan step {step.id!r}, call {call.tool!r}"
                        ),
                        ensure_ascii=False,
                    ),
                ),
            )
            for i, call in enumerate(step.calls)
        ]
        return AgentTurn(Message(role="assistant", content=None, tool_calls=calls))
