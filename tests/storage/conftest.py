"""Fixtures of the storage tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    """A redis-py client of the test Redis (text replies), closed after the test."""
    made = aioredis.Redis.from_url(redis_url, decode_responses=True)
    yield made
    await made.aclose()
