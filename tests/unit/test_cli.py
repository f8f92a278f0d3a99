"""The torpor command: keys, signing, and one-line errors."""

from __future__ import annotations

import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from torpor.cli import main
from torpor.webhooks.signing import Scheme, verify

ROOT = Path(__file__).resolve().parents[2]


def test_keys(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["keys", "api"]) == 0
    out = capsys.readouterr().out
    assert "tpk_" in out and "sha256:" in out
    assert main(["keys", "source", "--scheme", "standard"]) == 0
    assert capsys.readouterr().out.startswith("whsec_")


def test_sign_prints_headers_a_receiver_accepts(capsys: pytest.CaptureFixture[str]) -> None:
    secret = "s" * 64
    body = '{"eventId": "e1"}'
    assert main(["sign", "--body", body, "--secret", secret]) == 0
    headers = dict(line.split(": ", 1) for line in capsys.readouterr().out.strip().splitlines())
    verified = verify(Scheme.TORPOR, body.encode(), headers, [secret], now=datetime.now(UTC))
    assert verified.delivery_id == headers["X-Torpor-Nonce"]


def test_errors_are_one_line_without_traceback(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "torpor.cli", "status", "s_x", "--url", "http://127.0.0.1:9"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert result.returncode == 3  # EXIT_UNREACHABLE
    assert result.stderr.startswith("torpor: error: cannot reach torpor")
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    result = subprocess.run(
        [sys.executable, "-m", "torpor.cli", "sign", "--body", f"@{tmp_path}/missing"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
        env={"PATH": "/usr/bin", "TORPOR_WEBHOOK_SECRET": "x" * 64},
    )
    assert result.returncode == 1 and "cannot read" in result.stderr
    assert "Traceback" not in result.stderr


def test_retry_posts_the_operator_action(capsys: pytest.CaptureFixture[str]) -> None:
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    seen: list[tuple[str, str]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            seen.append((self.command, self.path))
            body = b'{"session_id": "s_1", "state": "QUARANTINED"}'
            self.send_response(202)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            return

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.handle_request, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert main(["retry", "s_1", "--url", url]) == 0
    finally:
        thread.join(timeout=5)
        server.server_close()
    assert seen == [("POST", "/v1/sessions/s_1/retry")]
    assert '"QUARANTINED"' in capsys.readouterr().out
