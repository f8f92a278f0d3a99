"""Tenant API keys: bearer tokens, stored only as hashes, compared in constant time."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Mapping

from torpor.errors import Unauthenticated
from torpor.settings import TenantConfig

KEY_PREFIX = "tpk_"
# A 401 names the scheme it wants (RFC 9110 15.5.2, RFC 6750 3): the edge sends this as
# WWW-Authenticate for the refusals below.
CHALLENGE = 'Bearer realm="torpor"'


def _refused(message: str) -> Unauthenticated:
    return Unauthenticated(message, challenge=CHALLENGE)


def new_api_key() -> tuple[str, str]:
    """A fresh key and the hash to put in configuration."""
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    return key, hash_key(key)


def hash_key(key: str) -> str:
    # API keys are 256-bit random tokens, so a fast hash is enough: there is nothing to
    # brute-force that a slow KDF would protect.
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def tenant_for(authorization: str | None, tenants: Mapping[str, TenantConfig]) -> str:
    """The tenant whose key is presented as ``Authorization: Bearer <key>``."""
    if not authorization:
        raise _refused("an API key is required (Authorization: Bearer <key>)")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise _refused("use Authorization: Bearer <key>")
    presented = hash_key(token.strip()).encode()
    found: str | None = None
    # Compare against every stored hash, without stopping early, in constant time each.
    for tenant, config in tenants.items():
        for stored in config.api_keys:
            if hmac.compare_digest(presented, stored.encode()):
                found = tenant
    if found is None:
        raise _refused("the API key is not valid")
    return found


def key_id(stored_hash: str) -> str:
    """A short, non-secret name for a configured key: who did it, in the audit log."""
    return stored_hash.removeprefix("sha256:")[:12]


def match_key(token: str, stored: list[str]) -> str | None:
    """The configured hash that ``token`` is the key of, or None; every hash is compared
    in constant time and none stops the loop early."""
    presented = hash_key(token.strip()).encode()
    found: str | None = None
    for candidate in stored:
        if hmac.compare_digest(presented, candidate.encode()):
            found = candidate
    return found


def operator_for(authorization: str | None, operator_keys: list[str]) -> str:
    """The operator presenting ``Authorization: Bearer <key>``, named by a prefix of the
    key's hash (what the audit and the session's record show, never the key)."""
    if not authorization:
        raise _refused("an operator key is required (Authorization: Bearer <key>)")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise _refused("use Authorization: Bearer <key>")
    found = match_key(token, operator_keys)
    if found is None:
        raise _refused("the operator key is not valid")
    return "operator:" + key_id(found)
