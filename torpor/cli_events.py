"""``torpor events`` (``torpor.cli``): a session's transitions followed over its event
stream (SSE) until the session ends, the stream opened again with ``Last-Event-ID``
after a break, a bounded number of times in a row."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torpor import outbound
from torpor.backoff import Backoff
from torpor.cli_errors import Unreachable
from torpor.cli_io import TRANSPORT_ERRORS, _out, _refused, _settings

# The SSE stream sends a keep-alive every 15 s; this much silence means it is gone.
STREAM_TIMEOUT_S = 60.0
MAX_REFUSAL_LINES = 64  # of a refused stream's body: a problem+json is one or a few
# A broken event stream is opened again this many times in a row before ``events``
# gives up (an attempt that received anything, a keep-alive too, starts the count again).
STREAM_RECONNECTS = 5
STREAM_BACKOFF = Backoff(base_s=0.5, cap_s=10.0, jitter=0.5)
# Answers to a reconnect that say "not now", not "no": tried again, as a break is.
RETRYABLE_STATUSES = frozenset({429, 502, 503, 504})


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
