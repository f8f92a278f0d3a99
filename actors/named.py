"""The names of a namespace's live named actors, by prefix.

Sessions (``session:<id>``) and standbys (``session-standby:<holder>:<hex>``) are found by
their names: the activator counts its live sessions, a restarted holder finds the
standbys its predecessor left. Both ask the GCS once for every named actor it knows and
filter here: ``list_named_actors`` has no namespace-and-prefix query of its own.
"""

from __future__ import annotations

import ray


def named_actors(namespace: str, prefix: str) -> list[str]:
    """The names in ``namespace`` that start with ``prefix``. One GCS call: on the
    caller's thread (no Ray call from a loop's worker thread)."""
    named: list[dict[str, str]] = ray.util.list_named_actors(all_namespaces=True)
    return [
        actor["name"]
        for actor in named
        if actor.get("namespace") == namespace and actor["name"].startswith(prefix)
    ]
