"""Console logins: a cookie names its principal only while intact, unexpired and its key
is still configured; a CSRF token belongs to one login."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from torpor.auth import new_api_key
from torpor.entry.console.login import LIFETIME, CookieSigner, Role, authenticate
from torpor.errors import ConfigError
from torpor.settings import Settings

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def settings(
    operator_hash: str, acme_hash: str, *, key: str = "console-key-0123456789"
) -> Settings:
    return Settings.build(
        {
            "security": {"operator_keys": [operator_hash], "console_key": key},
            "tenants": {"acme": {"api_keys": [acme_hash]}},
        }
    )


def test_keys_name_their_role_and_tenant() -> None:
    op_key, op_hash = new_api_key()
    acme_key, acme_hash = new_api_key()
    s = settings(op_hash, acme_hash)
    op = authenticate(s, op_key, now=NOW)
    assert op is not None and op.role is Role.OPERATOR and op.tenant is None
    assert op.tenants(s) == ["acme"]
    tenant = authenticate(s, acme_key, now=NOW)
    assert tenant is not None and tenant.role is Role.TENANT and tenant.tenant == "acme"
    assert authenticate(s, "tpk_not-a-key", now=NOW) is None
    assert authenticate(s, "", now=NOW) is None


def test_a_cookie_opens_only_while_intact_unexpired_and_configured() -> None:
    op_key, op_hash = new_api_key()
    _, acme_hash = new_api_key()
    s = settings(op_hash, acme_hash)
    signer = CookieSigner(s)
    principal = authenticate(s, op_key, now=NOW)
    assert principal is not None
    cookie = signer.issue(principal)
    assert signer.open(cookie, now=NOW) == principal
    assert op_key not in cookie  # the key itself never travels again

    payload, mac = cookie.rsplit(".", 1)
    assert signer.open(payload + "." + ("0" if mac[0] != "0" else "1") + mac[1:], now=NOW) is None
    assert signer.open(payload[:-2] + "." + mac, now=NOW) is None
    # Anyone may send any cookie, logged in or not: a non-ASCII one opens nothing (two
    # str compared by compare_digest raised TypeError, a 500 on every console page).
    for odd in ["\u00e9", "\udce9", "\u00e9" * 43]:
        assert signer.open(payload + "." + odd, now=NOW) is None
        assert signer.open("e30." + odd, now=NOW) is None
    assert signer.open(cookie, now=NOW + LIFETIME + timedelta(seconds=1)) is None
    # Another deployment's console key does not vouch for it.
    other = CookieSigner(settings(op_hash, acme_hash, key="another-console-key-000"))
    assert other.open(cookie, now=NOW) is None
    # The operator key removed from the configuration: its logins end at once.
    _, new_hash = new_api_key()
    assert CookieSigner(settings(new_hash, acme_hash)).open(cookie, now=NOW) is None


def test_a_csrf_token_belongs_to_one_login() -> None:
    op_key, op_hash = new_api_key()
    _, acme_hash = new_api_key()
    s = settings(op_hash, acme_hash)
    signer = CookieSigner(s)
    first = authenticate(s, op_key, now=NOW)
    second = authenticate(s, op_key, now=NOW)
    assert first is not None and second is not None
    assert signer.csrf_ok(first, signer.csrf(first))
    assert not signer.csrf_ok(first, signer.csrf(second))
    assert not signer.csrf_ok(first, None)
    assert not signer.csrf_ok(first, "")
    # The form is the sender's: a non-ASCII token is wrong, not a TypeError (a 500).
    assert not signer.csrf_ok(first, "\u00e9")
    assert not signer.csrf_ok(first, "\udce9")


def test_a_console_key_too_short_to_sign_with_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every console user holds a cookie signed with it, payload and MAC: a short key is
    # found offline from a tenant's own login, and then signs an operator's cookie.
    op_key, op_hash = new_api_key()
    _, acme_hash = new_api_key()
    with pytest.raises(ConfigError, match="console_key") as refused:
        settings(op_hash, acme_hash, key="hunter2")
    assert "hunter2" not in str(refused.value)  # named, never shown
    # An `env:` key is checked where it resolves: when the console's signer is made.
    monkeypatch.setenv("TORPOR_TEST_CONSOLE_KEY", "hunter2")
    later = settings(op_hash, acme_hash, key="env:TORPOR_TEST_CONSOLE_KEY")
    with pytest.raises(ConfigError, match="console_key"):
        CookieSigner(later)
    monkeypatch.setenv("TORPOR_TEST_CONSOLE_KEY", "a-console-key-of-32-bytes-000000")
    principal = authenticate(later, op_key, now=NOW)
    assert principal is not None
    signer = CookieSigner(later)
    assert signer.open(signer.issue(principal), now=NOW) == principal
