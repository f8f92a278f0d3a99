"""The commands for keys and signatures (``torpor.cli``): ``sign`` and ``send`` a
payload as a webhook sender would, ``keys`` to generate an API key, a source secret or a
capability key, ``console`` for the operator console's URL and login link."""

from __future__ import annotations

import argparse
import os
import urllib.parse
from datetime import UTC, datetime

from torpor import outbound
from torpor.cli_errors import EXIT_FAILED, EXIT_OK, CliError, Unreachable
from torpor.cli_io import (
    MAX_ANSWER_BYTES,
    TIMEOUT_S,
    TRANSPORT_ERRORS,
    _out,
    _payload,
    _print,
    _settings,
)


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
