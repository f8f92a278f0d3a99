"""The S3 adapter under injected faults: every conditional write has exactly one outcome.

A fault proxy sits between boto3 and the S3 test server. The worst case is the ambiguous
write: the PUT commits upstream, its answer is lost, boto3 retries and meets its own
object (412). That must read as success, not as "someone else got there first".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from actors.wiring import ensure_conditional_writes, open_services
from storage.probe import verify_conditional_writes
from storage.s3_store import S3ObjectStore
from tests.conftest import eventually
from tests.support.fault_proxy import FaultProxy, conditional_put
from tests.support.s3_server import S3TestServer
from torpor.errors import (
    ConditionalWritesIgnored,
    ConfigError,
    EtagMismatch,
    ObjectExists,
    StorageRefused,
    StorageUnavailable,
)
from torpor.problems import problem_for
from torpor.settings import Settings

pytestmark = pytest.mark.s3


async def test_create_only_whose_answer_was_lost_is_our_success(
    faulty_s3: S3ObjectStore, s3_proxy: FaultProxy
) -> None:
    s3_proxy.reset_after_commit()
    etag = await faulty_s3.put_if_absent("a/ours", b"payload-1")
    assert s3_proxy.stats.reset == 1
    stored = await faulty_s3.get("a/ours")
    assert stored.data == b"payload-1" and stored.etag == etag


async def test_create_only_still_refuses_someone_elses_object(
    faulty_s3: S3ObjectStore, s3_proxy: FaultProxy
) -> None:
    await faulty_s3.put_if_absent("a/theirs", b"theirs")
    s3_proxy.reset_after_commit()
    # Our write never lands (theirs is there), the answer is lost anyway, the retry sees 412.
    with pytest.raises(ObjectExists):
        await faulty_s3.put_if_absent("a/theirs", b"ours")
    assert (await faulty_s3.get("a/theirs")).data == b"theirs"


async def test_compare_and_swap_whose_answer_was_lost_is_our_success(
    faulty_s3: S3ObjectStore, s3_proxy: FaultProxy
) -> None:
    first = await faulty_s3.put_if_absent("a/cas", b"gen-0")
    s3_proxy.reset_after_commit()
    etag = await faulty_s3.put_if_match("a/cas", b"gen-1", etag=first)
    assert s3_proxy.stats.reset == 1
    stored = await faulty_s3.get("a/cas")
    assert stored.data == b"gen-1" and stored.etag == etag


async def test_compare_and_swap_lost_to_another_writer_is_refused(
    faulty_s3: S3ObjectStore, s3_proxy: FaultProxy
) -> None:
    first = await faulty_s3.put_if_absent("a/race", b"gen-0")
    await faulty_s3.put_if_match("a/race", b"theirs", etag=first)
    with pytest.raises(EtagMismatch):
        await faulty_s3.put_if_match("a/race", b"ours", etag=first)


async def test_a_burst_of_503_is_retried(faulty_s3: S3ObjectStore, s3_proxy: FaultProxy) -> None:
    s3_proxy.fail(503, "SlowDown", times=2)
    await faulty_s3.put_if_absent("a/slow", b"x")
    assert s3_proxy.stats.failed == 2
    assert (await faulty_s3.get("a/slow")).data == b"x"


async def test_a_503_that_does_not_stop_is_storage_unavailable(
    faulty_s3: S3ObjectStore, s3_proxy: FaultProxy
) -> None:
    s3_proxy.fail(503, "SlowDown", times=1000)
    with pytest.raises(StorageUnavailable):
        await faulty_s3.put_if_absent("a/down", b"x")


async def test_conditional_request_conflict_is_retried_not_a_lost_race(
    faulty_s3: S3ObjectStore, s3_proxy: FaultProxy
) -> None:
    # 409 ConditionalRequestConflict: another conditional write to the key was in flight.
    # The outcome is unknown, so it is asked again; it is not "the key exists".
    s3_proxy.fail(409, "ConditionalRequestConflict", times=1)
    await faulty_s3.put_if_absent("a/conflict", b"x")
    assert s3_proxy.stats.failed == 1
    assert (await faulty_s3.get("a/conflict")).data == b"x"


async def test_start_up_probe_accepts_a_store_that_honours_conditions(
    faulty_s3: S3ObjectStore,
) -> None:
    await verify_conditional_writes(faulty_s3)
    assert (await faulty_s3.list("probe/")).keys == []  # the scratch object is gone


async def test_start_up_probe_refuses_a_store_that_ignores_conditions(
    faulty_s3: S3ObjectStore, s3_proxy: FaultProxy
) -> None:
    s3_proxy.strip_conditions()
    with pytest.raises(ConfigError, match="ignores If-None-Match"):
        await verify_conditional_writes(faulty_s3)


async def test_start_up_probe_refuses_a_store_that_ignores_if_match(
    faulty_s3: S3ObjectStore, s3_proxy: FaultProxy
) -> None:
    s3_proxy.strip_conditions(match=lambda method, path, headers: "if-match" in headers)
    with pytest.raises(ConfigError, match="ignores If-Match"):
        await verify_conditional_writes(faulty_s3)


async def test_the_edge_refuses_to_write_to_a_store_that_ignores_conditions(
    s3_server: S3TestServer, s3_proxy: FaultProxy, s3_bucket: str, tmp_path: Path
) -> None:
    # What the ingress and the reconciler run before their first write, once per process.
    kw = s3_server.boto_kwargs()
    settings = Settings.build(
        {
            "storage": {
                "object_store_url": f"s3://{s3_bucket}/edge",
                "index_url": f"sqlite://{tmp_path / 'index.db'}",
                "s3": {**kw, "endpoint_url": s3_proxy.endpoint},
            }
        }
    )
    services = open_services(settings)
    try:
        s3_proxy.strip_conditions()
        with pytest.raises(ConditionalWritesIgnored) as refused:
            await ensure_conditional_writes(services)
        assert problem_for(refused.value).status == 503
        s3_proxy.clear()  # the store is fixed: the next request checks again and goes on
        await ensure_conditional_writes(services)
        s3_proxy.strip_conditions()  # verified once per process: no second probe
        await ensure_conditional_writes(services)
    finally:
        await services.close()


async def test_a_slow_write_is_retried_and_its_late_original_changes_nothing(
    s3_server: S3TestServer, s3_proxy: FaultProxy, s3_bucket: str
) -> None:
    # The first PUT stalls past the client's deadline; boto3 retries, and the retry lands.
    # The stalled original reaches S3 later with the same condition and is refused there.
    kwargs = {**s3_server.boto_kwargs(), "endpoint_url": s3_proxy.endpoint}
    store = S3ObjectStore(s3_bucket, "slow", timeout_s=0.5, **kwargs)
    try:
        first = await store.put_if_absent("a/cas", b"gen-0")
        stalled = s3_proxy.delay(1.5, match=lambda method, path, headers: method == "PUT")
        etag = await store.put_if_match("a/cas", b"gen-1", etag=first)
        assert stalled.fired == 1
        await eventually(
            lambda: any(what.startswith("forwarded 412") for _, _, what in s3_proxy.stats.log),
            timeout_s=10,
            what="the stalled original reached S3 and was refused",
        )
        stored = await store.get("a/cas")
        assert stored.data == b"gen-1" and stored.etag == etag
    finally:
        await store.close()


async def test_create_only_whose_answer_was_lost_then_met_a_conflict_is_our_success(
    faulty_s3: S3ObjectStore, s3_proxy: FaultProxy
) -> None:
    # The first PUT lands and its answer is lost; botocore's retry meets a 409 (our own
    # write still in flight at the service, as AWS answers), so the adapter asks again
    # and meets its own object: 412 on a request botocore sent once. Still our success.
    s3_proxy.reset_after_commit()
    s3_proxy.fail(409, "ConditionalRequestConflict", times=1, match=conditional_put)
    etag = await faulty_s3.put_if_absent("a/ours-409", b"payload-1")
    assert s3_proxy.stats.reset == 1 and s3_proxy.stats.failed == 1
    stored = await faulty_s3.get("a/ours-409")
    assert stored.data == b"payload-1" and stored.etag == etag


async def test_compare_and_swap_whose_answer_was_lost_then_met_a_conflict_is_our_success(
    faulty_s3: S3ObjectStore, s3_proxy: FaultProxy
) -> None:
    first = await faulty_s3.put_if_absent("a/cas-409", b"gen-0")
    s3_proxy.reset_after_commit()
    s3_proxy.fail(409, "ConditionalRequestConflict", times=1, match=conditional_put)
    etag = await faulty_s3.put_if_match("a/cas-409", b"gen-1", etag=first)
    assert s3_proxy.stats.reset == 1 and s3_proxy.stats.failed == 1
    stored = await faulty_s3.get("a/cas-409")
    assert stored.data == b"gen-1" and stored.etag == etag


@pytest.mark.parametrize("op", ["put_if_absent", "put_if_match"])
async def test_a_412_without_an_error_body_is_a_lost_race(
    faulty_s3: S3ObjectStore, s3_proxy: FaultProxy, op: str
) -> None:
    # A gateway in front of the store (or a store) that answers 412 with no XML body:
    # botocore names the error by its status ("412"). Still the lost race it is, typed
    # for the caller, not a retryable StorageUnavailable that retries into the same 412.
    first = await faulty_s3.put_if_absent("a/bare", b"gen-0")
    s3_proxy.fail(412, "", match=conditional_put)
    lost = ObjectExists if op == "put_if_absent" else EtagMismatch
    with pytest.raises(lost):
        if op == "put_if_absent":
            await faulty_s3.put_if_absent("a/bare", b"other")
        else:
            await faulty_s3.put_if_match("a/bare", b"other", etag=first)
    assert s3_proxy.stats.failed == 1


async def test_a_409_without_an_error_body_is_asked_again(
    faulty_s3: S3ObjectStore, s3_proxy: FaultProxy
) -> None:
    s3_proxy.fail(409, "", match=conditional_put)
    await faulty_s3.put_if_absent("a/bare-409", b"x")
    assert s3_proxy.stats.failed == 1
    assert (await faulty_s3.get("a/bare-409")).data == b"x"


async def test_a_prefix_read_answered_with_the_whole_object_keeps_only_the_prefix(
    faulty_s3: S3ObjectStore, s3_proxy: FaultProxy
) -> None:
    # A gateway that ignores Range answers 200 with the whole object: get(max_bytes=...)
    # returns the prefix asked for (as the other stores do), not the whole body.
    etag = await faulty_s3.put_if_absent("a/big", b"0123456789" * 1000)
    s3_proxy.strip_headers("range")
    head = await faulty_s3.get("a/big", max_bytes=16)
    assert head.data == b"0123456789012345"
    assert head.etag == etag


@pytest.mark.parametrize(
    ("status", "code"),
    [(400, "InvalidArgument"), (400, "EntityTooLarge"), (400, "KeyTooLongError"), (413, "")],
)
async def test_a_request_the_store_refuses_for_good_is_not_an_outage(
    faulty_s3: S3ObjectStore, s3_proxy: FaultProxy, status: int, code: str
) -> None:
    """Refused for what it is, the same request is refused again: as a retryable outage
    a webhook was answered 503 and resent for days, a session retried to quarantine."""
    s3_proxy.fail(status, code, match=conditional_put)
    with pytest.raises(StorageRefused) as refused:
        await faulty_s3.put_if_absent("a/refused", b"x")
    assert not refused.value.retryable
    assert problem_for(refused.value).status == 500


async def test_a_store_that_does_not_implement_a_request_is_a_configuration_error(
    faulty_s3: S3ObjectStore, s3_proxy: FaultProxy
) -> None:
    s3_proxy.fail(501, "NotImplemented", match=conditional_put)
    with pytest.raises(ConfigError, match="does not implement"):
        await faulty_s3.put_if_absent("a/unsupported", b"x")


class EmptyPageFirst:
    """The S3 client, except that each listing's first answer is a truncated page with no
    keys and only a continuation token (as S3 Express directory buckets answer)."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.held: dict[str, dict[str, Any]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    def list_objects_v2(self, **args: Any) -> Any:
        token = args.pop("ContinuationToken", None)
        if token is None:
            self.held[token := f"empty-{len(self.held)}"] = dict(args)
            return {"IsTruncated": True, "NextContinuationToken": token, "KeyCount": 0}
        return self.client.list_objects_v2(**self.held.pop(token))


async def test_a_listing_goes_on_past_a_truncated_page_with_no_keys(
    s3_store: S3ObjectStore,
) -> None:
    for name in ("a", "b", "c"):
        await s3_store.put(f"list/{name}", b"x")
    s3_store._client = EmptyPageFirst(s3_store._client)  # type: ignore[assignment]
    keys, cursor = [], None
    while True:
        page = await s3_store.list("list/", start_after=cursor, limit=2)
        keys += page.keys
        if page.next_token is None:
            break
        cursor = page.next_token
    assert keys == ["list/a", "list/b", "list/c"]
