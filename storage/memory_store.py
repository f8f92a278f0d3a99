"""``memory://``: an object store in one process's memory, for unit tests.

It keeps the contract of the real stores (create-only, compare-and-swap on etags that are
the MD5 of the content, sorted paginated listings, safe keys) so services and the session
core can be tested without a folder or S3. Every method finishes without yielding to the
event loop, so each one is atomic for the coroutines of that loop; nothing is shared with
other processes.
"""

from __future__ import annotations

import hashlib

from storage.keys import check_object_key
from torpor.errors import EtagMismatch, ObjectExists, ObjectNotFound
from torpor.ports import ListPage, StoredObject


def _etag(data: bytes) -> str:
    return '"' + hashlib.md5(data, usedforsecurity=False).hexdigest() + '"'


class MemoryObjectStore:
    """The ``ObjectStore`` port on a dict; a fresh instance holds nothing."""

    def __init__(self) -> None:
        self._objects: dict[str, bytes] = {}

    @property
    def url(self) -> str:
        return "memory://"

    async def get(self, key: str, *, max_bytes: int | None = None) -> StoredObject:
        data = self._objects.get(check_object_key(key))
        if data is None:
            raise ObjectNotFound(f"no object {key!r} in {self.url}", key=key)
        # The etag always names the whole object, as S3's does on a ranged GET.
        head = data if max_bytes is None else data[:max_bytes]
        return StoredObject(head, _etag(data))

    async def put(self, key: str, data: bytes) -> str:
        self._objects[check_object_key(key)] = bytes(data)
        return _etag(data)

    async def put_if_absent(self, key: str, data: bytes, *, durable: bool = True) -> str:
        if check_object_key(key) in self._objects:
            raise ObjectExists(f"object {key!r} already exists", key=key)
        self._objects[key] = bytes(data)
        return _etag(data)

    async def put_if_match(self, key: str, data: bytes, *, etag: str) -> str:
        current = self._objects.get(check_object_key(key))
        if current is None:
            raise EtagMismatch(f"object {key!r} no longer exists", key=key)
        if _etag(current).strip('"') != etag.strip('"'):
            raise EtagMismatch(f"object {key!r} changed since it was read", key=key)
        self._objects[key] = bytes(data)
        return _etag(data)

    async def list(
        self, prefix: str, *, start_after: str | None = None, limit: int = 1000
    ) -> ListPage:
        keys = sorted(
            k
            for k in self._objects
            if k.startswith(prefix) and (start_after is None or k > start_after)
        )
        page = keys[:limit]
        return ListPage(page, page[-1] if len(keys) > limit else None)

    async def delete(self, key: str) -> None:
        self._objects.pop(check_object_key(key), None)

    async def delete_if_match(self, key: str, *, etag: str) -> bool:
        current = self._objects.get(check_object_key(key))
        if current is None or _etag(current).strip('"') != etag.strip('"'):
            return False
        del self._objects[key]
        return True

    async def warm(self) -> None:
        return None  # nothing made ahead in memory

    async def close(self) -> None:
        return None
