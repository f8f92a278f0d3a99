"""One contract, every object store: the local folder, memory, and S3 over real HTTP (moto)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from storage import blocking
from storage.local_store import LocalObjectStore, etag_of
from storage.memory_store import MemoryObjectStore
from storage.s3_store import S3ObjectStore
from tests.support.race import race
from tests.support.s3_server import S3TestServer
from torpor.errors import (
    BucketNotFound,
    EtagMismatch,
    InvalidKey,
    ObjectExists,
    ObjectNotFound,
)
from torpor.ports import ObjectStore
from torpor.threads import ProcessPool


class ObjectStoreContract:
    @pytest.fixture
    def store(self) -> ObjectStore:  # overridden per adapter
        raise NotImplementedError

    async def test_get_missing_raises_typed_error(self, store: ObjectStore) -> None:
        with pytest.raises(ObjectNotFound):
            await store.get("nothing/here")

    async def test_create_only_then_read_back(self, store: ObjectStore) -> None:
        etag = await store.put_if_absent("a/b/c", b"hello")
        got = await store.get("a/b/c")
        assert got.data == b"hello"
        assert got.etag.strip('"') == etag.strip('"')

    async def test_second_create_loses_and_writes_nothing(self, store: ObjectStore) -> None:
        await store.put_if_absent("k", b"first")
        with pytest.raises(ObjectExists):
            await store.put_if_absent("k", b"second")
        assert (await store.get("k")).data == b"first"

    async def test_a_create_that_need_not_be_flushed_is_create_only_all_the_same(
        self, store: ObjectStore
    ) -> None:
        etag = await store.put_if_absent("m/x", b"accepted", durable=False)
        with pytest.raises(ObjectExists):
            await store.put_if_absent("m/x", b"other", durable=False)
        with pytest.raises(ObjectExists):
            await store.put_if_absent("m/x", b"other")
        got = await store.get("m/x")
        assert got.data == b"accepted" and got.etag.strip('"') == etag.strip('"')

    async def test_compare_and_swap(self, store: ObjectStore) -> None:
        etag1 = await store.put_if_absent("cas", b"v1")
        etag2 = await store.put_if_match("cas", b"v2", etag=etag1)
        assert etag2 != etag1
        with pytest.raises(EtagMismatch):
            await store.put_if_match("cas", b"v3", etag=etag1)  # stale etag
        assert (await store.get("cas")).data == b"v2"

    async def test_cas_on_missing_object_is_a_mismatch(self, store: ObjectStore) -> None:
        with pytest.raises(EtagMismatch):
            await store.put_if_match("ghost", b"x", etag='"0123456789abcdef0123456789abcdef"')
        with pytest.raises(ObjectNotFound):
            await store.get("ghost")

    @pytest.mark.parametrize("key", ["pointers/k", "inbox/s/e"], ids=["file", "row"])
    async def test_a_conditional_delete_deletes_only_the_object_it_names(
        self, store: ObjectStore, key: str
    ) -> None:
        """``delete_if_match`` with the etag of a replaced object deletes nothing: the
        replace stays. With the current etag it deletes, once. (The local folder keeps
        ``inbox/`` keys as rows: both kinds.)"""
        etag1 = await store.put_if_absent(key, b"v1")
        etag2 = await store.put_if_match(key, b"v2", etag=etag1)
        assert await store.delete_if_match(key, etag=etag1) is False
        assert (await store.get(key)).data == b"v2"
        assert await store.delete_if_match(key, etag=etag2) is True
        with pytest.raises(ObjectNotFound):
            await store.get(key)
        assert await store.delete_if_match(key, etag=etag2) is False  # gone: nothing to do
        await store.put_if_absent(key, b"again")  # create-only works again after it

    async def test_a_conditional_delete_after_a_blind_put_of_other_content_refuses(
        self, store: ObjectStore
    ) -> None:
        """What a business-key pointer meets: read, then ``put`` (naming another wait)
        by someone else, then the delete with the etag read. It refuses."""
        read = await store.put("pointer", b"ours")
        await store.put("pointer", b"theirs")
        assert await store.delete_if_match("pointer", etag=read) is False
        assert (await store.get("pointer")).data == b"theirs"

    async def test_a_conditional_delete_of_a_missing_object_deletes_nothing(
        self, store: ObjectStore
    ) -> None:
        assert await store.delete_if_match("ghost", etag=etag_of(b"x")) is False
        assert await store.delete_if_match("inbox/ghost", etag=etag_of(b"x")) is False
        with pytest.raises(ObjectNotFound):
            await store.get("ghost")

    async def test_a_key_below_an_object_or_above_one_names_no_object(
        self, store: ObjectStore
    ) -> None:
        """``a/b`` when ``a`` is an object, ``q`` when ``q/w`` is: missing, as any
        missing key (the local folder met a file or a folder on the way)."""
        await store.put_if_absent("a", b"x")
        await store.put_if_absent("q/w", b"y")
        for missing in ("a/b", "q"):
            with pytest.raises(ObjectNotFound):
                await store.get(missing)
            with pytest.raises(ObjectNotFound):
                await store.get(missing, max_bytes=1)
            with pytest.raises(EtagMismatch):
                await store.put_if_match(missing, b"z", etag=etag_of(b"x"))
            assert await store.delete_if_match(missing, etag=etag_of(b"y")) is False
        await store.delete("a/b")  # nothing there: nothing to do
        assert (await store.get("a")).data == b"x"
        assert (await store.get("q/w")).data == b"y"

    async def test_unconditional_put_overwrites(self, store: ObjectStore) -> None:
        await store.put("p", b"1")
        await store.put("p", b"2")
        assert (await store.get("p")).data == b"2"

    async def test_list_is_sorted_paginated_and_prefix_exact(self, store: ObjectStore) -> None:
        names = [f"inbox/s1/{i:03d}" for i in range(25)]
        for name in reversed(names):
            await store.put_if_absent(name, b"x")
        await store.put_if_absent("inbox/s10/000", b"other session")
        await store.put_if_absent("inbox-other/000", b"other prefix")
        seen: list[str] = []
        token = None
        pages = 0
        while True:
            page = await store.list("inbox/s1/", start_after=token, limit=10)
            seen.extend(page.keys)
            pages += 1
            if page.next_token is None:
                break
            token = page.next_token
        assert seen == names
        assert pages == 3

    async def test_list_of_empty_prefix_is_empty(self, store: ObjectStore) -> None:
        page = await store.list("nothing/")
        assert page.keys == [] and page.next_token is None

    async def test_delete_is_idempotent(self, store: ObjectStore) -> None:
        await store.put_if_absent("d", b"x")
        await store.delete("d")
        await store.delete("d")
        with pytest.raises(ObjectNotFound):
            await store.get("d")
        await store.put_if_absent("d", b"again")  # create-only works again after delete

    async def test_prefix_read_keeps_whole_object_etag(self, store: ObjectStore) -> None:
        etag = await store.put_if_absent("big", b"0123456789" * 100)
        head = await store.get("big", max_bytes=16)
        assert head.data == b"0123456789012345"
        assert head.etag.strip('"') == etag.strip('"')

    async def test_a_prefix_read_of_no_bytes_reads_none(self, store: ObjectStore) -> None:
        etag = await store.put_if_absent("big0", b"0123456789")
        head = await store.get("big0", max_bytes=0)
        assert head.data == b""
        assert head.etag.strip('"') == etag.strip('"')

    async def test_empty_object(self, store: ObjectStore) -> None:
        await store.put_if_absent("empty", b"")
        assert (await store.get("empty")).data == b""
        assert (await store.get("empty", max_bytes=8)).data == b""

    async def test_large_object_round_trip(self, store: ObjectStore) -> None:
        blob = bytes(range(256)) * 20_000  # 5 MB
        await store.put_if_absent("large", blob)
        assert (await store.get("large")).data == blob

    async def test_warming_changes_no_object_and_may_be_repeated(self, store: ObjectStore) -> None:
        await store.put_if_absent("kept/one", b"1")
        await store.warm()
        await store.warm()
        assert (await store.list("kept/")).keys == ["kept/one"]
        assert (await store.get("kept/one")).data == b"1"
        await store.put_if_absent("kept/two", b"2")  # and writes go on as before
        assert (await store.get("kept/two")).data == b"2"

    @pytest.mark.parametrize("prefix", ["../", "../.wal/", "../.locks/", "./", "a/../.wal/"])
    async def test_a_prefix_no_key_can_start_with_lists_nothing(
        self, store: ObjectStore, prefix: str
    ) -> None:
        """No key has a ``..`` or ``.`` part: such a prefix names nothing, here or
        beside the objects (the local store's own files, or the host's)."""
        await store.put_if_absent("a/b", b"x")
        page = await store.list(prefix)
        assert page.keys == [] and page.next_token is None

    @pytest.mark.parametrize(
        "bad", ["", "/abs", "../up", "a//b", "a/../b", "a/./b", "sp ace", "a/", "a\n", "a/b\n"]
    )
    async def test_unsafe_keys_are_refused(self, store: ObjectStore, bad: str) -> None:
        with pytest.raises(InvalidKey):
            await store.put_if_absent(bad, b"x")

    @pytest.mark.parametrize("key", ["x" * 256, "a/" + "x" * 256 + "/b"])
    async def test_a_key_with_a_part_no_folder_can_name_is_refused_everywhere(
        self, store: ObjectStore, key: str
    ) -> None:
        """A part longer than a file name may be (255 bytes): refused alike by every
        store, not a raw OSError from the local folder's file system alone."""
        with pytest.raises(InvalidKey):
            await store.put_if_absent(key, b"x")
        with pytest.raises(InvalidKey):
            await store.put(key, b"x")
        with pytest.raises(InvalidKey):
            await store.get(key)
        with pytest.raises(InvalidKey):
            await store.delete(key)
        await store.put_if_absent("x" * 255, b"the longest part a folder holds")


class TestLocalObjectStore(ObjectStoreContract):
    @pytest.fixture
    def store(self, local_store: LocalObjectStore) -> ObjectStore:
        return local_store

    def test_races_have_exactly_one_winner(self, tmp_path: Path) -> None:
        spec = ("local", {"root": str(tmp_path / "race")})
        winners = race(spec, "put_if_absent", workers=6, rounds=20)
        assert all(len(w) == 1 for w in winners.values()), winners

    async def test_cas_race_has_exactly_one_winner(self, tmp_path: Path) -> None:
        root = tmp_path / "race"
        store = LocalObjectStore(root)
        etags = [await store.put_if_absent(f"race/round-{r}", b"base") for r in range(20)]
        winners = race(
            ("local", {"root": str(root)}), "put_if_match", workers=6, rounds=20, etags=list(etags)
        )
        assert all(len(w) == 1 for w in winners.values()), winners

    async def test_conditional_delete_race_has_exactly_one_winner(self, tmp_path: Path) -> None:
        """Processes deleting one object with the etag each read: the key's lock makes
        the compare and the removal one step, so one deletes and the rest find it gone."""
        root = tmp_path / "race"
        store = LocalObjectStore(root)
        etags = [await store.put_if_absent(f"race/round-{r}", b"base") for r in range(20)]
        winners = race(
            ("local", {"root": str(root)}),
            "delete_if_match",
            workers=6,
            rounds=20,
            etags=list(etags),
        )
        assert all(len(w) == 1 for w in winners.values()), winners
        assert (await store.list("race/")).keys == []
        await store.close()

    @pytest.mark.parametrize("op", ["put_if_absent", "put", "move"])
    @pytest.mark.parametrize(("there", "key"), [("queue/a", "queue/a/b"), ("queue/q/w", "queue/q")])
    async def test_a_key_the_folder_cannot_hold_beside_another_is_refused_typed(
        self, local_store: LocalObjectStore, op: str, there: str, key: str
    ) -> None:
        """An object store holds ``a`` and ``a/b`` both; a folder cannot. The write is
        refused with ``InvalidKey`` (it raised the file system's FileExistsError or
        IsADirectoryError), and nothing already there changes."""
        await local_store.put_if_absent(there, b"kept")
        await local_store.put_if_absent("queue/src", b"moved?")
        with pytest.raises(InvalidKey, match="below another"):
            if op == "move":
                await local_store.move("queue/src", key)
            else:
                await getattr(local_store, op)(key, b"x")
        assert (await local_store.get(there)).data == b"kept"
        assert (await local_store.get("queue/src")).data == b"moved?"

    async def test_a_move_from_a_key_the_folder_cannot_hold_is_typed(
        self, local_store: LocalObjectStore
    ) -> None:
        """From below an object there is nothing to move (as ``get`` says: not found);
        from objects' folder it is refused as ``delete`` refuses it, not with the file
        system's NotADirectoryError or PermissionError (a folder cannot be linked)."""
        await local_store.put_if_absent("queue/a", b"kept")
        await local_store.put_if_absent("queue/q/w", b"kept too")
        assert await local_store.move("queue/a/b", "queue/to") is False
        with pytest.raises(InvalidKey, match="below another"):
            await local_store.move("queue/q", "queue/to")
        assert (await local_store.get("queue/a")).data == b"kept"
        assert (await local_store.get("queue/q/w")).data == b"kept too"
        with pytest.raises(ObjectNotFound):
            await local_store.get("queue/to")


class TestMemoryObjectStore(ObjectStoreContract):
    @pytest.fixture
    def store(self, memory_store: MemoryObjectStore) -> ObjectStore:
        return memory_store


@pytest.mark.s3
class TestS3ObjectStore(ObjectStoreContract):
    @pytest.fixture
    def store(self, s3_store: S3ObjectStore) -> ObjectStore:
        return s3_store

    def test_races_have_exactly_one_winner(self, s3_server: S3TestServer, s3_bucket: str) -> None:
        spec = ("s3", {"bucket": s3_bucket, "prefix": "r", "boto": s3_server.boto_kwargs()})
        winners = race(spec, "put_if_absent", workers=6, rounds=10)
        assert all(len(w) == 1 for w in winners.values()), winners

    async def test_cas_race_has_exactly_one_winner(
        self, s3_server: S3TestServer, s3_bucket: str
    ) -> None:
        store = S3ObjectStore(s3_bucket, "r", **s3_server.boto_kwargs())
        etags = [await store.put_if_absent(f"race/round-{r}", b"base") for r in range(10)]
        spec = ("s3", {"bucket": s3_bucket, "prefix": "r", "boto": s3_server.boto_kwargs()})
        winners = race(spec, "put_if_match", workers=6, rounds=10, etags=list(etags))
        assert all(len(w) == 1 for w in winners.values()), winners
        await store.close()

    async def test_conditional_delete_race_has_exactly_one_winner(
        self, s3_server: S3TestServer, s3_bucket: str
    ) -> None:
        store = S3ObjectStore(s3_bucket, "r", **s3_server.boto_kwargs())
        etags = [await store.put_if_absent(f"race/round-{r}", b"base") for r in range(10)]
        spec = ("s3", {"bucket": s3_bucket, "prefix": "r", "boto": s3_server.boto_kwargs()})
        winners = race(spec, "delete_if_match", workers=6, rounds=10, etags=list(etags))
        assert all(len(w) == 1 for w in winners.values()), winners
        assert (await store.list("race/")).keys == []
        await store.close()

    async def test_as_many_requests_as_the_pool_is_wide_are_in_flight_at_once(
        self, s3_store: S3ObjectStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Not asyncio's default pool (``min(32, cores + 4)``: six threads on this 2-core
        machine): each request waits on the network, and a repair or a busy replica has
        many to make. Widened past 36 here, so that no default pool could pass."""
        monkeypatch.setattr(blocking, "IO", ProcessPool(40, "torpor-io-test"))
        keys = [f"wide/{i}" for i in range(40)]
        for key in keys:
            await s3_store.put(key, b"x")
        together = threading.Barrier(len(keys), timeout=10)
        real_get = s3_store._client.get_object

        def get_object(**kwargs: object) -> object:
            together.wait()  # broken if fewer than forty are waiting at once
            return real_get(**kwargs)  # type: ignore[arg-type]

        s3_store._client.get_object = get_object  # type: ignore[method-assign]
        got = await asyncio.gather(*(s3_store.get(key) for key in keys))
        assert [g.data for g in got] == [b"x"] * len(keys)

    async def test_missing_bucket_is_named(self, s3_server: S3TestServer) -> None:
        store = S3ObjectStore("no-such-bucket", **s3_server.boto_kwargs())
        with pytest.raises(BucketNotFound, match="no-such-bucket"):
            await store.put_if_absent("k", b"x")
        await store.close()

    async def test_unreachable_endpoint_is_retryable_storage_error(self) -> None:
        from torpor.errors import StorageUnavailable

        store = S3ObjectStore(
            "b",
            endpoint_url="http://127.0.0.1:9",
            region="us-east-1",
            access_key_id="x",
            secret_access_key="y",
            timeout_s=1,
        )
        with pytest.raises(StorageUnavailable) as info:
            await store.get("k")
        assert info.value.retryable
        await store.close()

    @pytest.fixture
    def no_ambient_credentials(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """No credentials anywhere boto3 looks (environment, files, instance metadata)."""
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
            monkeypatch.delenv(name, raising=False)
        for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_CONTAINER_CREDENTIALS_FULL_URI"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", raising=False)
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials")
        monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/config")
        monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")

    @pytest.mark.usefixtures("no_ambient_credentials")
    async def test_no_credentials_at_all_is_a_configuration_error(self) -> None:
        """The client found none when it was made, and never looks again: a permanent
        ConfigError naming the cause, not a retryable "S3 did not answer"."""
        from torpor.errors import ConfigError

        store = S3ObjectStore("b", endpoint_url="http://127.0.0.1:9", region="us-east-1")
        with pytest.raises(ConfigError, match="credentials") as info:
            await store.get("k")
        assert not info.value.retryable
        await store.close()

    def test_a_key_id_without_its_secret_is_a_configuration_error(self) -> None:
        """Not botocore's PartialCredentialsError from the constructor; and the message
        names neither value."""
        from torpor.errors import ConfigError

        with pytest.raises(ConfigError, match="secret") as info:
            S3ObjectStore("b", region="us-east-1", access_key_id="AKIAEXAMPLEKEYID")
        assert "AKIAEXAMPLEKEYID" not in str(info.value)
