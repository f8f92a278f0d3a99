"""`torpor serve` and the demo switch Serve's HAProxy ingress on when HAProxy is there."""

from __future__ import annotations

from pathlib import Path

from torpor.entry.ingress import BINARY, FLAG, USER_LOOP, choose_ingress, restore


def test_haproxy_is_switched_on_when_installed(tmp_path: Path) -> None:
    binary = tmp_path / "haproxy"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    env = {BINARY: str(binary)}
    ingress = choose_ingress(env)
    assert ingress.haproxy and env[FLAG] == "1" and str(binary) in ingress.message
    assert ingress.label == "HAProxy ingress"


def test_without_haproxy_the_default_proxy_is_said_plainly(tmp_path: Path) -> None:
    env = {BINARY: str(tmp_path / "missing")}
    ingress = choose_ingress(env, which=lambda _: None)
    assert not ingress.haproxy and FLAG not in env
    assert "HAProxy is not installed" in ingress.message
    assert ingress.label == "default proxy (HAProxy not installed)"


def test_the_operators_choice_wins(tmp_path: Path) -> None:
    env = {FLAG: "0", USER_LOOP: "1"}
    ingress = choose_ingress(env)
    assert not ingress.haproxy and env == {FLAG: "0", USER_LOOP: "1"}
    assert "set by the operator" in ingress.message
    # The demo's title says why too: not "not installed" when it is, but switched off.
    assert ingress.label == f"default proxy ({FLAG}=0 set by the operator)"


def test_replicas_run_the_app_on_their_own_loop(tmp_path: Path) -> None:
    """One event loop per replica: Serve's default second loop costs every request two
    thread hops (measured in the module's docstring)."""
    env = {BINARY: str(tmp_path / "missing")}
    choose_ingress(env, which=lambda _: None)
    assert env[USER_LOOP] == "0"


def test_a_demo_run_leaves_the_environment_as_it_was(tmp_path: Path) -> None:
    binary = tmp_path / "haproxy"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    env = {BINARY: str(binary)}
    before = dict(env)
    ingress = choose_ingress(env)
    assert env[FLAG] == "1" and env[USER_LOOP] == "0"
    restore(ingress, env)
    assert env == before
