"""Which failures pass by themselves: worth a retry with backoff, never a verdict.

A plugin (an agent, a tool) talks to the world through whatever client it likes, and
lets that client's errors out. Torpor's own answer to those is typed (``TorporError``,
retryable or not); the rest is read here. Trouble of the network or the machine is
transient: an ``OSError`` (refused, reset, unreachable), a ``TimeoutError``, or one of
the transport errors of the clients plugins use most, which derive from neither. They
are named, not imported: the domain layer depends on none of those clients. An error
raised ``from`` such trouble is transient too (a plugin's own wrapper of it).
"""

from __future__ import annotations

# ``module.QualName`` of a class in the error's MRO. The public classes of httpx and
# openai report their package as their module; the others, their defining module.
TRANSPORT_ERRORS = frozenset(
    {
        "httpx.TransportError",  # connect, read, write, pool, protocol errors; timeouts
        "openai.APIConnectionError",  # APITimeoutError derives from it
        "redis.exceptions.ConnectionError",
        "redis.exceptions.TimeoutError",
        "botocore.exceptions.ConnectionError",  # endpoint unreachable, connect timeout
        "botocore.exceptions.HTTPClientError",  # read timeout, connection closed
        "aiohttp.client_exceptions.ClientConnectionError",
    }
)


def transient(exc: BaseException) -> bool:
    """Whether ``exc``, or an error it was raised from, is trouble that passes by itself."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, OSError | TimeoutError) or _named(type(cause)):
            return True
        seen.add(id(cause))
        cause = cause.__cause__
    return False


def _named(cls: type[BaseException]) -> bool:
    return any(f"{c.__module__}.{c.__qualname__}" in TRANSPORT_ERRORS for c in cls.__mro__)
