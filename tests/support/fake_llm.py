"""A real local HTTP server speaking the OpenAI chat-completions protocol, for tests.

It checks request shapes the way OpenAI does (and answers 400 with an OpenAI error body
when they are wrong), records every request, and answers through a pluggable responder.
The default responder scripts a one-tool conversation:

* last message from the user  → call the first tool offered with ``{"doc": <content>}``
* last message a tool result  → final answer ``"done: <tool content>"``

    with FakeLLM() as llm:
        agent = OpenAIAgent(base_url=llm.base_url, model="fake-model")
"""

from __future__ import annotations

import itertools
import json
import re
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

CHAT_PATH = "/v1/chat/completions"
ROLES = {"system", "developer", "user", "assistant", "tool"}
MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id", "refusal"}
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass
class FakeReply:
    """An explicit answer: any status, extra headers, a JSON or raw body, a delay first."""

    status: int = 200
    body: Mapping[str, Any] | str | bytes | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    delay_s: float = 0.0


@dataclass(frozen=True)
class RecordedRequest:
    method: str
    path: str
    headers: dict[str, str]
    raw: bytes
    body: Any  # the parsed JSON, or None when the body was not JSON


Responder = Callable[[dict[str, Any]], "dict[str, Any] | FakeReply"]

_ids = itertools.count(1)


def openai_error(
    message: str, *, error_type: str = "invalid_request_error", **extra: Any
) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": None, "code": None, **extra}}


def chat_completion(
    request: Mapping[str, Any], message: dict[str, Any], finish_reason: str
) -> dict[str, Any]:
    """A response in the exact shape OpenAI sends."""
    return {
        "id": f"chatcmpl-fake{next(_ids)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": request.get("model", "fake-model"),
        "choices": [
            {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}
        ],
        "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
    }


def text_completion(request: Mapping[str, Any], content: str) -> dict[str, Any]:
    message = {"role": "assistant", "content": content, "refusal": None}
    return chat_completion(request, message, "stop")


def tool_call_completion(
    request: Mapping[str, Any], name: str, arguments: str, call_id: str | None = None
) -> dict[str, Any]:
    call = {
        "id": call_id or f"call_fake{next(_ids)}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }
    message = {"role": "assistant", "content": None, "tool_calls": [call], "refusal": None}
    return chat_completion(request, message, "tool_calls")


def scripted_responder(request: dict[str, Any]) -> dict[str, Any]:
    last = request["messages"][-1]
    tools = request.get("tools") or []
    if last["role"] == "user" and tools:
        name = tools[0]["function"]["name"]
        return tool_call_completion(request, name, json.dumps({"doc": last.get("content")}))
    if last["role"] == "tool":
        return text_completion(request, f"done: {last.get('content')}")
    return text_completion(request, f"echo: {last.get('content')}")


def validate_request(body: Any) -> str | None:
    """Why OpenAI would reject this body, or None if it would accept it."""
    if not isinstance(body, dict):
        return "request body must be a JSON object"
    if not isinstance(body.get("model"), str) or not body["model"]:
        return "you must provide a model parameter"
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return "'messages' must be a non-empty array"
    problem = _validate_messages(messages)
    if problem:
        return problem
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not tools:
            return "'tools' must be a non-empty array"
        for i, tool in enumerate(tools):
            problem = _validate_tool(tool)
            if problem:
                return f"tools[{i}]: {problem}"
    if "tool_choice" in body and tools is None:
        return "'tool_choice' is only allowed when 'tools' are specified"
    temperature = body.get("temperature", 1)
    if not isinstance(temperature, int | float) or not 0 <= temperature <= 2:
        return "'temperature' must be a number between 0 and 2"
    max_tokens = body.get("max_tokens", 1)
    if not isinstance(max_tokens, int) or max_tokens < 1:
        return "'max_tokens' must be a positive integer"
    return None


def _validate_messages(messages: list[Any]) -> str | None:
    unanswered: set[str] = set()  # tool call ids of the latest assistant turn
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or msg.get("role") not in ROLES:
            return f"messages[{i}]: invalid role"
        if set(msg) - MESSAGE_KEYS:
            return f"messages[{i}]: unrecognized keys {sorted(set(msg) - MESSAGE_KEYS)}"
        role, content = msg["role"], msg.get("content")
        if role != "tool" and unanswered:
            return f"messages[{i}]: tool_call_ids {sorted(unanswered)} were not answered"
        if role == "tool":
            if msg.get("tool_call_id") not in unanswered:
                return (
                    f"messages[{i}]: messages with role 'tool' must be a response to a "
                    "preceding message with 'tool_calls'"
                )
            unanswered.discard(msg["tool_call_id"])
        if role == "assistant" and "tool_calls" in msg:
            calls = msg["tool_calls"]
            if not isinstance(calls, list) or not calls:
                return f"messages[{i}]: 'tool_calls' must be a non-empty array"
            for call in calls:
                fn = call.get("function") if isinstance(call, dict) else None
                if (
                    not isinstance(call.get("id"), str)
                    or call.get("type") != "function"
                    or not isinstance(fn, dict)
                    or not isinstance(fn.get("name"), str)
                    or not isinstance(fn.get("arguments"), str)
                ):
                    return f"messages[{i}]: malformed tool call {call!r}"
                unanswered.add(call["id"])
        elif content is None:
            return f"messages[{i}]: 'content' is required for role {role!r}"
        if content is not None and not isinstance(content, str | list):
            return f"messages[{i}]: 'content' must be a string or an array"
    if unanswered:
        return f"tool_call_ids {sorted(unanswered)} were not answered by tool messages"
    return None


def _validate_tool(tool: Any) -> str | None:
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(fn, dict) or tool.get("type") != "function":
        return "must be {'type': 'function', 'function': {...}}"
    if not isinstance(fn.get("name"), str) or not TOOL_NAME.match(fn["name"]):
        return "function.name must match ^[a-zA-Z0-9_-]{1,64}$"
    if not isinstance(fn.get("description", ""), str):
        return "function.description must be a string"
    params = fn.get("parameters", {"type": "object"})
    if not isinstance(params, dict) or params.get("type") != "object":
        return "function.parameters must be a JSON schema of type 'object'"
    return None


class FakeLLM:
    """The server. ``start()``/``stop()`` or use it as a context manager."""

    def __init__(
        self,
        responder: Responder = scripted_responder,
        *,
        api_key: str | None = None,
    ) -> None:
        self.responder = responder
        self.api_key = api_key
        self.requests: list[RecordedRequest] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        assert self._server is not None, "server not started"
        return self._server.server_address[1]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> FakeLLM:
        self._server = _QuietServer(("127.0.0.1", 0), _handler_for(self))
        # A short poll interval: shutdown() waits for the loop to notice, 0.5 s by default.
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()  # wakes handlers sleeping out a FakeReply delay
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> FakeLLM:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def chat_requests(self) -> list[dict[str, Any]]:
        """The parsed bodies of the chat-completion requests, in order."""
        with self._lock:
            return [r.body for r in self.requests if r.path == CHAT_PATH]

    def _record(self, request: RecordedRequest) -> None:
        with self._lock:
            self.requests.append(request)

    def _answer(self, request: RecordedRequest) -> FakeReply:
        if request.method != "POST" or request.path != CHAT_PATH:
            return FakeReply(
                404, openai_error(f"Unknown request URL: {request.method} {request.path}")
            )
        if self.api_key is not None:
            presented = request.headers.get("authorization", "")
            if presented != f"Bearer {self.api_key}":
                # Echoes what was presented (real OpenAI echoes a masked form) so tests can
                # prove the client redacts keys that come back in error bodies.
                return FakeReply(
                    401,
                    openai_error(
                        f"Incorrect API key provided: {presented}", code="invalid_api_key"
                    ),
                )
        if request.body is None:
            return FakeReply(400, openai_error("We could not parse the JSON body of your request."))
        problem = validate_request(request.body)
        if problem:
            return FakeReply(400, openai_error(problem))
        reply = self.responder(request.body)
        return reply if isinstance(reply, FakeReply) else FakeReply(200, reply)


def _handler_for(fake: FakeLLM) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            self._handle()

        def do_GET(self) -> None:
            self._handle()

        def _handle(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                body = None
            request = RecordedRequest(
                method=self.command,
                path=self.path,
                headers={k.lower(): v for k, v in self.headers.items()},
                raw=raw,
                body=body,
            )
            fake._record(request)
            try:
                reply = fake._answer(request)
            except Exception as exc:  # a broken responder is a 500, not a hung client
                reply = FakeReply(
                    500, openai_error(f"responder failed: {exc!r}", error_type="server_error")
                )
            if reply.delay_s and fake._stopping.wait(reply.delay_s):
                return
            self._send(reply)

        def _send(self, reply: FakeReply) -> None:
            if isinstance(reply.body, bytes):
                data = reply.body
            elif isinstance(reply.body, str):
                data = reply.body.encode()
            else:
                data = json.dumps(reply.body if reply.body is not None else {}).encode()
            self.send_response(reply.status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for key, value in reply.headers.items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # keep pytest output clean

    return Handler


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that timed out and hung up is a scenario under test, not a failure.
        if not isinstance(sys.exc_info()[1], ConnectionError | TimeoutError):
            super().handle_error(request, client_address)
