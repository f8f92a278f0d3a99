"""Agents and tools found by import path from configuration.

``factory = "package.module:name"`` may name an object with a ``step`` method (used as
is), a class or function (called with the configured options). A tool path may name a
tool, a class or function returning a tool, or a list of tools. Versions are recorded in
each snapshot, so an operator can tell which code a session slept under.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from torpor.agent import Agent
from torpor.errors import ConfigError, PluginNotFound
from torpor.settings import AgentConfig, Settings, resolve_secret
from torpor.tools import AnyTool, LongRunningTool, Tool, ToolRegistry


def load_object(path: str) -> Any:
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise PluginNotFound(f"import path {path!r} must look like 'package.module:name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise PluginNotFound(f"cannot import {module_name!r} for {path!r}: {exc}") from exc
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise PluginNotFound(f"{module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def resolve_env(value: Any) -> Any:
    """Options may name secrets as ``"env:NAME"``; read them when the plugin is built."""
    if isinstance(value, str):
        return resolve_secret(value)
    if isinstance(value, dict):
        return {k: resolve_env(v) for k, v in value.items()}
    if isinstance(value, list):
        return [resolve_env(v) for v in value]
    return value


def _build(obj: Any, options: dict[str, Any], what: str) -> Any:
    if isinstance(obj, type) or (callable(obj) and not hasattr(obj, "step")):
        try:
            return obj(**resolve_env(options))
        except TypeError as exc:
            raise ConfigError(f"{what}: options do not fit its constructor: {exc}") from exc
    return obj


def _tools(path: str, options: dict[str, Any]) -> list[AnyTool]:
    obj = load_object(path)
    if not isinstance(obj, (Tool, LongRunningTool, list)):
        obj = _build(obj, options, f"tool {path}")
    tools = obj if isinstance(obj, list) else [obj]
    for tool in tools:
        if not isinstance(tool, (Tool, LongRunningTool)):
            raise ConfigError(f"tool path {path!r} gave {type(tool).__name__}, not a tool")
    return tools


@dataclass(frozen=True)
class LoadedAgent:
    name: str
    agent: Agent
    tools: ToolRegistry
    config: AgentConfig


class PluginResolver:
    """Loads each configured agent once per process."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._cache: dict[str, LoadedAgent] = {}

    def agent(self, name: str) -> LoadedAgent:
        if name in self._cache:
            return self._cache[name]
        config = self._settings.agents.get(name)
        if config is None:
            known = ", ".join(sorted(self._settings.agents)) or "none"
            raise PluginNotFound(f"no agent named {name!r} is configured (known: {known})")
        agent = _build(load_object(config.factory), dict(config.options), f"agent {name}")
        if not isinstance(agent, Agent):
            raise ConfigError(f"agent {name!r}: {config.factory} did not give an Agent")
        registry = ToolRegistry()
        for path in config.tools:
            for tool in _tools(path, dict(config.tool_options.get(path, {}))):
                # A tool that needs the deployment (a work tool: its storage and Ray
                # namespace) says so with ``configure``; it is given the settings once.
                configure = getattr(tool, "configure", None)
                if callable(configure):
                    configure(self._settings)
                registry.register(tool)
        loaded = LoadedAgent(name, agent, registry, config)
        self._cache[name] = loaded
        return loaded

    async def close(self) -> None:
        for loaded in self._cache.values():
            for tool in loaded.tools.all():
                await tool.close()
            closer = getattr(loaded.agent, "close", None)
            if closer is not None:
                await closer()
        self._cache.clear()
