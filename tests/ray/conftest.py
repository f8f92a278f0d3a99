"""One local Ray per test module, real Redis and the S3 test server for storage."""

from __future__ import annotations

import os
import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from actors.ray_activator import RayActivator
from actors.wiring import open_services
from tests.conftest import make_bucket
from tests.support.harness import CAPABILITY_KEY, Env
from tests.support.s3_server import S3TestServer
from tests.support.tools import World, agent_config
from torpor.clock import SystemClock
from torpor.service.sessions import SessionService
from torpor.service.sweeper import Sweeper
from torpor.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    ray.init(
        address="local",  # never a cluster someone else started on this machine
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}},
    )
    yield
    ray.shutdown()


def ray_settings(s3_server: S3TestServer, redis_url: str, prefix: str, **approval: Any) -> Settings:
    bucket = "ray-" + secrets.token_hex(4)
    make_bucket(s3_server, bucket)
    kw = s3_server.boto_kwargs()
    return Settings.build(
        {
            "storage": {
                "object_store_url": f"s3://{bucket}/t",
                "s3": {
                    "endpoint_url": kw["endpoint_url"],
                    "region": kw["region"],
                    "access_key_id": kw["access_key_id"],
                    "secret_access_key": kw["secret_access_key"],
                },
                "index_url": redis_url,
                "redis_prefix": prefix,
            },
            "namespace": "t" + secrets.token_hex(4),
            "agents": agent_config(redis_url, prefix, **approval),
            "security": {"capability_keys": [CAPABILITY_KEY], "inline_secrets_in_ray": True},
            "lease": {"heartbeat_s": 0.5, "ttl_s": 2.0},
            "reconciler": {
                "wake_grace_s": 2.0,
                "poll_backoff_base_s": 0.5,
                "poll_backoff_cap_s": 2.0,
                "interval_s": 0.5,
            },
            "pool": {"size": 2},
        }
    )


class RayEnv(Env):
    sweeper: Sweeper
    settings: Settings


@pytest.fixture
def make_ray_env(
    ray_cluster: None, s3_server: S3TestServer, redis_url: str, redis_prefix: str
) -> Any:
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def make(**approval: Any) -> AsyncIterator[RayEnv]:
        settings = ray_settings(s3_server, redis_url, redis_prefix, **approval)
        services = open_services(settings, clock=SystemClock())
        control = SessionService(services, RayActivator(services))
        world = World(redis_url, redis_prefix)
        env = RayEnv(services, control, world, SystemClock())  # type: ignore[arg-type]
        env.sweeper = Sweeper(control)
        env.settings = settings
        try:
            yield env
        finally:
            await world.close()
            await services.close()

    return make


def session_actors(namespace: str) -> list[str]:
    from ray.util import list_named_actors

    return [
        a["name"]
        for a in list_named_actors(all_namespaces=True)
        if a["namespace"] == namespace and a["name"].startswith("session:")
    ]


os.environ.setdefault("RAY_DEDUP_LOGS", "0")
