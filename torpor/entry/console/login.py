"""Who is looking at the console: keys to principals, principals to signed cookies.

An operator key (``security.operator_keys``) sees and steers every tenant; a tenant's API
key sees that tenant only, read-only. The key itself never leaves the login request: the
cookie carries the role, the tenant and a short key id, signed with HMAC-SHA256 under
``security.console_key`` (or a per-process random key), with an expiry and a per-login
nonce from which the CSRF token of that login is derived. A logout ends that login for
every copy of its cookie (``LOGOUT_SCOPE``).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum

from torpor.auth import key_id, match_key
from torpor.settings import Settings

COOKIE = "torpor_console"
# The sign-in form's own cookie: a nonce the form's token is bound to (see ``login_csrf``).
LOGIN_COOKIE = "torpor_console_login"
LOGIN_FORM_LIFETIME = timedelta(hours=1)
LIFETIME = timedelta(hours=8)
# A signed cookie is valid until it expires, wherever a copy of it is: its logout is a
# claim on the login's nonce in this scope of the index, held for a whole lifetime (so
# for longer than any cookie of that login), and looked up on every request.
LOGOUT_SCOPE = "console-logout"


class Role(StrEnum):
    OPERATOR = "operator"
    TENANT = "tenant"  # read-only, one tenant


@dataclass(frozen=True)
class Principal:
    role: Role
    tenant: str | None  # None: every tenant (operators)
    key_id: str
    nonce: str
    expires: int  # unix seconds

    @property
    def operator(self) -> bool:
        return self.role is Role.OPERATOR

    @property
    def who(self) -> str:
        return f"{self.role.value}:{self.key_id}"

    def tenants(self, settings: Settings) -> list[str]:
        """The tenants this principal may see."""
        return sorted(settings.tenants) if self.tenant is None else [self.tenant]


def authenticate(settings: Settings, token: str, *, now: datetime) -> Principal | None:
    """The principal a presented key names, or None. Operator keys first: a key that is
    configured as both is treated as the operator's."""
    if not token.strip():
        return None
    expires = int((now + LIFETIME).timestamp())
    nonce = secrets.token_urlsafe(16)
    stored = match_key(token, settings.security.operator_keys)
    if stored is not None:
        return Principal(Role.OPERATOR, None, key_id(stored), nonce, expires)
    for tenant, config in sorted(settings.tenants.items()):
        stored = match_key(token, config.api_keys)
        if stored is not None:
            return Principal(Role.TENANT, tenant, key_id(stored), nonce, expires)
    return None


def _still_configured(settings: Settings, principal: Principal) -> bool:
    """A removed key ends its logins at once, not when their cookies expire."""
    if principal.operator:
        hashes = settings.security.operator_keys
    else:
        config = settings.tenants.get(principal.tenant or "")
        hashes = config.api_keys if config else []
    mine = principal.key_id.encode("utf-8", "surrogateescape")
    return any(hmac.compare_digest(key_id(h).encode(), mine) for h in hashes)


class CookieSigner:
    def __init__(self, settings: Settings) -> None:
        configured = settings.console_key_bytes()
        # Without a configured key, logins last as long as this process (one replica).
        self._key = configured if configured is not None else secrets.token_bytes(32)
        self.settings = settings

    def _mac(self, purpose: str, payload: bytes) -> str:
        return hmac.new(self._key, purpose.encode() + b"\n" + payload, hashlib.sha256).hexdigest()

    def issue(self, principal: Principal) -> str:
        body = {
            "r": principal.role.value,
            "t": principal.tenant,
            "k": principal.key_id,
            "n": principal.nonce,
            "e": principal.expires,
        }
        payload = base64.urlsafe_b64encode(json.dumps(body, separators=(",", ":")).encode())
        return payload.decode() + "." + self._mac("cookie", payload)

    def open(self, value: str | None, *, now: datetime) -> Principal | None:
        """The principal of a cookie that is intact, unexpired and still configured."""
        if not value or "." not in value or len(value) > 1024:
            return None
        payload, _, mac = value.rpartition(".")
        # Bytes, not str: compare_digest raises TypeError on a non-ASCII str, and the
        # cookie is the sender's to choose (it was a 500 before any login).
        good = self._mac("cookie", payload.encode()).encode()
        if not hmac.compare_digest(good, mac.encode("utf-8", "surrogateescape")):
            return None
        try:
            body = json.loads(base64.urlsafe_b64decode(payload.encode()))
            principal = Principal(
                Role(body["r"]), body["t"], str(body["k"]), str(body["n"]), int(body["e"])
            )
        except (ValueError, KeyError, TypeError):
            return None
        return principal if self.holds(principal, now=now) else None

    def holds(self, principal: Principal, *, now: datetime) -> bool:
        """Whether a login is unexpired and its key still configured."""
        return principal.expires > now.timestamp() and _still_configured(self.settings, principal)

    def csrf(self, principal: Principal) -> str:
        """The token every form of this login carries: bound to its nonce."""
        return self._mac("csrf", principal.nonce.encode())

    def login_csrf(self, nonce: str) -> str:
        """The sign-in form's token, bound to the nonce of the form's cookie. Without it a
        page on another site could post its own key to ``/login`` and sign the browser in
        as the attacker (login CSRF): the operator then typed into an attacker's tenant."""
        return self._mac("login", nonce.encode("utf-8", "surrogateescape"))

    def login_csrf_ok(self, nonce: str | None, token: str | None) -> bool:
        if not nonce or token is None or len(nonce) > 64:
            return False
        return hmac.compare_digest(
            self.login_csrf(nonce).encode(), token.encode("utf-8", "surrogateescape")
        )

    def csrf_ok(self, principal: Principal, token: str | None) -> bool:
        return token is not None and hmac.compare_digest(
            self.csrf(principal).encode(), token.encode("utf-8", "surrogateescape")
        )
