"""`torpor serve` and the demo switch Serve's HAProxy ingress on when HAProxy is there."""

from __future__ import annotations

from pathlib import Path

import pytest

from torpor.entry.ingress import (
    BINARY,
    FLAG,
    HOOKS_FIRST,
    SERVER_MIDDLEWARES,
    USER_LOOP,
    choose_ingress,
    restore,
)


def test_haproxy_is_switched_on_when_installed(tmp_path: Path) -> None:
    binary = tmp_path / "haproxy"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    env = {BINARY: str(binary)}
    ingress = choose_ingress(env)
    assert ingress.haproxy and env[FLAG] == "1" and str(binary) in ingress.message
    assert ingress.label == "HAProxy ingress"
    # The replicas' own servers take webhooks before Serve's wrappers (torpor.entry.hooks).
    assert env[SERVER_MIDDLEWARES] == HOOKS_FIRST


def test_the_server_middleware_is_named_only_for_haproxy_and_never_over_the_operators(
    tmp_path: Path,
) -> None:
    without = {BINARY: str(tmp_path / "missing")}
    choose_ingress(without, which=lambda _: None)
    assert SERVER_MIDDLEWARES not in without
    theirs = {FLAG: "1", SERVER_MIDDLEWARES: "their.module:middlewares"}
    assert choose_ingress(theirs).haproxy
    assert theirs[SERVER_MIDDLEWARES] == "their.module:middlewares"
    chosen = {FLAG: "1"}  # HAProxy switched on by the operator: torpor's middleware still
    assert choose_ingress(chosen).haproxy and chosen[SERVER_MIDDLEWARES] == HOOKS_FIRST
    # The app on a thread of its own (the operator's choice): the server's loop is not
    # the services', so webhooks stay Serve's way and the middleware is not named.
    threaded = {FLAG: "1", USER_LOOP: "1"}
    assert choose_ingress(threaded).haproxy and SERVER_MIDDLEWARES not in threaded


def test_the_named_middleware_is_torpors_server_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """What Serve imports from the name: a list of Starlette middlewares, as its check
    of the callback's answer wants, whose one entry is the server's fast path."""
    from ray.serve._private.http_util import validate_http_proxy_callback_return
    from ray.serve._private.utils import call_function_from_import_path

    from torpor.entry import hooks
    from torpor.entry.hooks import HookRoute, ServerHookFastPath

    monkeypatch.setattr(hooks, "ROUTE", HookRoute())  # not the process's own, marked below

    (middleware,) = validate_http_proxy_callback_return(call_function_from_import_path(HOOKS_FIRST))
    made = middleware.cls(None, *middleware.args, **middleware.kwargs)
    # No route of its own: the process's ROUTE, which the replica's constructor binds.
    assert isinstance(made, ServerHookFastPath) and made.route is None
    assert hooks.ROUTE.before_serve  # what /healthz reports: Serve made it in this process


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
    assert env[FLAG] == "1" and env[USER_LOOP] == "0" and env[SERVER_MIDDLEWARES] == HOOKS_FIRST
    restore(ingress, env)
    assert env == before
