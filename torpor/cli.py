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
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from torpor.cli_cluster import (
    ANY_ADDRESS,
    LOOPBACK,
    RAY_PROBE_TIMEOUT_S,
    RECONCILE_TIMEOUT_S,
    cmd_demo,
    cmd_reconcile,
    cmd_serve,
    serving_url,
)
from torpor.cli_errors import (
    EXIT_CODES,
    EXIT_CONFIG,
    EXIT_FAILED,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    CliError,
    OutputClosed,
    Unreachable,
)
from torpor.cli_events import (
    MAX_REFUSAL_LINES,
    RETRYABLE_STATUSES,
    STREAM_BACKOFF,
    STREAM_RECONNECTS,
    STREAM_TIMEOUT_S,
    cmd_events,
)
from torpor.cli_io import MAX_ANSWER_BYTES, TIMEOUT_S, TRANSPORT_ERRORS
from torpor.cli_keys import cmd_console, cmd_keys, cmd_send, cmd_sign
from torpor.cli_requests import (
    cmd_cancel,
    cmd_deliveries,
    cmd_ls,
    cmd_retry,
    cmd_status,
    cmd_submit,
)
from torpor.errors import ConfigError, StorageUnavailable, TorporError

__all__ = [
    "ANY_ADDRESS",
    "EXIT_CODES",
    "EXIT_CONFIG",
    "EXIT_FAILED",
    "EXIT_INTERNAL",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_UNREACHABLE",
    "EXIT_USAGE",
    "LOOPBACK",
    "MAX_ANSWER_BYTES",
    "MAX_REFUSAL_LINES",
    "RAY_PROBE_TIMEOUT_S",
    "RECONCILE_TIMEOUT_S",
    "RETRYABLE_STATUSES",
    "STREAM_BACKOFF",
    "STREAM_RECONNECTS",
    "STREAM_TIMEOUT_S",
    "TIMEOUT_S",
    "TRANSPORT_ERRORS",
    "CliError",
    "OutputClosed",
    "Unreachable",
    "cmd_cancel",
    "cmd_console",
    "cmd_deliveries",
    "cmd_demo",
    "cmd_events",
    "cmd_keys",
    "cmd_ls",
    "cmd_reconcile",
    "cmd_retry",
    "cmd_send",
    "cmd_serve",
    "cmd_sign",
    "cmd_status",
    "cmd_submit",
    "main",
    "parser",
    "serving_url",
]


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
