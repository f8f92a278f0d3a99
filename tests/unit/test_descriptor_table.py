"""A torpor process grows its file descriptor table once, at start-up: the table's
doubling waits for an RCU grace period in a process with threads (14-15 ms here), and
it used to happen inside a webhook (``actors.descriptors``)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from actors import wiring
from torpor.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def run(code: str) -> dict[str, object]:
    """``code`` in a new Python process (a table of its own, as small as a new
    process's), with threads running as in a replica; its last line printed is JSON."""
    script = textwrap.dedent(
        """
        import json, os, resource, sys, threading
        sys.path.insert(0, {root!r})
        from actors.descriptors import reserve_descriptors, table_size
        stop = threading.Event()
        for _ in range(4):
            threading.Thread(target=stop.wait, daemon=True).start()
        """
    ).format(root=str(ROOT)) + textwrap.dedent(code)
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_after_the_reserve_opening_hundreds_of_files_never_grows_the_table() -> None:
    found = run(
        """
        before = table_size()
        after = reserve_descriptors()
        fds = [os.open("/dev/null", os.O_RDONLY) for _ in range(600)]
        print(json.dumps({"before": before, "after": after, "opened": table_size()}))
        """
    )
    assert found["before"] is not None and found["before"] < 1024  # type: ignore[operator]
    assert found["after"] == found["opened"]  # no growth while files were opened
    assert found["after"] >= 4096  # type: ignore[operator]


def test_the_reserve_stays_under_the_open_files_limit() -> None:
    found = run(
        """
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (300, hard))
        print(json.dumps({"size": reserve_descriptors()}))
        """
    )
    # Grown as far as the limit lets it (a slot for descriptor 299), and no further.
    assert found["size"] is not None and 300 <= found["size"] <= 512  # type: ignore[operator]


def test_the_reserve_never_closes_a_descriptor_held_high_in_the_table() -> None:
    found = run(
        """
        import actors.descriptors as descriptors
        held = os.open("/dev/null", os.O_RDONLY)
        os.dup2(held, 4095)  # another thread's file, where the reserve reaches
        descriptors.table_size = lambda: None  # as where the kernel does not say: it acts
        reserve_descriptors()
        os.fstat(4095)  # still open: raises if the reserve closed it
        print(json.dumps({"size": table_size()}))
        """
    )
    assert found["size"] >= 4096  # type: ignore[operator]


def test_every_process_that_opens_its_services_reserves_its_table(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls: list[int] = []
    monkeypatch.setattr(wiring, "reserve_descriptors", lambda: calls.append(1))
    settings = Settings.build(
        {"storage": {"object_store_url": "memory://", "index_url": "memory://"}}
    )
    wiring.open_services(settings)
    assert calls == [1]
