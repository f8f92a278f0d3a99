"""The commands that are one API request each (``torpor.cli``): submit, status, ls,
cancel, retry, deliveries; a listing page ends with its next cursor."""

from __future__ import annotations

import argparse
import urllib.parse
import uuid
from typing import Any

from torpor.cli_io import _json_arg, _out, _print, _request


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
