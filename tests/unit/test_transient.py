"""Which errors a plugin lets out pass by themselves (``torpor.transient``)."""

from __future__ import annotations

import aiohttp
import botocore.exceptions
import httpx
import pytest
import redis.exceptions

from torpor.errors import ToolError
from torpor.transient import transient


@pytest.mark.parametrize(
    "exc",
    [
        ConnectionRefusedError(111, "Connection refused"),
        TimeoutError(),
        httpx.ConnectError("refused"),
        httpx.ReadTimeout("slow"),
        redis.exceptions.ConnectionError("refused"),
        redis.exceptions.TimeoutError("slow"),
        botocore.exceptions.EndpointConnectionError(endpoint_url="http://s3.internal"),
        botocore.exceptions.ReadTimeoutError(endpoint_url="http://s3.internal"),
        aiohttp.ClientConnectionError("reset"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_the_network_and_the_clients_transport_errors_are_transient(exc: BaseException) -> None:
    assert transient(exc)


@pytest.mark.parametrize(
    "exc",
    [
        ValueError("bad"),
        KeyError("doc_id"),
        httpx.HTTPStatusError(
            "422", request=httpx.Request("POST", "http://x"), response=httpx.Response(422)
        ),
        redis.exceptions.ResponseError("WRONGTYPE"),
        ToolError("refused", retryable=False),
    ],
    ids=lambda e: type(e).__name__,
)
def test_a_bug_or_an_answer_is_not(exc: BaseException) -> None:
    assert not transient(exc)


def test_an_error_raised_from_transient_trouble_is_transient() -> None:
    try:
        try:
            raise httpx.ConnectError("refused")
        except httpx.ConnectError as cause:
            raise RuntimeError("the ERP client gave up") from cause
    except RuntimeError as exc:
        assert transient(exc)
