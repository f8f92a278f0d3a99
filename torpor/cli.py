"""The ``torpor`` command, for operators and webhook senders.

    torpor demo                      the main job, on embedded defaults
    torpor serve                     start the HTTP app (Ray Serve) and the reconciler
    torpor submit AGENT INPUT        submit a session through the API
    torpor status ID | ls | events ID | cancel ID | retry ID
    torpor sign / send               sign a payload, or POST it signed, as a sender would
    torpor deliveries [resend ID]    failed outbound notifications
    torpor reconcile                 one reconciler sweep, now
    torpor keys api|source|capability
    torpor console                   print the operator console's URL and a login link

API commands talk HTTP to ``--url`` (default: ``public_url`` from the configuration)
with ``--api-key`` (default: ``$TORPOR_API_KEY``). ``--json`` prints JSON (one object a
line for ``events``, ``ls`` and ``deliveries``). Errors are one line on stderr, never a
traceback, and the exit code says which kind of failure it was (:data:`EXIT_CODES`).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import itertools
import json
import math
import os
import sys
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from torpor import outbound
from torpor.backoff import Backoff
from torpor.errors import ConfigError, StorageUnavailable, TorporError

TIMEOUT_S = 30.0
# The SSE stream sends a keep-alive every 15 s; this much silence means it is gone.
STREAM_TIMEOUT_S = 60.0
MAX_ANSWER_BYTES = 16 * 1024 * 1024
MAX_REFUSAL_LINES = 64  # of a refused stream's body: a problem+json is one or a few
# A broken event stream is opened again this many times in a row before ``events``
# gives up (an attempt that received anything, a keep-alive too, starts the count again).
STREAM_RECONNECTS = 5
STREAM_BACKOFF = Backoff(base_s=0.5, cap_s=10.0, jitter=0.5)
# Answers to a reconnect that say "not now", not "no": tried again, as a break is.
RETRYABLE_STATUSES = frozenset({429, 502, 503, 504})
TRANSPORT_ERRORS = (OSError, http.client.HTTPException)


EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_CONFIG = 4
EXIT_INTERNAL = 5
EXIT_INTERRUPTED = 130

# The documented exit codes (README "Exit codes"; a test keeps the two in step).
EXIT_CODES: dict[int, str] = {
    EXIT_OK: "success",
    EXIT_FAILED: "the command failed: the API refused it (its problem detail is printed), "
    "or a signed `send` got a non-2xx answer",
    EXIT_USAGE: "bad command line (unknown command, missing argument)",
    EXIT_UNREACHABLE: "torpor's API, Ray or another service could not be reached",
    EXIT_CONFIG: "the configuration (TORPOR_CONFIG, TORPOR_* variables) is invalid",
    EXIT_INTERNAL: "an unexpected error (a bug: the line names the exception)",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C)",
}


class CliError(Exception):
    """A failure worth one line to the user; ``code`` is its exit code."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.code = code


class Unreachable(CliError):
    """A service the command needs did not answer."""

    def __init__(self, message: str) -> None:
        super().__init__(message, EXIT_UNREACHABLE)


def _positive(text: str) -> int:
    """A count of one or more, refused as a usage error (exit 2) before anything runs: 0
    went to the server (a page of nothing refused as a problem, a demo of no documents
    that failed half-way with the API's 400 as an internal error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not 1 or more")
    return value


def _seconds(text: str) -> float:
    """A duration above zero, refused as a usage error (exit 2) before anything runs."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a number of seconds above 0")
    return value


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


RAY_PROBE_TIMEOUT_S = 5.0
# A sweep takes seconds; a full repair of a large deployment (hourly) can take minutes.
RECONCILE_TIMEOUT_S = 120.0


def _probe(address: str) -> None:
    """Fail fast, in one line, when a ``host:port`` Ray address does not answer: Ray
    itself retries for minutes and logs each attempt."""
    import socket

    host, sep, port = address.rpartition(":")
    if not sep or "://" in address or not port.isdigit():
        return  # "auto", "local", ray://…: Ray resolves those itself
    try:
        socket.create_connection((host, int(port)), timeout=RAY_PROBE_TIMEOUT_S).close()
    except OSError as exc:
        raise Unreachable(f"cannot connect to Ray at {address}: {exc}") from None


def _ray_init(**kwargs: Any) -> None:
    import ray

    if kwargs.get("address"):
        _probe(kwargs["address"])
    try:
        ray.init(**kwargs)
    except (ConnectionError, TimeoutError) as exc:
        where = kwargs.get("address") or "a local Ray"
        raise Unreachable(f"cannot connect to Ray at {where}: {exc}") from None


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


class OutputClosed(Exception):
    """The reader of stdout went away (``torpor ls | head``). Not an ``OSError``: as a
    BrokenPipeError it was caught as an unreachable API, or escaped as a bug."""


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


# -- commands -------------------------------------------------------------------------


def cmd_demo(args: argparse.Namespace) -> int:
    from torpor.entry.demo import DemoOptions, run_demo

    return run_demo(
        DemoOptions(
            documents=args.documents,
            placement=args.placement,
            redis_url=args.redis,
            s3_url=args.s3,
            s3_endpoint=args.s3_endpoint,
            port=args.port,
            seed=args.seed,
            sla_s=args.sla,
            keep=args.keep,
            state_dir=args.state_dir,
        )
    )


LOOPBACK = {"127.0.0.1", "localhost", "::1", "[::1]"}
ANY_ADDRESS = {"0.0.0.0", "::", ""}  # noqa: S104 - compared with --host, never bound here


def serving_url(public_url: str | None, host: str, port: int) -> str:
    """The ``public_url`` capability links and senders use, for a server listening on
    ``host:port``: unset, it follows the listener; set to this machine, it must name the
    port that listens (links to a port nothing listens on were the classic first-run trap)."""
    if public_url is None:
        shown = "127.0.0.1" if host in ANY_ADDRESS else host
        return f"http://{shown}:{port}"
    parts = urllib.parse.urlsplit(public_url)
    local = (parts.hostname or "") in LOOPBACK or parts.hostname == host
    default_port = 443 if parts.scheme == "https" else 80
    if local and (parts.port or default_port) != port:
        raise CliError(
            f"public_url {public_url} points at port {parts.port or default_port} of this "
            f"machine, but torpor serve listens on {host}:{port}: unset public_url, set it "
            f"to http://{host}:{port}, or pass --port {parts.port or default_port}",
            EXIT_CONFIG,
        )
    return public_url


def cmd_serve(args: argparse.Namespace) -> int:
    from torpor.entry.ingress import choose_ingress

    settings = _settings()
    explicit = "public_url" in settings.model_fields_set
    # A configuration error is the one line the user sees, before anything starts.
    public_url = serving_url(settings.public_url if explicit else None, args.host, args.port)
    # Ray joins RAY_ADDRESS when no address is given; with neither, a Ray of its own
    # ("local": never a cluster someone left running on this machine), which inherits this
    # environment and so the ingress chosen here. A cluster has its own.
    address = args.address or os.environ.get("RAY_ADDRESS") or "local"
    if address == "local":
        print(choose_ingress().message, file=sys.stderr, flush=True)
    else:
        print(
            f"ingress: what the Ray cluster at {address} was started with "
            "(RAY_SERVE_ENABLE_HA_PROXY=1 on its nodes for HAProxy)",
            file=sys.stderr,
            flush=True,
        )
    if not explicit:
        # Replicas and actors read their settings themselves: tell them too.
        os.environ["TORPOR_PUBLIC_URL"] = public_url
        settings = settings.model_copy(update={"public_url": public_url})
    _out(f"torpor: serving on http://{args.host}:{args.port}, public_url {public_url}")
    from ray import serve

    from actors.config_ref import ConfigRef
    from serve_app import application

    _ray_init(address=address, namespace=settings.namespace)
    serve.start(http_options={"host": args.host, "port": args.port})
    config = ConfigRef.of_loaded(settings)  # replicas read secrets themselves
    serve.run(application(config), name="torpor", route_prefix="/", blocking=True)
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    body = {"agent": args.agent, "input": _json_arg(args.input)}
    if args.callback_url:
        body["callback_url"] = args.callback_url
    key = args.idempotency_key or str(uuid.uuid4())
    _, answer = _request(args, "POST", "/v1/sessions", body, {"Idempotency-Key": key})
    _print(answer, args)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    _print(_request(args, "GET", f"/v1/sessions/{urllib.parse.quote(args.session)}")[1], args)
    return 0


def _query(**params: Any) -> str:
    return urllib.parse.urlencode({k: v for k, v in params.items() if v})


def _more(page: dict[str, Any], args: argparse.Namespace) -> None:
    """The cursor of the next page, for ``--cursor``: a page that ends without it looked
    like the whole list."""
    if page.get("next_cursor"):
        if args.json:
            _print({"next_cursor": page["next_cursor"]}, args)
        else:
            _out(f"... more: --cursor {page['next_cursor']}")


def cmd_ls(args: argparse.Namespace) -> int:
    query = _query(state=args.state, limit=args.limit, cursor=args.cursor)
    _, page = _request(args, "GET", f"/v1/sessions?{query}")
    for item in page["items"]:
        if args.json:
            _print(item, args)
        else:
            _out(f"{item['session_id']}  {item['state']}")
    _more(page, args)
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    _print(
        _request(args, "POST", f"/v1/sessions/{urllib.parse.quote(args.session)}/cancel")[1], args
    )
    return 0


def cmd_retry(args: argparse.Namespace) -> int:
    _print(
        _request(args, "POST", f"/v1/sessions/{urllib.parse.quote(args.session)}/retry")[1], args
    )
    return 0


def cmd_events(args: argparse.Namespace) -> int:
    """Follow the stream until the session ends. A stream that breaks before its end is
    opened again with ``Last-Event-ID`` (the server then sends only what came after it);
    ``STREAM_RECONNECTS`` reconnects in a row that bring nothing at all give up. The first
    connection is not retried: an API that never answered is unreachable at once, as
    for every other command."""
    base = (args.url or _settings().public_url).rstrip("/")
    key = args.api_key or os.environ.get("TORPOR_API_KEY")
    headers = {"Accept": "text/event-stream"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    url = f"{base}/v1/sessions/{urllib.parse.quote(args.session)}/events"
    followed = _Followed()
    failed = 0  # reconnects in a row that received nothing
    reconnect = False
    while True:
        if followed.last is not None:
            headers["Last-Event-ID"] = str(followed.last)
        heard = followed.heard
        try:
            why = _follow(url, headers, followed, args)
        except TRANSPORT_ERRORS as exc:
            if not followed.opened:
                raise Unreachable(f"cannot reach torpor at {base}: {exc}") from None
            why = f"broke ({exc}) and torpor at {base} could not be reached again"
        if followed.ended:
            return 0
        # A stream that said anything (a keep-alive at least) was healthy until it broke:
        # a proxy that cuts idle streams must not end the follow of a long wait. Only
        # reconnects count: the first connection's silence counted as one, so a follow
        # whose first stream was healthy made one reconnect more than the bound.
        failed = failed + 1 if reconnect and followed.heard == heard else 0
        if failed >= STREAM_RECONNECTS:
            raise Unreachable(f"the event stream of {args.session} {why}")
        reconnect = True
        time.sleep(STREAM_BACKOFF.delay_s(max(failed - 1, 0)))


@dataclass
class _Followed:
    """What following one session's stream has come to, over its connections."""

    last: int | None = None  # the id (history sequence) of the last transition shown
    opened: bool = False  # a stream was answered once: a break after it is reconnected
    ended: bool = False  # the session ended and the stream showed its end
    heard: int = 0  # lines received, keep-alives included


def _follow(
    url: str, headers: dict[str, str], followed: _Followed, args: argparse.Namespace
) -> str:
    """One connection to the stream; how it ended, unless the session did. Transitions
    up to ``followed.last`` are not shown again (a server that replays from the start
    shows none twice). Transport errors are the caller's."""
    from torpor.lifecycle import TERMINAL_STATES

    # ``timeout_s`` bounds the connect and every read: a server gone silent (no
    # keep-alive within it) ends this attempt rather than the command waiting for ever.
    with outbound.stream_lines(url, headers=headers, timeout_s=STREAM_TIMEOUT_S) as (
        status,
        lines,
    ):
        if status == 204:  # the session ended and nothing was missed: the server's end
            followed.ended = True
            return "ended"
        if followed.opened and status in RETRYABLE_STATUSES:
            return f"was answered {status} when opened again"
        if not 200 <= status < 300:
            # The body is the problem+json: read, capped, for its detail.
            body = b"".join(itertools.islice(lines, MAX_REFUSAL_LINES))
            raise _refused("GET events", status, body)
        followed.opened = True
        for event_id, data in _sse_events(lines, followed):
            event = json.loads(data)
            if event_id is not None:  # a transition: its id is its history sequence
                if followed.last is not None and event_id <= followed.last:
                    continue
                followed.last = event_id
                followed.ended = event.get("state") in TERMINAL_STATES
            _show(event, args)
        return "closed before the session ended"


def _sse_events(lines: Iterator[bytes], followed: _Followed) -> Iterator[tuple[int | None, str]]:
    """``(id, data)`` of each event in the stream, as an EventSource dispatches them: at
    the blank line that ends it; an id that is not a number is no transition's. Every
    line counts in ``followed.heard``."""
    event_id: int | None = None
    data: list[str] = []
    for raw in lines:
        followed.heard += 1
        line = raw.decode().rstrip("\r\n")
        if not line:
            if data:
                yield event_id, "\n".join(data)
            event_id, data = None, []
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
        elif line.startswith("id:"):
            value = line[3:].strip()
            event_id = int(value) if value.isascii() and value.isdigit() else None


def _show(event: dict[str, Any], args: argparse.Namespace) -> None:
    if args.json:
        _out(json.dumps(event, ensure_ascii=False))
    elif "fraction" in event:  # progress of the session's running work
        share = f"{100 * event['fraction']:.0f}%"
        _out(f"{event['at']}  {'PROGRESS':<10} {share:>4}  {event['message']}")
    else:
        at, state = event["at"], event["state"]
        _out(f"{at}  {state:<10} epoch {event['epoch']}  {event['reason']}")


def _signed(args: argparse.Namespace) -> tuple[bytes, dict[str, str]]:
    from torpor.webhooks.signing import Scheme, sign

    secret = args.secret or os.environ.get("TORPOR_WEBHOOK_SECRET")
    if not secret:
        raise CliError("give --secret or set TORPOR_WEBHOOK_SECRET")
    body = _payload(args.body)
    try:
        headers = sign(Scheme(args.scheme), body, secret, now=datetime.now(UTC))
    except Exception as exc:
        raise CliError(f"cannot sign: {exc}") from None
    headers["Content-Type"] = args.content_type
    return body, headers


def cmd_sign(args: argparse.Namespace) -> int:
    _, headers = _signed(args)
    for name, value in headers.items():
        _out(f"{name}: {value}")
    return 0


def cmd_send(args: argparse.Namespace) -> int:
    body, headers = _signed(args)
    try:
        response = outbound.request(
            "POST",
            args.target,
            body=body,
            headers=headers,
            timeout_s=TIMEOUT_S,
            max_body_bytes=MAX_ANSWER_BYTES,
        )
    except TRANSPORT_ERRORS as exc:
        raise Unreachable(f"cannot reach {args.target}: {exc}") from None
    if args.json:
        text = response.body.decode(errors="replace")
        _print({"status": response.status, "body": text}, args)
    else:
        _out(f"{response.status} {response.body.decode(errors='replace')}")
    return EXIT_OK if response.ok else EXIT_FAILED


def cmd_deliveries(args: argparse.Namespace) -> int:
    if args.resend:
        _print(
            _request(args, "POST", f"/v1/deliveries/{urllib.parse.quote(args.resend)}/resend")[1],
            args,
        )
        return 0
    query = _query(status=args.status, limit=args.limit, cursor=args.cursor)
    _, page = _request(args, "GET", f"/v1/deliveries?{query}")
    for d in page["items"]:
        if args.json:
            _print(d, args)
        else:
            _out(
                f"{d['delivery_id']}  {d['status']:<9} attempts {d['attempts']}  "
                f"last {d['last_category']}  {d['url']}"
            )
    _more(page, args)
    return 0


def cmd_reconcile(args: argparse.Namespace) -> int:
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    from actors.reconciler import NAME

    settings = _settings()
    namespace = settings.namespace
    _ray_init(address=args.address or "auto", namespace=namespace, log_to_driver=False)
    try:
        # Looked up, never made: made here, a detached reconciler started on this shell's
        # configuration and swept on after the command, wherever that pointed.
        handle = ray.get_actor(NAME, namespace=namespace)  # Ray's own deadline bounds it
    except ValueError:
        raise Unreachable(
            f"no reconciler runs in namespace {namespace!r} (torpor serve starts one)"
        ) from None
    except GetTimeoutError as exc:
        raise Unreachable(f"cannot look up the reconciler: {exc}") from None
    try:
        # A reconciler that is stuck, or being restarted (Ray retries the call until it is
        # back), held the command for ever.
        report: Any = ray.get(handle.sweep_once.remote(), timeout=args.timeout_s)
    except GetTimeoutError:
        raise Unreachable(
            f"the reconciler did not answer within {args.timeout_s:g} s (stuck, or being "
            "restarted); its sweep may still run (a long one needs a larger --timeout-s)"
        ) from None
    except RayActorError as exc:
        raise Unreachable(f"the reconciler died during the sweep: {exc}") from None
    _print(report, args)
    return 0


def cmd_keys(args: argparse.Namespace) -> int:
    import secrets as random

    from torpor.auth import new_api_key
    from torpor.webhooks.signing import Scheme, generate_secret

    if args.kind == "api":
        key, hashed = new_api_key()
        _out(f"api key (give to the client): {key}")
        _out(f'hash (put in tenants.<name>.api_keys): "{hashed}"')
    elif args.kind == "source":
        _out(generate_secret(Scheme(args.scheme)))
    else:
        _out(random.token_hex(32))
    return 0


def cmd_console(args: argparse.Namespace) -> int:
    base = (args.url or _settings().public_url).rstrip("/")
    url = f"{base}/console"
    key = args.operator_key or os.environ.get("TORPOR_OPERATOR_KEY")
    # The key rides in the fragment: browsers never send it, so it is in no access log;
    # the login page reads it, exchanges it for a session cookie and clears the address.
    login = f"{url}/login#key={urllib.parse.quote(key, safe='')}" if key else None
    if args.json:
        _print({"url": url, "login_url": login}, args)
        return EXIT_OK
    _out(f"console: {url}")
    if login:
        _out(f"login:   {login}")
    else:
        _out("login:   give --operator-key or set TORPOR_OPERATOR_KEY for a login link")
    return EXIT_OK


# -- parser ---------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    from torpor import __version__

    p = argparse.ArgumentParser(
        prog="torpor",
        description="Agent sessions that sleep while they wait.",
        epilog="exit codes: "
        + "; ".join(f"{code} {text.split(':')[0]}" for code, text in EXIT_CODES.items()),
    )
    p.add_argument("--version", action="version", version=f"torpor {__version__}")
    p.add_argument("--json", action="store_true", help="print JSON (one object a line)")
    # --json also after the command (`torpor events ID --json`); SUPPRESS keeps the
    # top-level value when it is not repeated there.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="JSON")
    sub = p.add_subparsers(dest="command", required=True)

    def command(name: str, **kwargs: Any) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[common], **kwargs)

    def api(
        name: str, fn: Callable[[argparse.Namespace], int], help: str
    ) -> argparse.ArgumentParser:
        s = command(name, help=help)
        s.add_argument("--url", help="torpor's base URL (default: public_url)")
        s.add_argument("--api-key", help="bearer API key (default: $TORPOR_API_KEY)")
        s.set_defaults(fn=fn)
        return s

    d = command("demo", help="run the document-batch demo on this machine")
    d.add_argument("--documents", type=_positive, default=50)
    d.add_argument("--placement", choices=["dedicated", "pooled"], default="pooled")
    d.add_argument("--redis", help="use this Redis instead of the embedded SQLite index")
    d.add_argument("--s3", help="use s3://bucket/prefix instead of a local folder")
    d.add_argument("--s3-endpoint", help="S3 endpoint URL (MinIO, …)")
    d.add_argument("--port", type=int, default=0)
    d.add_argument("--seed", type=int, default=7)
    d.add_argument("--sla", type=float, default=75.0, help="approval SLA in seconds")
    d.add_argument("--state-dir", help="keep storage here (default: a temporary folder)")
    d.add_argument("--keep", action="store_true", help="keep the temporary storage")
    d.set_defaults(fn=cmd_demo)

    s = command("serve", help="start the Serve app and the reconciler")
    s.add_argument("--address", help="Ray address (default: start a local Ray)")
    s.add_argument("--host", default="127.0.0.1", help="HTTP host (default: 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="HTTP port (default: 8000)")
    s.set_defaults(fn=cmd_serve)

    s = api("submit", cmd_submit, "submit a session")
    s.add_argument("agent")
    s.add_argument("input", help="JSON, @file or - for stdin")
    s.add_argument("--callback-url")
    s.add_argument("--idempotency-key")
    api("status", cmd_status, "show a session").add_argument("session")
    s = api("ls", cmd_ls, "list sessions")
    s.add_argument("--state")
    s.add_argument("--limit", type=_positive, default=50)
    s.add_argument("--cursor", help="the next page: the cursor the last one ended with")
    api("events", cmd_events, "follow a session's transitions").add_argument("session")
    api("cancel", cmd_cancel, "cancel a session").add_argument("session")
    api("retry", cmd_retry, "retry a QUARANTINED session").add_argument("session")

    for name, fn, text in (
        ("sign", cmd_sign, "print signature headers for a payload"),
        ("send", cmd_send, "POST a payload, signed"),
    ):
        s = command(name, help=text)
        if name == "send":
            s.add_argument("target", help="e.g. http://127.0.0.1:8000/v1/hooks/oa")
        s.add_argument("--body", required=True, help="payload, @file or - for stdin")
        s.add_argument(
            "--scheme", default="torpor", choices=["torpor", "standard", "github", "stripe"]
        )
        s.add_argument("--secret", help="the source's secret (default: $TORPOR_WEBHOOK_SECRET)")
        s.add_argument("--content-type", default="application/json")
        s.set_defaults(fn=fn)

    s = api("deliveries", cmd_deliveries, "list failed notifications, or resend one")
    s.add_argument("--status", default="dead", choices=["pending", "delivered", "dead", "disabled"])
    s.add_argument("--resend", metavar="DELIVERY_ID")
    s.add_argument("--limit", type=_positive, default=50)
    s.add_argument("--cursor", help="the next page: the cursor the last one ended with")

    s = command("reconcile", help="run one reconciler sweep now")
    s.add_argument("--address", help="Ray address (default: auto, the running cluster)")
    s.add_argument(
        "--timeout-s",
        type=_seconds,
        default=RECONCILE_TIMEOUT_S,
        help=f"wait this long for the sweep (default: {RECONCILE_TIMEOUT_S:g})",
    )
    s.set_defaults(fn=cmd_reconcile)

    s = command("keys", help="generate an API key, a source secret or a capability key")
    s.add_argument("kind", choices=["api", "source", "capability"])
    s.add_argument("--scheme", default="torpor", choices=["torpor", "standard", "github", "stripe"])
    s.set_defaults(fn=cmd_keys)

    s = command("console", help="print the operator console's URL and a login link")
    s.add_argument("--url", help="torpor's base URL (default: public_url)")
    s.add_argument("--operator-key", help="operator key (default: $TORPOR_OPERATOR_KEY)")
    s.set_defaults(fn=cmd_console)
    return p


def _one_line(text: str) -> str:
    return " ".join(text.split()) or "(no message)"


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)  # usage errors exit 2 (argparse)
    try:
        code: int = args.fn(args)
    except CliError as exc:
        print(f"torpor: error: {_one_line(str(exc))}", file=sys.stderr)
        return exc.code
    except ConfigError as exc:
        print(f"torpor: error: {_one_line(str(exc))}", file=sys.stderr)
        return EXIT_CONFIG
    except StorageUnavailable as exc:
        print(f"torpor: error: {_one_line(str(exc))}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except TorporError as exc:
        print(f"torpor: error: {_one_line(str(exc))}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except OutputClosed:
        # The reader has what it wanted. Python flushes stdout again at exit, which would
        # fail and print "Exception ignored": what is left goes to /dev/null instead.
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except (ConnectionError, TimeoutError) as exc:
        print(f"torpor: error: cannot connect: {_one_line(str(exc))}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except Exception as exc:  # the top level: a bug still gets one line, not a traceback
        name = type(exc).__name__
        print(f"torpor: error: internal: {name}: {_one_line(str(exc))}", file=sys.stderr)
        return EXIT_INTERNAL
    return code


if __name__ == "__main__":
    sys.exit(main())
