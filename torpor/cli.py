"""The ``torpor`` command, for operators and webhook senders.

    torpor demo                      the main job, on embedded defaults
    torpor serve                     start the HTTP app (Ray Serve) and the reconciler
    torpor submit AGENT INPUT        submit a session through the API
    torpor status ID | ls | events ID | cancel ID | retry ID
    torpor sign / send               sign a payload, or POST it signed, as a sender would
    torpor deliveries [resend ID]    failed outbound notifications
    torpor reconcile                 one reconciler sweep, now
    torpor keys api|source|capability

API commands talk HTTP to ``--url`` (default: ``public_url`` from the configuration)
with ``--api-key`` (default: ``$TORPOR_API_KEY``). Errors are one line, never a traceback.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import urllib.parse
import uuid
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from torpor import outbound
from torpor.errors import TorporError

TIMEOUT_S = 30.0
# The SSE stream sends a keep-alive every 15 s; this much silence means it is gone.
STREAM_TIMEOUT_S = 60.0
MAX_ANSWER_BYTES = 16 * 1024 * 1024
TRANSPORT_ERRORS = (OSError, http.client.HTTPException)


class CliError(Exception):
    """A failure worth one line to the user."""


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

    return Settings.from_env()


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
        raise CliError(f"cannot reach torpor at {base}: {exc}") from None
    if response.ok:
        return response.status, response.json()
    try:
        problem = response.json() or {}
    except ValueError:
        problem = {}
    if not isinstance(problem, dict):
        problem = {}
    detail = (
        problem.get("detail")
        or problem.get("title")
        or http.client.responses.get(response.status, "")
    )
    raise CliError(f"{method} {path}: {response.status} {detail}")


def _print(value: Any) -> None:
    print(json.dumps(value, indent=2, ensure_ascii=False, default=str))


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


def cmd_serve(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from actors.config_ref import ConfigRef
    from serve_app import application

    settings = _settings()
    ray.init(address=args.address, namespace=settings.namespace)
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
    _print(answer)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    _print(_request(args, "GET", f"/v1/sessions/{urllib.parse.quote(args.session)}")[1])
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    query = urllib.parse.urlencode(
        {k: v for k, v in {"state": args.state, "limit": args.limit}.items() if v}
    )
    _, page = _request(args, "GET", f"/v1/sessions?{query}")
    for item in page["items"]:
        print(f"{item['session_id']}  {item['state']}")
    if page.get("next_cursor"):
        print(f"... more: --cursor {page['next_cursor']}")
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    _print(_request(args, "POST", f"/v1/sessions/{urllib.parse.quote(args.session)}/cancel")[1])
    return 0


def cmd_retry(args: argparse.Namespace) -> int:
    _print(_request(args, "POST", f"/v1/sessions/{urllib.parse.quote(args.session)}/retry")[1])
    return 0


def cmd_events(args: argparse.Namespace) -> int:
    base = (args.url or _settings().public_url).rstrip("/")
    key = args.api_key or os.environ.get("TORPOR_API_KEY")
    headers = {"Accept": "text/event-stream"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    url = f"{base}/v1/sessions/{urllib.parse.quote(args.session)}/events"
    try:
        with outbound.stream_lines(url, headers=headers, timeout_s=STREAM_TIMEOUT_S) as (
            status,
            lines,
        ):
            if not 200 <= status < 300:
                raise CliError(f"GET events: {status}")
            for raw in lines:
                line = raw.decode().rstrip("\n")
                if line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "fraction" in event:  # progress of the session's running work
                        share = f"{100 * event['fraction']:.0f}%"
                        print(f"{event['at']}  {'PROGRESS':<10} {share:>4}  {event['message']}")
                        continue
                    at, state = event["at"], event["state"]
                    print(f"{at}  {state:<10} epoch {event['epoch']}  {event['reason']}")
    except TRANSPORT_ERRORS as exc:
        raise CliError(f"cannot reach torpor at {base}: {exc}") from None
    return 0


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
        print(f"{name}: {value}")
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
        raise CliError(f"cannot reach {args.target}: {exc}") from None
    print(f"{response.status} {response.body.decode(errors='replace')}")
    return 0 if response.ok else 1


def cmd_deliveries(args: argparse.Namespace) -> int:
    if args.resend:
        _print(
            _request(args, "POST", f"/v1/deliveries/{urllib.parse.quote(args.resend)}/resend")[1]
        )
        return 0
    _, page = _request(args, "GET", f"/v1/deliveries?status={args.status}")
    for d in page["items"]:
        print(
            f"{d['delivery_id']}  {d['status']:<9} attempts {d['attempts']}  "
            f"last {d['last_category']}  {d['url']}"
        )
    return 0


def cmd_reconcile(args: argparse.Namespace) -> int:
    import ray

    from actors.config_ref import ConfigRef
    from actors.reconciler import ensure_reconciler

    settings = _settings()
    ray.init(address=args.address or "auto", namespace=settings.namespace, log_to_driver=False)
    handle = ensure_reconciler(ConfigRef.of_loaded(settings), start=False)
    _print(ray.get(handle.sweep_once.remote()))
    return 0


def cmd_keys(args: argparse.Namespace) -> int:
    import secrets as random

    from torpor.auth import new_api_key
    from torpor.webhooks.signing import Scheme, generate_secret

    if args.kind == "api":
        key, hashed = new_api_key()
        print(f"api key (give to the client): {key}")
        print(f'hash (put in tenants.<name>.api_keys): "{hashed}"')
    elif args.kind == "source":
        print(generate_secret(Scheme(args.scheme)))
    else:
        print(random.token_hex(32))
    return 0


# -- parser ---------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="torpor", description="Agent sessions that sleep while they wait."
    )
    sub = p.add_subparsers(dest="command", required=True)

    def api(
        name: str, fn: Callable[[argparse.Namespace], int], help: str
    ) -> argparse.ArgumentParser:
        s = sub.add_parser(name, help=help)
        s.add_argument("--url", help="torpor's base URL (default: public_url)")
        s.add_argument("--api-key", help="bearer API key (default: $TORPOR_API_KEY)")
        s.set_defaults(fn=fn)
        return s

    d = sub.add_parser("demo", help="run the document-batch demo on this machine")
    d.add_argument("--documents", type=int, default=50)
    d.add_argument("--placement", choices=["dedicated", "pooled"], default="dedicated")
    d.add_argument("--redis", help="use this Redis instead of the embedded SQLite index")
    d.add_argument("--s3", help="use s3://bucket/prefix instead of a local folder")
    d.add_argument("--s3-endpoint", help="S3 endpoint URL (MinIO, …)")
    d.add_argument("--port", type=int, default=0)
    d.add_argument("--seed", type=int, default=7)
    d.add_argument("--sla", type=float, default=75.0, help="approval SLA in seconds")
    d.add_argument("--state-dir", help="keep storage here (default: a temporary folder)")
    d.add_argument("--keep", action="store_true", help="keep the temporary storage")
    d.set_defaults(fn=cmd_demo)

    s = sub.add_parser("serve", help="start the Serve app and the reconciler")
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
    s.add_argument("--limit", type=int, default=50)
    api("events", cmd_events, "follow a session's transitions").add_argument("session")
    api("cancel", cmd_cancel, "cancel a session").add_argument("session")
    api("retry", cmd_retry, "retry a QUARANTINED session").add_argument("session")

    for name, fn, text in (
        ("sign", cmd_sign, "print signature headers for a payload"),
        ("send", cmd_send, "POST a payload, signed"),
    ):
        s = sub.add_parser(name, help=text)
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

    s = sub.add_parser("reconcile", help="run one reconciler sweep now")
    s.add_argument("--address")
    s.set_defaults(fn=cmd_reconcile)

    s = sub.add_parser("keys", help="generate an API key, a source secret or a capability key")
    s.add_argument("kind", choices=["api", "source", "capability"])
    s.add_argument("--scheme", default="torpor", choices=["torpor", "standard", "github", "stripe"])
    s.set_defaults(fn=cmd_keys)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        code: int = args.fn(args)
    except (CliError, TorporError) as exc:
        print(f"torpor: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
