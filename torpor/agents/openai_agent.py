"""An agent backed by any OpenAI-compatible ``POST /chat/completions`` endpoint.

Works against OpenAI itself, vLLM and Ray Serve LLM: each step sends the whole history in
OpenAI chat format with the session's tools, and turns ``choices[0].message`` back into a
torpor ``Message``. The agent keeps no state between steps, so a session may sleep
between any two of them.

HTTP goes through ``torpor.outbound`` (stdlib, off the event loop, redirects refused,
the answer capped). Transport trouble (429, 5xx, refused connections,
timeouts) is retried with jittered backoff, never past the step's deadline
(``AgentContext.deadline``), and then surfaces as ``AgentUnavailable``;
anything a retry cannot fix (other 4xx, a malformed answer) is ``AgentError``.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from pydantic import JsonValue, SecretStr

from torpor import tracing
from torpor.agent import AgentContext, AgentTurn, default_initial_messages
from torpor.backoff import Backoff
from torpor.errors import AgentError, AgentUnavailable, ConfigError, ResponseTooLarge
from torpor.models import Message, ToolCall, ToolCallFunction
from torpor.outbound import request_async, retry_after_s

ENV_BASE_URL = "TORPOR_LLM_BASE_URL"
ENV_MODEL = "TORPOR_LLM_MODEL"
ENV_API_KEY = "TORPOR_LLM_API_KEY"

Sleep = Callable[[float], Awaitable[None]]
Monotonic = Callable[[], float]

_EXCERPT_CHARS = 300
_MAX_RESPONSE_BYTES = 16 * 1024 * 1024  # a chat completion is kilobytes; refuse to buffer more
_MAX_BACKOFF_S = 30.0
# A server may ask for a long pause; holding an activation that long is worse than giving
# up with a retryable error the runtime reschedules, so the honoured delay is capped.
_MAX_RETRY_AFTER_S = 60.0
# Extra headers whose values are credentials, by name.
_CREDENTIAL_HEADER = re.compile(r"auth|key|token|secret|passw|cookie|signature", re.IGNORECASE)


def _secrets_in_url(url: str) -> set[str]:
    """What of a base URL may be a key: its password and its query's values (a gateway
    that takes ``?api-key=``). The URL is named in every error of the endpoint."""
    parts = urllib.parse.urlsplit(url)
    found = {parts.password} if parts.password else set()
    found |= {v for _, v in urllib.parse.parse_qsl(parts.query) if len(v) >= 8}
    return found


def _header_safe(text: str, *, ascii_only: bool = False) -> bool:
    """Whether http.client sends ``text`` as a header name or value: no control character
    (a line break would end the header), latin-1 (ASCII for a name or a key) only."""
    top = 0x7E if ascii_only else 0xFF
    return all(c == "\t" or (0x20 <= ord(c) <= top and ord(c) != 0x7F) for c in text)


def _retryable(status: int) -> bool:
    # 408 is a timeout by another name; every other 4xx will fail the same way again.
    return status in (408, 429) or status >= 500


class OpenAIAgent:
    """An ``Agent`` that asks an OpenAI-compatible chat-completions endpoint each step."""

    def __init__(
        self,
        *,
        base_url: str,
        model: str,
        api_key: str | SecretStr | None = None,
        name: str = "openai",
        version: str = "1",
        system_prompt: str | None = None,
        temperature: float = 0.0,
        timeout_s: float = 60,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        extra_headers: Mapping[str, str] | None = None,
        max_tokens: int | None = None,
        sleep: Sleep | None = None,
        monotonic: Monotonic = time.monotonic,
    ) -> None:
        parsed = urllib.parse.urlsplit(base_url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ConfigError(f"base_url must be an http(s) URL, got {base_url!r}")
        if not model:
            raise ConfigError("model must not be empty")
        if timeout_s <= 0 or max_retries < 0 or backoff_s < 0:
            raise ConfigError("timeout_s must be > 0, max_retries and backoff_s >= 0")
        self.name = name
        self.version = version
        self.model = model
        self.base_url = base_url.rstrip("/")
        self._url = f"{self.base_url}/chat/completions"
        key = api_key.get_secret_value() if isinstance(api_key, SecretStr) else api_key
        # A key read from a file or a secret often ends in a line break. Sent so, http.client
        # refused every step with a ValueError quoting the whole header, key included, into
        # the failed session's detail; checked here, the error never shows it.
        key = key.strip() if key else key
        if key and not _header_safe(key, ascii_only=True):
            raise ConfigError("api_key holds a character an HTTP header cannot carry")
        for header, value in (extra_headers or {}).items():
            if not _header_safe(header, ascii_only=True) or not _header_safe(value):
                raise ConfigError(
                    f"extra header {header!r} holds a character an HTTP header cannot carry"
                )
        # Held as a SecretStr so vars(), debuggers and logged reprs of this object show stars.
        self._api_key = SecretStr(key) if key else None
        # Azure OpenAI and most gateways take their key in a header of their own (api-key,
        # x-api-key, ...): redacted from error text as the Bearer key is.
        secrets = sorted(
            {
                secret
                for header, value in (extra_headers or {}).items()
                if _CREDENTIAL_HEADER.search(header) and value.strip()
                # "Bearer <token>": an echo may carry the token alone.
                for secret in (value, value.split()[-1])
            }
            | ({key} if key else set())
            | _secrets_in_url(base_url),
            key=len,
            reverse=True,  # a longer secret first: it may contain a shorter one
        )
        self._secrets = tuple(SecretStr(secret) for secret in secrets)
        self._system_prompt = system_prompt
        self._temperature = temperature
        self._timeout_s = timeout_s
        self._max_retries = max_retries
        # Full jitter: many sessions failing together must not retry in lockstep.
        self._backoff = Backoff(base_s=backoff_s, cap_s=_MAX_BACKOFF_S)
        self._extra_headers = dict(extra_headers or {})
        self._max_tokens = max_tokens
        # Time is a parameter: tests pass a recorder instead of waiting out the backoff,
        # and a clock of their own to move the step's deadline closer.
        self._sleep = sleep
        self._monotonic = monotonic

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> OpenAIAgent:
        """Build from ``TORPOR_LLM_BASE_URL``, ``TORPOR_LLM_MODEL``, ``TORPOR_LLM_API_KEY``."""
        env = os.environ if environ is None else environ
        for var in (ENV_BASE_URL, ENV_MODEL):
            if not env.get(var):
                raise ConfigError(f"{var} is not set", variable=var)
        return cls(
            base_url=env[ENV_BASE_URL],
            model=env[ENV_MODEL],
            api_key=env.get(ENV_API_KEY) or None,
        )

    def __repr__(self) -> str:
        return (
            f"OpenAIAgent(name={self.name!r}, version={self.version!r}, "
            f"model={self.model!r}, base_url={self._redact(self.base_url)!r})"
        )

    def initial_messages(self, input: JsonValue, ctx: AgentContext) -> list[Message]:
        return default_initial_messages(input, self._system_prompt)

    async def step(self, messages: Sequence[Message], ctx: AgentContext) -> AgentTurn:
        payload: dict[str, Any] = {
            "model": self.model,
            "messages": [m.to_openai() for m in messages],
            "temperature": self._temperature,
        }
        # OpenAI rejects an empty tools array and a tool_choice without tools.
        if ctx.tools:
            payload["tools"] = [spec.to_openai() for spec in ctx.tools]
            payload["tool_choice"] = "auto"
        if self._max_tokens is not None:
            payload["max_tokens"] = self._max_tokens
        body = await self._complete(
            json.dumps(payload, ensure_ascii=False).encode(), deadline=ctx.deadline
        )
        message = _parse_message(body, self._redact)
        return AgentTurn(message, result=None if message.tool_calls else message.content)

    # --- transport ---------------------------------------------------------------------

    async def _complete(self, body: bytes, *, deadline: float | None) -> bytes:
        """POST ``body`` until an answer, retrying what a retry can fix, all before
        ``deadline`` (``monotonic`` seconds; None: the attempts alone bound it)."""
        attempts = self._max_retries + 1
        made = 0
        last_error = "no time left before the step's deadline"
        last_exc: BaseException | None = None
        for attempt in range(attempts):
            timeout_s = self._timeout_s
            if deadline is not None:
                # The runtime stops waiting at the step's deadline: an attempt allowed
                # longer would go on in its thread for nobody, and its error would be
                # lost to the runtime's timeout.
                timeout_s = min(timeout_s, deadline - self._monotonic())
                if timeout_s <= 0:
                    break
            made += 1
            hint: float | None = None
            try:
                # A cancelled step leaves this thread running until timeout_s; harmless,
                # since the request has no side effects the runtime relies on.
                status, data, retry_after = await self._post(body, timeout_s=timeout_s)
            except (OSError, http.client.HTTPException) as exc:  # refused, reset, timeout
                last_exc, last_error = exc, f"{type(exc).__name__}: {exc}"
            else:
                if 200 <= status < 300:
                    return data
                detail = f"HTTP {status}: {self._excerpt(data)}"
                if not _retryable(status):
                    raise AgentError(
                        self._redact(f"LLM endpoint {self._url} answered {detail}"),
                        status=status,
                    )
                last_exc, last_error = None, detail
                if status in (429, 503):
                    hint = retry_after_s(
                        retry_after, now=datetime.now(UTC), cap_s=_MAX_RETRY_AFTER_S
                    )
            if attempt + 1 < attempts:
                delay = hint if hint is not None else self._backoff.delay_s(attempt)
                if deadline is not None and self._monotonic() + delay >= deadline:
                    # The next attempt would start past the deadline: give up now with
                    # the retryable error, and the runtime reschedules the step.
                    break
                await (self._sleep or asyncio.sleep)(delay)
        cut = " before the step's deadline" if made < attempts else ""
        raise AgentUnavailable(
            self._redact(
                f"LLM endpoint {self._url} failed {made} attempts{cut}; last: {last_error}"
            ),
            attempts=made,
        ) from last_exc

    async def _post(self, body: bytes, *, timeout_s: float) -> tuple[int, bytes, str | None]:
        """One POST: status, body, Retry-After. A chat endpoint has no business
        redirecting a POST (urllib would carry the Authorization header along to another
        host): the helper answers a 3xx as it is, an HTTP error here."""
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        headers.update(self._extra_headers)
        if self._api_key is not None:
            headers["Authorization"] = f"Bearer {self._api_key.get_secret_value()}"
        try:
            with tracing.span(
                "torpor.llm.call",
                # The host alone (as the semantic conventions name it): the URL may hold a
                # key in its user part or query, and spans go to a collector as they are.
                **{
                    "gen_ai.request.model": self.model,
                    "server.address": urllib.parse.urlsplit(self._url).hostname or "",
                },
            ) as span:
                tracing.inject(headers)  # the endpoint may continue the trace
                response = await request_async(
                    "POST",
                    self._url,
                    body=body,
                    headers=headers,
                    timeout_s=timeout_s,
                    max_body_bytes=_MAX_RESPONSE_BYTES,
                )
                span.set_attribute("http.response.status_code", response.status)
        except ResponseTooLarge:
            raise AgentError(f"LLM response exceeds {_MAX_RESPONSE_BYTES} bytes") from None
        retry_after = None if response.ok else response.header("Retry-After")
        return response.status, response.body, retry_after

    def _excerpt(self, data: bytes) -> str:
        # Redact before truncating: a cut could leave a key prefix the redaction misses.
        text = self._redact(data.decode("utf-8", errors="replace"))
        return text if len(text) <= _EXCERPT_CHARS else text[:_EXCERPT_CHARS] + "…"

    def _redact(self, text: str) -> str:
        # Some gateways echo request headers in error bodies; the key must never travel on.
        for secret in self._secrets:
            text = text.replace(secret.get_secret_value(), "***")
        return text


# --- response parsing (a trust boundary: every malformed answer becomes AgentError) --------


def _parse_message(body: bytes, redact: Callable[[str], str]) -> Message:
    def fail(why: str) -> AgentError:
        excerpt = redact(body.decode("utf-8", errors="replace"))[:_EXCERPT_CHARS]
        return AgentError(f"malformed chat completion: {why}; body: {excerpt}")

    try:
        document = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: absurdly deep nesting
        raise fail("not JSON") from None
    choices = document.get("choices") if isinstance(document, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise fail("no choices")
    choice = choices[0]
    raw = choice.get("message")
    if not isinstance(raw, dict):
        raise fail("choices[0].message missing")
    content = raw.get("content")
    if content is not None and not isinstance(content, str):
        raise fail("content is not a string")
    raw_calls = raw.get("tool_calls")
    if raw_calls is not None and not isinstance(raw_calls, list):
        raise fail("tool_calls is not a list")
    calls = [_parse_tool_call(item, fail) for item in raw_calls or []]
    if len({c.id for c in calls}) != len(calls):
        raise fail("duplicate tool call ids")
    # A cut-off answer would otherwise pass as a final result (or half a JSON argument).
    if choice.get("finish_reason") == "length":
        raise fail("finish_reason is 'length' (raise max_tokens)")
    # A filtered or refused answer is no result: it completed the session with None.
    if choice.get("finish_reason") == "content_filter":
        raise fail("finish_reason is 'content_filter' (the provider withheld the answer)")
    refusal = raw.get("refusal")
    if isinstance(refusal, str) and refusal and not content and not calls:
        raise fail(f"the model refused: {refusal[:200]}")
    # Neither an answer nor a call (a message of nulls, a reasoning model's budget spent
    # on reasoning): it completed the session with the result None, as if that were one.
    if content is None and not calls:
        raise fail("no content and no tool calls")
    # An escaped lone surrogate ("\\ud83d", half an emoji) is valid JSON but no Unicode
    # text: the snapshot holding the turn could not be encoded, the commit raised, and
    # every replay met it again, the session RUNNING for good.
    kept = [content, *(t for c in calls for t in (c.id, c.function.name, c.function.arguments))]
    if any(_has_surrogate(text) for text in kept if text is not None):
        raise fail("the answer holds a lone UTF-16 surrogate")
    # vLLM sends tool_calls: [] on plain answers; OpenAI rejects [] when it is sent back.
    return Message(role="assistant", content=content, tool_calls=calls or None)


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _parse_tool_call(item: object, fail: Callable[[str], AgentError]) -> ToolCall:
    if not isinstance(item, dict):
        raise fail("tool call is not an object")
    call_id, function = item.get("id"), item.get("function")
    if not isinstance(call_id, str) or not call_id:
        raise fail("tool call without id")
    if item.get("type", "function") != "function" or not isinstance(function, dict):
        raise fail(f"tool call {call_id} is not a function call")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise fail(f"tool call {call_id} without function name")
    # Missing arguments mean "no arguments"; a string that is not JSON passes through so
    # the runtime can answer it with a tool error the model can correct.
    arguments = function.get("arguments", "{}")
    if not isinstance(arguments, str):
        raise fail(f"tool call {call_id} arguments is not a string")
    return ToolCall(id=call_id, function=ToolCallFunction(name=name, arguments=arguments))
