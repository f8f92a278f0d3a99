"""What the ``torpor`` command reads and writes (``torpor.cli``): payloads from an
argument, a file or stdin; the configuration; one API request and its refusal, with
the problem detail; lines on stdout."""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
from pathlib import Path
from typing import Any

from torpor import outbound
from torpor.cli_errors import EXIT_CONFIG, CliError, OutputClosed, Unreachable
from torpor.errors import ConfigError

TIMEOUT_S = 30.0
MAX_ANSWER_BYTES = 16 * 1024 * 1024
TRANSPORT_ERRORS = (OSError, http.client.HTTPException)


def _payload(value: str) -> bytes:
    if value == "-":
        return sys.stdin.buffer.read()
    if value.startswith("@"):
        try:
            return Path(value[1:]).read_bytes()
        except OSError as exc:
            raise CliError(f"cannot read {value[1:]}: {exc.strerror}") from exc
    return value.encode()


def _json_arg(value: str) -> Any:
    try:
        return json.loads(_payload(value))
    except ValueError as exc:
        raise CliError(f"not valid JSON: {exc}") from exc


def _settings() -> Any:
    from torpor.settings import Settings

    try:
        return Settings.from_env()
    except ConfigError as exc:
        raise CliError(str(exc), EXIT_CONFIG) from None
    except OSError as exc:
        raise CliError(f"cannot read the configuration: {exc}", EXIT_CONFIG) from None


def _request(
    args: argparse.Namespace,
    method: str,
    path: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    base = (args.url or _settings().public_url).rstrip("/")
    key = args.api_key or os.environ.get("TORPOR_API_KEY")
    all_headers = {"Content-Type": "application/json", **(headers or {})}
    if key:
        all_headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    try:
        response = outbound.request(
            method,
            base + path,
            body=data,
            headers=all_headers,
            timeout_s=TIMEOUT_S,
            max_body_bytes=MAX_ANSWER_BYTES,
        )
    except TRANSPORT_ERRORS as exc:
        raise Unreachable(f"cannot reach torpor at {base}: {exc}") from None
    if response.ok:
        return response.status, response.json()
    raise _refused(f"{method} {path}", response.status, response.body)


def _refused(what: str, status: int, body: bytes) -> CliError:
    """The API's refusal, with its problem detail (the README promises it)."""
    try:
        problem = json.loads(body or b"null") or {}
    except ValueError:
        problem = {}
    if not isinstance(problem, dict):
        problem = {}
    detail = problem.get("detail") or problem.get("title") or http.client.responses.get(status, "")
    return CliError(f"{what}: {status} {detail}")


def _out(text: str) -> None:
    try:
        # Flushed line by line: a pipe closed under a buffer failed at the interpreter's
        # exit instead, past main, with "Exception ignored" and exit 120.
        print(text, flush=True)
    except BrokenPipeError:
        raise OutputClosed from None


def _print(value: Any, args: argparse.Namespace | None = None) -> None:
    if args is not None and args.json:
        _out(json.dumps(value, ensure_ascii=False, default=str))
    else:
        _out(json.dumps(value, indent=2, ensure_ascii=False, default=str))
