"""A request's headers, read once: by lower-case name, and which names came twice.

The verifier, the CloudEvents parser and the trace all read a webhook's headers by name,
whatever their case. Each used to make its own pass over them (Starlette's ``Headers``
decodes every raw header again at each ``items()``): five passes a webhook. The gateway
makes this view once and hands it to each (``bench/profile_gateway.py --instructions``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping


class RequestHeaders(Mapping[str, str]):
    """Headers by stripped lower-case name, values stripped; the last of two spellings
    of one name wins. A reader refuses a name sent twice with two values rather than
    pick one (the verifier and a later parser could otherwise read different things):
    ``conflicts`` names those whose spellings' values differ at all, as the verifier
    has always compared them, ``differing`` those whose values differ once stripped, as
    the CloudEvents parser has (a subset)."""

    __slots__ = ("by_name", "conflicts", "differing")

    def __init__(self, raw: Mapping[str, str]) -> None:
        values: dict[str, str] = {}
        sent: dict[str, str] = {}  # as sent, for ``conflicts``
        conflicts: set[str] = set()
        differing: dict[str, None] = {}  # in the request's order: the first decides
        for name, value in raw.items():
            key = name.strip().lower()
            if sent.get(key, value) != value:
                conflicts.add(key)
                if values[key] != value.strip():
                    differing[key] = None
            sent[key] = value
            values[key] = value.strip()
        self.by_name: Mapping[str, str] = values
        self.conflicts, self.differing = conflicts, differing

    @classmethod
    def of(cls, headers: Mapping[str, str]) -> RequestHeaders:
        """``headers`` read, unless they were already."""
        return headers if isinstance(headers, RequestHeaders) else cls(headers)

    def only(self, names: Iterable[str]) -> dict[str, str]:
        """The headers of these (lower-case) names that came."""
        values = self.by_name
        return {name: values[name] for name in names if name in values}

    def __getitem__(self, name: str) -> str:
        return self.by_name[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.by_name)

    def __len__(self) -> int:
        return len(self.by_name)
