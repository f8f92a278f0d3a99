"""The commands that run torpor or reach its Ray cluster (``torpor.cli``): ``demo``,
``serve`` (and the ``public_url`` it serves under) and ``reconcile``; Ray joined, or
refused in one line when it does not answer."""

from __future__ import annotations

import argparse
import os
import sys
import urllib.parse
from typing import Any

from torpor.cli_errors import EXIT_CONFIG, CliError, Unreachable
from torpor.cli_io import _out, _print, _settings

RAY_PROBE_TIMEOUT_S = 5.0
# A sweep takes seconds; a full repair of a large deployment (hourly) can take minutes.
RECONCILE_TIMEOUT_S = 120.0


def _probe(address: str) -> None:
    """Fail fast, in one line, when a ``host:port`` Ray address does not answer: Ray
    itself retries for minutes and logs each attempt."""
    import socket

    host, sep, port = address.rpartition(":")
    if not sep or "://" in address or not port.isdigit():
        return  # "auto", "local", ray://…: Ray resolves those itself
    try:
        socket.create_connection((host, int(port)), timeout=RAY_PROBE_TIMEOUT_S).close()
    except OSError as exc:
        raise Unreachable(f"cannot connect to Ray at {address}: {exc}") from None


def _ray_init(**kwargs: Any) -> None:
    from actors.driver import init_driver

    if kwargs.get("address"):
        _probe(kwargs["address"])
    try:
        init_driver(**kwargs)  # a container's stop (SIGTERM) exits, not aborts
    except (ConnectionError, TimeoutError) as exc:
        where = kwargs.get("address") or "a local Ray"
        raise Unreachable(f"cannot connect to Ray at {where}: {exc}") from None


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


LOOPBACK = {"127.0.0.1", "localhost", "::1", "[::1]"}
ANY_ADDRESS = {"0.0.0.0", "::", ""}  # noqa: S104 - compared with --host, never bound here


def serving_url(public_url: str | None, host: str, port: int) -> str:
    """The ``public_url`` capability links and senders use, for a server listening on
    ``host:port``: unset, it follows the listener; set to this machine, it must name the
    port that listens (links to a port nothing listens on were the classic first-run trap)."""
    if public_url is None:
        shown = "127.0.0.1" if host in ANY_ADDRESS else host
        return f"http://{shown}:{port}"
    parts = urllib.parse.urlsplit(public_url)
    local = (parts.hostname or "") in LOOPBACK or parts.hostname == host
    default_port = 443 if parts.scheme == "https" else 80
    if local and (parts.port or default_port) != port:
        raise CliError(
            f"public_url {public_url} points at port {parts.port or default_port} of this "
            f"machine, but torpor serve listens on {host}:{port}: unset public_url, set it "
            f"to http://{host}:{port}, or pass --port {parts.port or default_port}",
            EXIT_CONFIG,
        )
    return public_url


def cmd_serve(args: argparse.Namespace) -> int:
    from torpor.entry.ingress import choose_ingress

    settings = _settings()
    explicit = "public_url" in settings.model_fields_set
    # A configuration error is the one line the user sees, before anything starts.
    public_url = serving_url(settings.public_url if explicit else None, args.host, args.port)
    # Ray joins RAY_ADDRESS when no address is given; with neither, a Ray of its own
    # ("local": never a cluster someone left running on this machine), which inherits this
    # environment and so the ingress chosen here. A cluster has its own.
    address = args.address or os.environ.get("RAY_ADDRESS") or "local"
    if address == "local":
        print(choose_ingress().message, file=sys.stderr, flush=True)
    else:
        print(
            f"ingress: what the Ray cluster at {address} was started with "
            "(RAY_SERVE_ENABLE_HA_PROXY=1 on its nodes for HAProxy)",
            file=sys.stderr,
            flush=True,
        )
    if not explicit:
        # Replicas and actors read their settings themselves: tell them too.
        os.environ["TORPOR_PUBLIC_URL"] = public_url
        settings = settings.model_copy(update={"public_url": public_url})
    _out(f"torpor: serving on http://{args.host}:{args.port}, public_url {public_url}")
    from ray import serve

    from actors.config_ref import ConfigRef
    from serve_app import application

    _ray_init(address=address, namespace=settings.namespace)
    serve.start(http_options={"host": args.host, "port": args.port})
    config = ConfigRef.of_loaded(settings)  # replicas read secrets themselves
    serve.run(application(config), name="torpor", route_prefix="/", blocking=True)
    return 0


def cmd_reconcile(args: argparse.Namespace) -> int:
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    from actors.reconciler import NAME

    settings = _settings()
    namespace = settings.namespace
    _ray_init(address=args.address or "auto", namespace=namespace, log_to_driver=False)
    try:
        # Looked up, never made: made here, a detached reconciler started on this shell's
        # configuration and swept on after the command, wherever that pointed.
        handle = ray.get_actor(NAME, namespace=namespace)  # Ray's own deadline bounds it
    except ValueError:
        raise Unreachable(
            f"no reconciler runs in namespace {namespace!r} (torpor serve starts one)"
        ) from None
    except GetTimeoutError as exc:
        raise Unreachable(f"cannot look up the reconciler: {exc}") from None
    try:
        # A reconciler that is stuck, or being restarted (Ray retries the call until it is
        # back), held the command for ever.
        report: Any = ray.get(handle.sweep_once.remote(), timeout=args.timeout_s)
    except GetTimeoutError:
        raise Unreachable(
            f"the reconciler did not answer within {args.timeout_s:g} s (stuck, or being "
            "restarted); its sweep may still run (a long one needs a larger --timeout-s)"
        ) from None
    except RayActorError as exc:
        raise Unreachable(f"the reconciler died during the sweep: {exc}") from None
    _print(report, args)
    return 0
