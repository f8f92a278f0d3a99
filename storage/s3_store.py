"""``s3://bucket/prefix``: the object store on any S3-compatible service (AWS, MinIO, …).

Create-only and compare-and-swap are S3 conditional writes (``If-None-Match: *`` and
``If-Match: <etag>``), which AWS S3, MinIO and the moto test server honour. A
conditional delete is ``If-Match`` on DeleteObject, which AWS S3 and moto honour; a
service that ignores it deletes unconditionally (``storage.probe`` does not look).
boto3 is blocking, so every call runs in a worker thread; the client itself is
thread-safe.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import boto3
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    NoCredentialsError,
    PartialCredentialsError,
)

from storage.blocking import off_loop
from storage.keys import check_object_key
from torpor.backoff import Backoff
from torpor.errors import (
    BucketNotFound,
    ConfigError,
    EtagMismatch,
    ObjectExists,
    ObjectNotFound,
    StorageRefused,
    StorageUnavailable,
    TorporError,
)
from torpor.ports import ListPage, StoredObject

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

_LOST_RACE = {"PreconditionFailed"}
# 409: another conditional write to the key was in flight. Nothing is decided yet: ask again.
_IN_FLIGHT = "ConditionalRequestConflict"
CONFLICT_ATTEMPTS = 5
# Empty pages a listing follows before it gives up (a bound, not a figure S3 names).
EMPTY_PAGES = 100
CONFLICT_BACKOFF = Backoff(base_s=0.05, cap_s=1.0)
_MISSING = {"NoSuchKey", "404", "NotFound"}
_CREDENTIALS = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403"}
# Refused for what the request is: the same request is refused again, however often sent.
# Taken for an outage (retryable), a webhook was answered 503 and resent for days, and a
# session retried to its quarantine.
_REFUSED = {
    "InvalidArgument",
    "EntityTooLarge",
    "KeyTooLongError",
    "InvalidObjectName",
    "MalformedXML",
    "413",
}
_UNSUPPORTED = {"NotImplemented", "501"}


class S3ObjectStore:
    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        max_pool_connections: int = 32,
        timeout_s: float = 10.0,
    ) -> None:
        if not bucket:
            raise ConfigError("an s3:// URL needs a bucket name")
        if (access_key_id is None) != (secret_access_key is None):
            # boto3 would raise its PartialCredentialsError from here; name the gap instead.
            given, missing = (
                ("access key id", "secret access key")
                if secret_access_key is None
                else ("secret access key", "access key id")
            )
            raise ConfigError(f"S3 configuration names the {given} but no {missing}")
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self._endpoint = endpoint_url
        config = Config(
            retries={"mode": "standard", "max_attempts": 4},
            max_pool_connections=max_pool_connections,
            connect_timeout=timeout_s,
            read_timeout=timeout_s,
        )
        # Credentials from configuration when given, else boto3's usual chain (env, role).
        self._client: S3Client = boto3.client(
            "s3",
            endpoint_url=endpoint_url,
            region_name=region,
            aws_access_key_id=access_key_id,
            aws_secret_access_key=secret_access_key,
            config=config,
        )

    @property
    def url(self) -> str:
        where = f" at {self._endpoint}" if self._endpoint else ""
        return f"s3://{self.bucket}/{self.prefix}{where}"

    def _full(self, key: str) -> str:
        return self.prefix + check_object_key(key)

    def _fail(self, exc: Exception, key: str, on_lost_race: type[TorporError]) -> TorporError:
        if isinstance(exc, ClientError):
            code = _code(exc)
            if code == "NoSuchBucket":
                return BucketNotFound(f"bucket {self.bucket!r} does not exist ({self.url})")
            if code in _LOST_RACE:
                return on_lost_race(f"conditional write on {key!r} lost", key=key)
            if code in _MISSING:
                if on_lost_race is EtagMismatch:
                    return EtagMismatch(f"object {key!r} no longer exists", key=key)
                return ObjectNotFound(f"no object {key!r} in {self.url}", key=key)
            if code in _CREDENTIALS:
                return ConfigError(f"S3 rejected the configured credentials for {self.url}")
            if code in _REFUSED:
                return StorageRefused(f"S3 refused the request on {key!r}: {code} ({self.url})")
            if code in _UNSUPPORTED:
                return ConfigError(
                    f"the store at {self.url} does not implement a request torpor makes"
                    f" ({code} on {key!r}): it needs S3's conditional writes and ranged reads"
                )
            return StorageUnavailable(f"S3 error {code or 'unknown'} on {key!r} ({self.url})")
        if isinstance(exc, NoCredentialsError | PartialCredentialsError):
            # The client resolved its credentials when it was made and does not look again.
            return ConfigError(f"no S3 credentials found for {self.url} (configuration, env, role)")
        return StorageUnavailable(f"S3 at {self.url} did not answer: {type(exc).__name__}")

    # -- blocking implementations ---------------------------------------------------

    def _get(self, key: str, max_bytes: int | None, *, ranged: bool = True) -> StoredObject:
        args: dict[str, Any] = {"Bucket": self.bucket, "Key": self._full(key)}
        if max_bytes is not None and ranged:
            # "bytes=0--1" (max_bytes 0) is no range at all: S3 answers the whole object.
            args["Range"] = f"bytes=0-{max(max_bytes, 1) - 1}"
        try:
            response = self._client.get_object(**args)
            body = response["Body"]
            try:
                # Never more than asked for, even from a service that ignored the Range.
                data = body.read() if max_bytes is None else body.read(max_bytes)
            finally:
                body.close()
            return StoredObject(data, response["ETag"])
        except ClientError as exc:
            if _code(exc) == "InvalidRange" and ranged:  # empty object
                return self._get(key, max_bytes, ranged=False)
            raise self._fail(exc, key, ObjectExists) from exc
        except BotoCoreError as exc:
            raise self._fail(exc, key, ObjectExists) from exc

    def _put(self, key: str, data: bytes, condition: dict[str, str]) -> str:
        lost: type[TorporError] = ObjectExists if "IfNoneMatch" in condition else EtagMismatch
        sent_again = False  # some request of this call was sent more than once
        for attempt in range(CONFLICT_ATTEMPTS):
            try:
                response = self._client.put_object(
                    Bucket=self.bucket,
                    Key=self._full(key),
                    Body=data,
                    **condition,  # type: ignore[arg-type]
                )
                return response["ETag"]
            except ClientError as exc:
                code = _code(exc)
                sent_again = sent_again or _was_retried(exc)
                if code == _IN_FLIGHT and attempt + 1 < CONFLICT_ATTEMPTS:
                    time.sleep(CONFLICT_BACKOFF.delay_s(attempt))  # a worker thread
                    continue
                if code in _LOST_RACE and condition and sent_again:
                    # Ambiguous write: an earlier attempt of this very call may have committed
                    # and lost its answer (a reset connection), so the retry met our own
                    # object. Identical bytes mean it is ours: report the success it was.
                    # The earlier attempt may be one botocore retried into a 409 (our own
                    # write still in flight), whose 412 comes on this loop's next request.
                    etag = self._landed(key, data)
                    if etag is not None:
                        return etag
                raise self._fail(exc, key, lost) from exc
            except BotoCoreError as exc:
                raise self._fail(exc, key, lost) from exc
        raise StorageUnavailable(f"conditional write on {key!r} kept conflicting ({self.url})")

    def _landed(self, key: str, data: bytes) -> str | None:
        """The etag of the stored object if it holds exactly ``data``, else None."""
        try:
            stored = self._get(key, None)
        except ObjectNotFound:
            return None
        return stored.etag if stored.data == data else None

    def _list(self, prefix: str, start_after: str | None, limit: int) -> ListPage:
        args: dict[str, Any] = {
            "Bucket": self.bucket,
            "Prefix": self.prefix + prefix,
            "MaxKeys": limit,
        }
        if start_after:
            args["StartAfter"] = self.prefix + start_after
        for _ in range(EMPTY_PAGES):
            try:
                response = self._client.list_objects_v2(**args)
            except (ClientError, BotoCoreError) as exc:
                raise self._fail(exc, prefix, ObjectExists) from exc
            keys = [obj["Key"][len(self.prefix) :] for obj in response.get("Contents", [])]
            truncated = bool(response.get("IsTruncated"))
            if keys or not truncated:
                return ListPage(keys, keys[-1] if truncated else None)
            # A truncated page with no keys (S3 Express directory buckets answer these):
            # no key to resume after, so the page after it, by its token. Ended here, the
            # listing stopped early and a caller's walk missed every key after it.
            token = response.get("NextContinuationToken")
            if not token:
                break
            args.pop("StartAfter", None)
            args["ContinuationToken"] = token
        raise StorageUnavailable(f"S3 listed {EMPTY_PAGES} empty pages in a row ({self.url})")

    def _delete(self, key: str) -> None:
        try:
            self._client.delete_object(Bucket=self.bucket, Key=self._full(key))
        except (ClientError, BotoCoreError) as exc:
            raise self._fail(exc, key, ObjectExists) from exc

    def _delete_if_match(self, key: str, etag: str) -> bool:
        for attempt in range(CONFLICT_ATTEMPTS):
            try:
                # S3 compares the etag and deletes in one step: a replace that lands
                # before it makes it a 412, one after it finds no object to replace.
                self._client.delete_object(Bucket=self.bucket, Key=self._full(key), IfMatch=etag)
                return True
            except ClientError as exc:
                code = _code(exc)
                if code == _IN_FLIGHT and attempt + 1 < CONFLICT_ATTEMPTS:
                    time.sleep(CONFLICT_BACKOFF.delay_s(attempt))  # a worker thread
                    continue
                # 412: replaced since it was read; 404: gone. Nothing deleted either way,
                # unless botocore sent the request again after a first try that deleted
                # and lost its answer: that one finds it gone too (the port says so).
                if code in _LOST_RACE or code in _MISSING:
                    return False
                raise self._fail(exc, key, EtagMismatch) from exc
            except BotoCoreError as exc:
                raise self._fail(exc, key, EtagMismatch) from exc
        raise StorageUnavailable(f"conditional delete of {key!r} kept conflicting ({self.url})")

    # -- async protocol -------------------------------------------------------------

    async def get(self, key: str, *, max_bytes: int | None = None) -> StoredObject:
        return await off_loop(self._get, key, max_bytes)

    async def put(self, key: str, data: bytes) -> str:
        return await off_loop(self._put, key, data, {})

    async def put_if_absent(self, key: str, data: bytes, *, durable: bool = True) -> str:
        return await off_loop(self._put, key, data, {"IfNoneMatch": "*"})

    async def put_if_match(self, key: str, data: bytes, *, etag: str) -> str:
        return await off_loop(self._put, key, data, {"IfMatch": etag})

    async def list(
        self, prefix: str, *, start_after: str | None = None, limit: int = 1000
    ) -> ListPage:
        return await off_loop(self._list, prefix, start_after, limit)

    async def delete(self, key: str) -> None:
        await off_loop(self._delete, key)

    async def delete_if_match(self, key: str, *, etag: str) -> bool:
        return await off_loop(self._delete_if_match, key, etag)

    async def warm(self) -> None:
        # Nothing made ahead: the connection pool fills on demand, and a process's first
        # connection is opened by the conditional-writes probe it runs before any write.
        return None

    async def close(self) -> None:
        await off_loop(self._client.close)


# An error answered without an XML body (a gateway in front of the store): botocore names
# it by its bare status, which means the same here as the code S3 would have sent.
_BARE_STATUS = {"412": "PreconditionFailed", "409": _IN_FLIGHT, "501": "NotImplemented"}


def _code(exc: ClientError) -> str:
    code = str(exc.response.get("Error", {}).get("Code", ""))
    return _BARE_STATUS.get(code, code)


def _was_retried(exc: ClientError) -> bool:
    """Whether botocore sent this request more than once (after a reset or a timeout)."""
    meta: dict[str, Any] = dict(exc.response.get("ResponseMetadata", {}))
    return int(meta.get("RetryAttempts", 0) or 0) > 0
