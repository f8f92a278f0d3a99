"""A running Serve app on a local Ray, one per test module, reached over real HTTP."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
import redis
from ray import serve

from actors.wiring import open_services
from serve_app import application
from tests.conftest import make_bucket
from tests.runtime.approval_tools import approval_agent
from tests.support.harness import CAPABILITY_KEY, NOTIFY_KEY
from tests.support.s3_server import S3TestServer, free_port
from tests.support.tools import World, agent_config
from torpor.auth import new_api_key
from torpor.entry.ingress import USER_LOOP
from torpor.ports.services import Services
from torpor.settings import Settings
from torpor.webhooks.signing import Scheme, generate_secret

ROOT = Path(__file__).resolve().parents[2]
MAPPING = {
    "event_id_path": "eventId",
    "type_path": "eventType",
    "correlation_id_path": "correlationId",
    "business_key_path": "businessKey",
    "status_path": "decision.status",
    "data_path": "decision",
}


@dataclass
class Deployment:
    url: str
    settings: Settings
    secrets: dict[str, list[str]]
    keys: dict[str, str]  # tenant → bearer API key
    redis_url: str
    prefix: str
    operator_key: str = ""  # security.operator_keys holds its hash

    def auth(self, tenant: str = "acme") -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[tenant]}"}


def start_ray() -> None:
    """A local Ray of the test module's own."""
    ray.init(
        address="local",  # never a cluster someone else started on this machine
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        # The replicas run the app on their own loop, as under `torpor serve`.
        runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), USER_LOOP: "0"}},
    )


@pytest.fixture(scope="module")
def deployment(s3_server: S3TestServer, redis_url: str) -> Iterator[Deployment]:
    # Ray first, the port after: Ray's own processes bind ports as they start, and one
    # took the port chosen before them (Serve's proxy then failed to bind it, and every
    # test of the module erred in its setup).
    start_ray()
    prefix = f"tpin:{secrets.token_hex(4)}:"
    bucket = "in-" + secrets.token_hex(4)
    make_bucket(s3_server, bucket)
    kw = s3_server.boto_kwargs()
    source_secrets = {
        "oa": [generate_secret(Scheme.TORPOR), generate_secret(Scheme.TORPOR)],
        "std": [generate_secret(Scheme.STANDARD)],
        "gh": [generate_secret(Scheme.GITHUB)],
        "stripe": [generate_secret(Scheme.STRIPE)],
        "ce": [generate_secret(Scheme.STANDARD)],
        "beta-erp": [generate_secret(Scheme.TORPOR)],
    }
    acme_key, acme_hash = new_api_key()
    beta_key, beta_hash = new_api_key()
    operator_key, operator_hash = new_api_key()
    port = free_port()
    settings = Settings.build(
        {
            "storage": {
                "object_store_url": f"s3://{bucket}/in",
                "s3": {
                    "endpoint_url": kw["endpoint_url"],
                    "region": kw["region"],
                    "access_key_id": kw["access_key_id"],
                    "secret_access_key": kw["secret_access_key"],
                },
                "index_url": redis_url,
                "redis_prefix": prefix,
            },
            "namespace": "in" + secrets.token_hex(4),
            "agents": {
                **agent_config(redis_url, prefix, placement="pooled"),
                # An ApprovalTool asking "fd", answered through the "oa" source.
                "approval": {
                    **approval_agent(stages=[{"approvers": ["fd"]}]),
                    "placement": "pooled",
                },
            },
            "security": {
                "capability_keys": [CAPABILITY_KEY],
                "inline_secrets_in_ray": True,
                "operator_keys": [operator_hash],
            },
            "notifications": {"key": NOTIFY_KEY, "allow_private_callbacks": True},
            "public_url": f"http://127.0.0.1:{port}",
            "tenants": {"acme": {"api_keys": [acme_hash]}, "beta": {"api_keys": [beta_hash]}},
            "sources": {
                "oa": {
                    "tenant": "acme",
                    "scheme": "torpor",
                    "secrets": source_secrets["oa"],
                    "mapping": MAPPING,
                },
                "std": {
                    "tenant": "acme",
                    "scheme": "standard",
                    "secrets": source_secrets["std"],
                    "mapping": MAPPING,
                },
                "gh": {
                    "tenant": "acme",
                    "scheme": "github",
                    "secrets": source_secrets["gh"],
                    "mapping": MAPPING,
                },
                "stripe": {
                    "tenant": "acme",
                    "scheme": "stripe",
                    "secrets": source_secrets["stripe"],
                    "mapping": MAPPING,
                },
                "ce": {
                    "tenant": "acme",
                    "scheme": "standard",
                    "secrets": source_secrets["ce"],
                    "allowed_origins": ["erp.example.com"],
                    "allowed_rate": 120,
                    "max_body_bytes": 4096,
                },
                "beta-erp": {
                    "tenant": "beta",
                    "scheme": "torpor",
                    "secrets": source_secrets["beta-erp"],
                    "mapping": MAPPING,
                },
            },
            "lease": {"heartbeat_s": 0.5, "ttl_s": 3.0},
            "reconciler": {"wake_grace_s": 2.0},
            "pool": {"size": 2},
        }
    )
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(application(settings, start_reconciler=False), name="torpor", route_prefix="/")
    yield Deployment(
        f"http://127.0.0.1:{port}",
        settings,
        source_secrets,
        {"acme": acme_key, "beta": beta_key},
        redis_url,
        prefix,
        operator_key,
    )
    serve.shutdown()
    ray.shutdown()
    client = redis.Redis.from_url(redis_url)
    for key in client.scan_iter(match=prefix + "*", count=1000):
        client.delete(key)
    client.close()


@pytest.fixture
async def http(deployment: Deployment) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=deployment.url, timeout=30) as client:
        yield client


@pytest.fixture
async def services(deployment: Deployment) -> AsyncIterator[Services]:
    svc = open_services(deployment.settings)
    yield svc
    await svc.close()


@pytest.fixture
async def world(deployment: Deployment) -> AsyncIterator[World]:
    w = World(deployment.redis_url, deployment.prefix)
    yield w
    await w.close()


def unique(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(3)}"


Json = dict[str, Any]
