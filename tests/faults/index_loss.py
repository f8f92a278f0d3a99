"""Index loss for fault tests: delete every index key of a test's prefix (a flush).

Only the test's own prefix is deleted (the Redis server is shared), and the simulated
external world (``{prefix}world:``) is kept: it stands for other systems, not the index.
"""

from __future__ import annotations

import redis.asyncio as aioredis


async def flush_index(redis_url: str, prefix: str) -> int:
    """Delete the index's keys under ``prefix``; returns how many were deleted."""
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    try:
        doomed = [
            k
            async for k in client.scan_iter(match=prefix + "*", count=1000)
            if not k.startswith(prefix + "world:")
        ]
        if doomed:
            await client.delete(*doomed)
        return len(doomed)
    finally:
        await client.aclose()
