"""One session per Idempotency-Key, whatever happens between the claim and the answer.

The submitting process is killed -9 right after its claim, or right after it created the
session; or the object store commits the snapshot but its answer is lost on every try.
The client's retry of the same request must answer with the one session the claim names.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from storage.s3_store import S3ObjectStore
from storage.snapshots import ObjectSnapshots
from tests.faults.index_loss import flush_index
from tests.support.crash import run_killed_at
from tests.support.fault_proxy import FaultProxy, path_contains
from tests.support.harness import Env, local_env
from torpor.errors import IdempotencyInProgress, IdempotencyMismatch, StorageUnavailable
from torpor.service.sessions import IDEMPOTENCY_TTL, SUBMIT_CLAIM_GRACE, SessionService
from torpor.service.sweeper import Sweeper

pytestmark = pytest.mark.redis

KEY = "order-7"
REQUEST = {"tenant": "acme", "agent": "purchase", "input": {"doc": "PR-1", "amount": 100.0}}

SUBMIT_IN_CHILD = """
import asyncio, sys
from pathlib import Path
from tests.support.harness import local_env

async def main() -> None:
    async with local_env(Path(sys.argv[1]), sys.argv[2], sys.argv[3]) as env:
        await env.control.submit(
            tenant="acme", agent="purchase", input={"doc": "PR-1", "amount": 100.0},
            idempotency_key=sys.argv[4],
        )

asyncio.run(main())
"""


async def session_ids(env: Env) -> list[str]:
    page = await env.services.store.list("snapshots/")
    return [key.rpartition("/")[2] for key in page.keys]


async def test_a_retry_after_a_crash_past_create_answers_with_that_session(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    run_killed_at(
        "submit.after_create", SUBMIT_IN_CHILD, str(tmp_path), redis_url, redis_prefix, KEY
    )
    async with local_env(tmp_path, redis_url, redis_prefix) as env:
        [orphan] = await session_ids(env)
        retried = await env.control.submit(**REQUEST, idempotency_key=KEY)  # type: ignore[arg-type]
        assert (retried.session_id, retried.created) == (orphan, False)
        assert await session_ids(env) == [orphan]
        # The retry finished what the dead request started: the session ran.
        assert (await env.load(orphan)).state.value != "pending"
        again = await env.control.submit(**REQUEST, idempotency_key=KEY)  # type: ignore[arg-type]
        assert again.session_id == orphan


async def test_a_claim_whose_request_died_before_create_is_taken_over_after_a_grace(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    run_killed_at(
        "submit.after_claim", SUBMIT_IN_CHILD, str(tmp_path), redis_url, redis_prefix, KEY
    )
    async with local_env(tmp_path, redis_url, redis_prefix) as env:
        assert await session_ids(env) == []
        with pytest.raises(IdempotencyInProgress):  # the first request may still be alive
            await env.control.submit(**REQUEST, idempotency_key=KEY)  # type: ignore[arg-type]
        env.clock.advance(SUBMIT_CLAIM_GRACE.total_seconds() + 1)
        taken = await env.control.submit(**REQUEST, idempotency_key=KEY)  # type: ignore[arg-type]
        assert taken.created
        assert await session_ids(env) == [taken.session_id]
        again = await env.control.submit(**REQUEST, idempotency_key=KEY)  # type: ignore[arg-type]
        assert (again.session_id, again.created) == (taken.session_id, False)


@pytest.mark.s3
async def test_a_create_that_landed_but_failed_is_not_made_twice(
    tmp_path: Path,
    redis_url: str,
    redis_prefix: str,
    faulty_s3: S3ObjectStore,
    s3_proxy: FaultProxy,
) -> None:
    async with local_env(tmp_path, redis_url, redis_prefix) as base:
        services = dataclasses.replace(
            base.services, store=faulty_s3, snapshots=ObjectSnapshots(faulty_s3)
        )
        env = dataclasses.replace(base, services=services)
        env.control = SessionService(services, base.control.activator)
        # Every try of the snapshot's PUT commits upstream and loses its answer.
        s3_proxy.reset_after_commit(times=1000, match=path_contains("snapshots/", "PUT"))
        with pytest.raises(StorageUnavailable):
            await env.control.submit(**REQUEST, idempotency_key=KEY)  # type: ignore[arg-type]
        assert s3_proxy.stats.reset >= 1
        s3_proxy.clear()
        [landed] = await session_ids(env)
        retried = await env.control.submit(**REQUEST, idempotency_key=KEY)  # type: ignore[arg-type]
        assert retried.session_id == landed
        assert await session_ids(env) == [landed]


async def test_a_retry_after_the_index_was_lost_answers_with_the_session_the_key_made(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    """The index's claim is gone with the index: the key's durable record still names the
    session, so the retry neither makes a second one nor runs the work twice."""
    async with local_env(tmp_path, redis_url, redis_prefix) as env:
        first = await env.control.submit(**REQUEST, idempotency_key=KEY)  # type: ignore[arg-type]
        await flush_index(redis_url, redis_prefix)
        retried = await env.control.submit(**REQUEST, idempotency_key=KEY)  # type: ignore[arg-type]
        assert (retried.session_id, retried.created) == (first.session_id, False)
        await Sweeper(env.control).sweep_once()  # the repair, after the retry
        again = await env.control.submit(**REQUEST, idempotency_key=KEY)  # type: ignore[arg-type]
        assert (again.session_id, again.created) == (first.session_id, False)
        assert await session_ids(env) == [first.session_id]
        assert await env.world.counts("dispatch") == {"acme:approve:PR-1:1": 1}
        with pytest.raises(IdempotencyMismatch):  # the key stays bound to its body
            await env.control.submit(  # type: ignore[arg-type]
                **{**REQUEST, "input": {"doc": "PR-2", "amount": 1.0}}, idempotency_key=KEY
            )


async def test_a_request_killed_past_create_then_the_index_lost_is_answered_by_that_session(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    run_killed_at(
        "submit.after_create", SUBMIT_IN_CHILD, str(tmp_path), redis_url, redis_prefix, KEY
    )
    await flush_index(redis_url, redis_prefix)
    async with local_env(tmp_path, redis_url, redis_prefix) as env:
        [orphan] = await session_ids(env)
        retried = await env.control.submit(**REQUEST, idempotency_key=KEY)  # type: ignore[arg-type]
        assert (retried.session_id, retried.created) == (orphan, False)
        assert (await env.load(orphan)).state.value != "pending"  # the retry finished it
        assert await session_ids(env) == [orphan]


async def test_a_key_older_than_a_day_makes_a_new_session_after_an_index_loss(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    async with local_env(tmp_path, redis_url, redis_prefix) as env:
        first = await env.control.submit(**REQUEST, idempotency_key=KEY)  # type: ignore[arg-type]
        await flush_index(redis_url, redis_prefix)
        env.clock.advance(IDEMPOTENCY_TTL.total_seconds() + 1)
        later = await env.control.submit(**REQUEST, idempotency_key=KEY)  # type: ignore[arg-type]
        assert later.created and later.session_id != first.session_id
        again = await env.control.submit(**REQUEST, idempotency_key=KEY)  # type: ignore[arg-type]
        assert (again.session_id, again.created) == (later.session_id, False)


async def test_a_retry_that_takes_a_claim_over_records_the_key_durably_too(
    tmp_path: Path, redis_url: str, redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first request claimed the key in the index and failed before its durable
    record (the store refused it): the retry that takes the claim over made the session
    without one, and a retry after a later index loss made a second session."""
    async with local_env(tmp_path, redis_url, redis_prefix) as env:
        submit_keys = env.services.submit_keys
        real = submit_keys.claim

        async def refused(**_: object) -> object:
            raise StorageUnavailable("the store is down")

        monkeypatch.setattr(submit_keys, "claim", refused)
        with pytest.raises(StorageUnavailable):
            await env.control.submit(**REQUEST, idempotency_key=KEY)  # type: ignore[arg-type]
        monkeypatch.setattr(submit_keys, "claim", real)
        env.clock.advance(SUBMIT_CLAIM_GRACE.total_seconds() + 1)
        taken = await env.control.submit(**REQUEST, idempotency_key=KEY)  # type: ignore[arg-type]
        assert taken.created
        await flush_index(redis_url, redis_prefix)
        again = await env.control.submit(**REQUEST, idempotency_key=KEY)  # type: ignore[arg-type]
        assert (again.session_id, again.created) == (taken.session_id, False)
        assert await session_ids(env) == [taken.session_id]
