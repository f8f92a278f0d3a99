"""CLI conventions, run as a user runs them: ``python -m torpor`` in a subprocess.

--version, a global --json (JSON lines for ``events``), documented exit codes, one-line
errors for every failure class, and ``torpor console``.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest

import torpor
from tests.support.served import Answering, served
from torpor import cli

ROOT = Path(__file__).resolve().parents[2]


def run(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("TORPOR_")}
    return subprocess.run(
        [sys.executable, "-m", "torpor", *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
        timeout=120,
        env={**base, **(env or {})},
    )


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("torpor: error: ") and "Traceback" not in result.stderr
    return lines[0]


@pytest.fixture
def sse_server() -> Iterator[str]:
    """An events endpoint that streams two transitions and closes."""
    events = [
        {"at": "2026-01-01T00:00:00Z", "state": "RUNNING", "epoch": 1, "reason": "start"},
        {"at": "2026-01-01T00:00:01Z", "state": "COMPLETED", "epoch": 1, "reason": "done"},
    ]

    class Handler(Answering):
        def do_GET(self) -> None:
            body = b"".join(
                f"id: {i}\ndata: {json.dumps(e)}\n\n".encode() for i, e in enumerate(events)
            )
            self.answer(200, body, "text/event-stream")

    with served(Handler) as url:
        yield url


def test_python_m_torpor_prints_the_version() -> None:
    result = run("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"torpor {torpor.__version__}"


def test_events_json_prints_one_json_object_a_line(sse_server: str) -> None:
    for argv in (("--json", "events", "s_1"), ("events", "s_1", "--json")):
        result = run(*argv, "--url", sse_server)
        assert result.returncode == 0, result.stderr
        lines = result.stdout.strip().splitlines()
        assert [json.loads(line)["state"] for line in lines] == ["RUNNING", "COMPLETED"]
    plain = run("events", "s_1", "--url", sse_server)
    assert "COMPLETED" in plain.stdout and not plain.stdout.startswith("{")


def test_exit_codes_are_the_ones_the_readme_documents() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("### Exit codes", 1)[1].split("\n#", 1)[0]
    documented = {int(code) for code in re.findall(r"^\| `(\d+)` \|", section, re.M)}
    assert documented == set(cli.EXIT_CODES)


def test_unreachable_api_is_one_line_and_exit_code_3() -> None:
    result = run("status", "s_x", "--url", "http://127.0.0.1:9")
    assert result.returncode == cli.EXIT_UNREACHABLE
    assert "cannot reach torpor at http://127.0.0.1:9" in one_line_error(result)


def test_unreachable_ray_in_reconcile_is_one_line_and_exit_code_3() -> None:
    result = run("reconcile", "--address", "127.0.0.1:9")
    assert result.returncode == cli.EXIT_UNREACHABLE
    assert "cannot connect to Ray at 127.0.0.1:9" in one_line_error(result)


def test_invalid_configuration_is_one_line_and_exit_code_4(tmp_path: Path) -> None:
    result = run("console", env={"TORPOR_RUNTIME__TOOL_TIMEOUT_S": "soon"})
    assert result.returncode == cli.EXIT_CONFIG
    assert "runtime.tool_timeout_s" in one_line_error(result)
    result = run("console", env={"TORPOR_CONFIG": str(tmp_path / "missing.toml")})
    assert result.returncode == cli.EXIT_CONFIG
    assert "missing.toml" in one_line_error(result)


def test_usage_error_is_exit_code_2() -> None:
    assert run("no-such-command").returncode == cli.EXIT_USAGE


def test_an_unexpected_exception_is_one_line_and_exit_code_5(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(args: object) -> int:
        raise KeyError("boom\nsecond line")

    monkeypatch.setattr(cli, "cmd_keys", broken)
    assert cli.main(["keys", "api"]) == cli.EXIT_INTERNAL
    err = capsys.readouterr().err
    assert err.startswith("torpor: error: internal: KeyError:") and err.count("\n") == 1


def test_console_prints_the_url_and_an_operator_login_link() -> None:
    result = run(
        "console",
        env={"TORPOR_PUBLIC_URL": "https://torpor.example.com/", "TORPOR_OPERATOR_KEY": "op/k y"},
    )
    assert result.returncode == 0, result.stderr
    assert "console: https://torpor.example.com/console" in result.stdout
    # the key rides in the fragment (never sent to a server, so in no access log)
    assert "login:   https://torpor.example.com/console/login#key=op%2Fk%20y" in result.stdout
    answer = json.loads(run("--json", "console", "--url", "http://h:1").stdout)
    assert answer == {"url": "http://h:1/console", "login_url": None}


def test_serve_refuses_a_public_url_on_a_port_nothing_listens_on() -> None:
    result = run("serve", "--port", "9011", env={"TORPOR_PUBLIC_URL": "http://127.0.0.1:8000"})
    assert result.returncode == cli.EXIT_CONFIG
    line = one_line_error(result)
    assert "8000" in line and "127.0.0.1:9011" in line


def test_serve_joins_the_ray_address_of_its_environment_and_says_whose_ingress_runs() -> None:
    """With RAY_ADDRESS set, Ray joins that cluster, whose nodes chose their ingress when
    they started: serve says so (it claimed the HAProxy it found here) and fails in one
    line, at once, when nothing answers there (it tried for minutes)."""
    result = run("serve", "--port", "9012", env={"RAY_ADDRESS": "127.0.0.1:1"})
    assert result.returncode == cli.EXIT_UNREACHABLE, result.stderr
    ingress, error = result.stderr.strip().splitlines()
    assert ingress.startswith("ingress: what the Ray cluster at 127.0.0.1:1 was started with")
    assert error.startswith("torpor: error: cannot connect to Ray at 127.0.0.1:1")


def test_public_url_follows_the_listener_unless_it_names_another_host() -> None:
    assert cli.serving_url(None, "127.0.0.1", 9011) == "http://127.0.0.1:9011"
    assert cli.serving_url(None, "0.0.0.0", 8080) == "http://127.0.0.1:8080"
    assert cli.serving_url("http://localhost:8080/", "0.0.0.0", 8080) == "http://localhost:8080/"
    public = "https://torpor.example.com"  # behind a proxy: whatever port it forwards to
    assert cli.serving_url(public, "0.0.0.0", 8000) == public


@pytest.fixture
def paged_api() -> Iterator[str]:
    """Sessions and dead deliveries, two pages of each: the second after cursor ``c2``."""

    class Handler(Answering):
        def do_GET(self) -> None:
            parts = urllib.parse.urlsplit(self.path)
            cursor = urllib.parse.parse_qs(parts.query).get("cursor", [None])[0]
            if parts.path == "/v1/sessions":
                ids = ["s_3"] if cursor == "c2" else ["s_1", "s_2"]
                items: list[dict[str, object]] = [
                    {"session_id": i, "state": "RUNNING"} for i in ids
                ]
            else:
                ids = ["d_3"] if cursor == "c2" else ["d_1", "d_2"]
                items = [
                    {
                        "delivery_id": i,
                        "status": "dead",
                        "attempts": 8,
                        "last_category": "timeout",
                        "url": "https://example.com/hook",
                    }
                    for i in ids
                ]
            page = {"items": items, "next_cursor": None if cursor == "c2" else "c2"}
            body = json.dumps(page).encode()
            self.answer(200, body, "application/json")

    with served(Handler) as url:
        yield url


@pytest.mark.parametrize(("command", "last"), [("ls", "s_3"), ("deliveries", "d_3")])
def test_ls_and_deliveries_page_on_with_the_cursor_they_print(
    paged_api: str, command: str, last: str
) -> None:
    first = run(command, "--url", paged_api)
    assert first.returncode == 0, first.stderr
    assert "--cursor c2" in first.stdout  # the hint names the option that takes it on
    second = run(command, "--url", paged_api, "--cursor", "c2")
    assert second.returncode == 0, second.stderr
    assert last in second.stdout and "--cursor" not in second.stdout
    lines = run("--json", command, "--url", paged_api).stdout.splitlines()
    assert json.loads(lines[-1]) == {"next_cursor": "c2"}


@pytest.mark.parametrize("buffered", [True, False])
def test_a_reader_that_goes_away_ends_the_command_quietly(
    paged_api: str, sse_server: str, buffered: bool
) -> None:
    """``torpor ls | head``: the reader closed the pipe, which is neither an unreachable
    API nor a bug; nothing on stderr and success, as ``head`` got what it wanted."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORPOR_")}
    env.pop("PYTHONUNBUFFERED", None)
    if not buffered:
        env["PYTHONUNBUFFERED"] = "1"
    for argv in (
        ("keys", "api"),
        ("ls", "--url", paged_api),
        ("--json", "ls", "--url", paged_api),
        ("events", "s_1", "--url", sse_server),
    ):
        read, write = os.pipe()
        os.close(read)  # gone before the command writes: every write to it fails
        try:
            result = subprocess.run(
                [sys.executable, "-m", "torpor", *argv],
                stdout=write,
                stderr=subprocess.PIPE,
                text=True,
                cwd=ROOT,
                check=False,
                timeout=120,
                env=env,
            )
        finally:
            os.close(write)
        assert (result.returncode, result.stderr) == (cli.EXIT_OK, ""), argv


def test_events_refused_prints_the_problem_detail() -> None:
    """Like every other API command: the detail says why (which key, which session)."""

    class Handler(Answering):
        def do_GET(self) -> None:
            body = json.dumps(
                {
                    "type": "about:blank",
                    "title": "Not Found",
                    "status": 404,
                    "detail": "session s_gone not found",
                }
            ).encode()
            self.answer(404, body, "application/problem+json")

    with served(Handler) as url:
        result = run("events", "s_gone", "--url", url)
    assert result.returncode == cli.EXIT_FAILED
    assert "404 session s_gone not found" in one_line_error(result)


TRANSITIONS = [
    {"at": "2026-01-01T00:00:00Z", "state": "RUNNING", "epoch": 1, "reason": "start"},
    {"at": "2026-01-01T00:00:01Z", "state": "SUSPENDED", "epoch": 1, "reason": "waits"},
    {"at": "2026-01-01T00:00:02Z", "state": "COMPLETED", "epoch": 2, "reason": "done"},
]


def dropping_sse(asked: list[str | None], *, drop: str, honours: bool) -> type[Answering]:
    """An events endpoint whose first stream breaks after the first two transitions
    (``drop``: "closed", a clean end of a body without a length; "cut", a chunked body
    whose connection goes without its last chunk); a reconnect gets what follows its
    Last-Event-ID (or, ``honours`` False, everything again)."""

    class Handler(Answering):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            asked.append(self.headers.get("Last-Event-ID"))
            after = int(self.headers.get("Last-Event-ID") or 0) if honours else 0
            first = len(asked) == 1
            events = [(i, e) for i, e in enumerate(TRANSITIONS, 1) if i > after]
            if first:
                events = events[:2]
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            chunked = not (first and drop == "closed")
            if chunked:
                self.send_header("Transfer-Encoding", "chunked")
            else:
                self.send_header("Connection", "close")
            self.end_headers()
            for i, event in events:
                data = f"id: {i}\nevent: transition\ndata: {json.dumps(event)}\n\n".encode()
                self.wfile.write(
                    f"{len(data):x}\r\n".encode() + data + b"\r\n" if chunked else data
                )
            if first:
                self.close_connection = True  # gone, without the chunked body's end
            else:
                self.wfile.write(b"0\r\n\r\n")

    return Handler


@pytest.mark.parametrize("honours", [True, False], ids=["resumed", "replayed"])
@pytest.mark.parametrize("drop", ["closed", "cut"])
def test_events_reconnects_after_a_drop_with_the_last_event_id_and_shows_each_event_once(
    drop: str, honours: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    # A dropped stream ended the command: silently (a clean close, exit 0 before the
    # session ended) or as an unreachable API (a cut one), and the transitions after the
    # drop were never shown.
    from torpor import backoff

    asked: list[str | None] = []
    with served(dropping_sse(asked, drop=drop, honours=honours)) as url, backoff.fixed(0):
        code = cli.main(["--json", "events", "s_1", "--url", url])
    out, err = capsys.readouterr()
    assert code == cli.EXIT_OK, err
    assert [json.loads(line)["state"] for line in out.splitlines()] == [
        "RUNNING",
        "SUSPENDED",
        "COMPLETED",
    ]
    assert asked == [None, "2"]


def test_events_gives_up_after_a_bounded_number_of_reconnects(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from torpor import backoff

    asked: list[str | None] = []

    class Handler(Answering):
        def do_GET(self) -> None:  # a stream that closes at once, every time
            asked.append(self.headers.get("Last-Event-ID"))
            self.answer(200, b"", "text/event-stream")

    with served(Handler) as url, backoff.fixed(0):
        code = cli.main(["events", "s_1", "--url", url])
    assert code == cli.EXIT_UNREACHABLE
    assert len(asked) == cli.STREAM_RECONNECTS + 1
    assert "the event stream of s_1 closed" in capsys.readouterr().err


def test_events_gives_up_after_as_many_empty_reconnects_after_a_healthy_stream(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The bound is on reconnects: a stream that showed a transition and broke, then
    reconnects that bring nothing, gives up after ``STREAM_RECONNECTS`` of them, as after
    a first connection that brought nothing (one more was made before: the first
    connection's silence counted as one of them, a healthy one's did not)."""
    from torpor import backoff

    asked: list[str | None] = []

    class Handler(Answering):
        def do_GET(self) -> None:
            asked.append(self.headers.get("Last-Event-ID"))
            if len(asked) == 1:
                event = json.dumps(TRANSITIONS[0])
                self.answer(200, f"id: 1\ndata: {event}\n\n".encode(), "text/event-stream")
            else:
                self.answer(200, b"", "text/event-stream")

    with served(Handler) as url, backoff.fixed(0):
        code = cli.main(["events", "s_1", "--url", url])
    assert code == cli.EXIT_UNREACHABLE
    assert asked == [None] + ["1"] * cli.STREAM_RECONNECTS
    assert "RUNNING" in capsys.readouterr().out


def test_events_follows_a_long_wait_through_any_number_of_idle_streams_cut(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # A proxy that cuts idle streams: each says something (a keep-alive) before it is
    # cut, and the command goes on following past the reconnects' bound.
    from torpor import backoff

    asked: list[str | None] = []
    cuts = cli.STREAM_RECONNECTS + 3

    class Handler(Answering):
        def do_GET(self) -> None:
            asked.append(self.headers.get("Last-Event-ID"))
            if len(asked) <= cuts:
                self.answer(200, b": keep-alive\n\n", "text/event-stream")
            else:
                event = json.dumps(TRANSITIONS[2])
                self.answer(200, f"id: 3\ndata: {event}\n\n".encode(), "text/event-stream")

    with served(Handler) as url, backoff.fixed(0):
        assert cli.main(["events", "s_1", "--url", url]) == cli.EXIT_OK
    assert len(asked) == cuts + 1
    assert "COMPLETED" in capsys.readouterr().out


def test_events_stops_at_a_204_the_server_answers_once_nothing_was_missed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from torpor import backoff

    asked: list[str | None] = []

    class Handler(Answering):
        def do_GET(self) -> None:
            asked.append(self.headers.get("Last-Event-ID"))
            if len(asked) > 1:
                self.send_response(204)
                self.end_headers()
                return
            event = json.dumps(TRANSITIONS[1])
            self.answer(200, f"id: 7\ndata: {event}\n\n".encode(), "text/event-stream")

    with served(Handler) as url, backoff.fixed(0):
        assert cli.main(["events", "s_1", "--url", url]) == cli.EXIT_OK
    assert asked == [None, "7"]
    assert "SUSPENDED" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [["ls", "--limit", "0"], ["deliveries", "--limit", "-3"], ["demo", "--documents", "0"]],
    ids=["ls", "deliveries", "demo"],
)
def test_a_count_below_one_is_a_usage_error_before_anything_runs(argv: list[str]) -> None:
    """``demo --documents 0`` started Ray and Serve and failed half-way with the API's
    400 shown as an internal error; ``ls --limit 0`` went to the server."""
    result = run(*argv, "--url", "http://127.0.0.1:1") if argv[0] != "demo" else run(*argv)
    assert result.returncode == 2, result
    assert "is not 1 or more" in result.stderr and "Traceback" not in result.stderr


def test_the_demos_title_shows_no_part_of_the_index_url_that_may_be_a_secret() -> None:
    from torpor.entry.demo import _shown

    shown = _shown("redis://user:pw-in-userinfo@cache:6380/2?password=pw-in-query")
    assert shown == "redis://cache:6380/2"
    assert _shown("sqlite:///tmp/state/index.db") == "sqlite:///tmp/state/index.db"


def test_the_demos_ports_are_outside_the_ranges_ray_binds_from() -> None:
    """The kernel's ephemeral ports (Ray's processes bind them as they start, after the
    demo chose its port: one took it, and Serve's proxy could not bind it) and Ray's
    worker ports are both left alone."""
    from torpor.entry.ports import quiet_port

    ports = {quiet_port(random.Random(seed)) for seed in range(50)}
    assert all(20000 <= port < 32768 for port in ports) and len(ports) > 40


def test_a_port_handed_out_is_not_handed_out_again_before_it_is_bound() -> None:
    """Chosen, a port stays free until its server binds it: a second call in between (two
    servers started together) was given the same one. The same draws twice here."""
    from torpor.entry.ports import quiet_port

    assert quiet_port(random.Random(12345)) != quiet_port(random.Random(12345))
