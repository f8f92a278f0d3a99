"""Fault-injection fixtures: a fault proxy in front of the S3 test server."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from storage.s3_store import S3ObjectStore
from tests.support.fault_proxy import FaultProxy
from tests.support.s3_server import S3TestServer


@pytest.fixture
def s3_proxy(s3_server: S3TestServer, s3_bucket: str) -> Iterator[FaultProxy]:
    proxy = FaultProxy(s3_server.endpoint).start()
    yield proxy
    proxy.stop()


@pytest.fixture
async def faulty_s3(
    s3_server: S3TestServer, s3_proxy: FaultProxy, s3_bucket: str
) -> AsyncIterator[S3ObjectStore]:
    kwargs = {**s3_server.boto_kwargs(), "endpoint_url": s3_proxy.endpoint}
    store = S3ObjectStore(s3_bucket, "f", **kwargs)
    yield store
    await store.close()
