"""A Serve replica that goes away frees what it started: on a real local Ray and Serve,
the app is deleted (as a redeploy or a scale-down retires a replica) and the standby
session actors its activator kept, which are detached processes, go with it rather than
after their idle time.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest
import ray
from ray import serve
from ray.util import list_named_actors

from actors.standby import STANDBY_PREFIX
from serve_app import application
from tests.conftest import eventually
from tests.ingress.conftest import start_ray
from tests.support.s3_server import free_port
from torpor.settings import Settings

pytestmark = pytest.mark.ray

STANDBYS = 2


@pytest.fixture(scope="module")
def settings(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Settings]:
    tmp = tmp_path_factory.mktemp("replica-shutdown")
    start_ray()  # before the port is chosen: Ray's processes bind ports as they start
    serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
    yield Settings.build(
        {
            "storage": {
                "object_store_url": f"file://{tmp / 'objects'}",
                "index_url": redis_url,
                "redis_prefix": f"tprs:{secrets.token_hex(4)}:",
            },
            "namespace": "rs" + secrets.token_hex(4),
            # Far longer than the test: only the replica's shutdown can free them.
            "runtime": {"standby_session_actors": STANDBYS, "standby_idle_s": 3600.0},
        }
    )
    serve.shutdown()
    ray.shutdown()


def standbys(namespace: str) -> list[str]:
    return [
        a["name"]
        for a in list_named_actors(all_namespaces=True)
        if a["namespace"] == namespace and a["name"].startswith(STANDBY_PREFIX)
    ]


async def test_a_deleted_replica_frees_the_standbys_it_kept(settings: Settings) -> None:
    serve.run(application(settings, start_reconciler=False), name="torpor", route_prefix="/")
    namespace = settings.namespace
    # Started when the replica was made, before any activation.
    await eventually(
        lambda: len(standbys(namespace)) == STANDBYS,
        timeout_s=120,
        what="the replica's standby set is filled",
    )
    serve.delete("torpor")  # the replica's graceful shutdown
    await eventually(lambda: standbys(namespace) == [], timeout_s=60, what="its standbys are gone")
