"""Every duration and count a deployment sets is refused at load when no process could
run with it: a clear ``ConfigError`` naming the setting, not a sweeper that spins, a
lease that expires between its heartbeats, or deliveries that all fail as dead letters."""

from __future__ import annotations

from typing import Any

import pytest

from torpor.auth import new_api_key
from torpor.errors import ConfigError
from torpor.settings import Settings

# (section, field): each refuses NaN, infinity, a negative value and zero.
POSITIVE = [
    ("lease", "heartbeat_s"),
    ("reconciler", "interval_s"),
    ("reconciler", "poll_backoff_base_s"),
    ("reconciler", "poll_backoff_cap_s"),
    ("reconciler", "wake_grace_s"),
    ("reconciler", "full_repair_interval_s"),
    ("reconciler", "deadline_interval_s"),
    ("notifications", "timeout_s"),
    ("runtime", "tool_timeout_s"),
    ("runtime", "agent_step_timeout_s"),
    ("runtime", "activation_max_s"),
    ("runtime", "retry_backoff_base_s"),
    ("runtime", "retry_backoff_cap_s"),
    ("runtime", "max_live_session_actors"),
    ("storage", "index_buckets"),
    ("storage", "index_deadline_shards"),
    ("storage", "retention_per_sweep"),
    ("security", "max_request_bytes"),
    ("pool", "size"),
    ("pool", "max_concurrency"),
]
# These may be zero (0 means none, or "never" as documented), never negative.
NATURAL = [
    ("storage", "binding_grace_s"),
    ("security", "max_streams_per_tenant"),
    ("runtime", "standby_session_actors"),
]


def build(section: str, field: str, value: Any) -> Settings:
    return Settings.build({section: {field: value}})


@pytest.mark.parametrize(("section", "field"), POSITIVE)
@pytest.mark.parametrize("value", ["nan", "inf", -1, 0])
def test_a_setting_that_must_be_positive_refuses_what_is_not(
    section: str, field: str, value: Any
) -> None:
    if not field.endswith("_s") and isinstance(value, str):
        value = -5  # a count: NaN and infinity are no integers, refused as such anyway
    with pytest.raises(ConfigError, match=rf"{section}\.{field}"):
        build(section, field, value)


@pytest.mark.parametrize(("section", "field"), NATURAL)
def test_a_setting_that_may_be_zero_refuses_less(section: str, field: str) -> None:
    build(section, field, 0)
    with pytest.raises(ConfigError, match=rf"{section}\.{field}"):
        build(section, field, -1)


def test_activations_in_flight_may_be_none_never_fewer() -> None:
    # 0: every activation is left to the reconciler (the benchmarks' deferred phase).
    Settings.build({"max_inflight_activations": 0})
    with pytest.raises(ConfigError, match="max_inflight_activations"):
        Settings.build({"max_inflight_activations": -3})


def test_an_agents_tool_retries_are_not_negative() -> None:
    agent: dict[str, Any] = {"factory": "x.y:z", "max_tool_retries": -1}
    with pytest.raises(ConfigError, match="max_tool_retries"):
        Settings.build({"agents": {"a": agent}})


def test_a_binding_grace_past_any_date_is_refused() -> None:
    # A deadline plus a grace of 10,000 years is no date: every bind raised OverflowError.
    with pytest.raises(ConfigError, match="binding_grace_s"):
        build("storage", "binding_grace_s", 10_000 * 365 * 24 * 3600)


def test_a_heartbeat_not_shorter_than_its_lease_is_refused() -> None:
    """A holder renews its lease every ``heartbeat_s``: at or past ``ttl_s`` the lease
    expired between two renewals, and every long activation lost its lease (LEASE_LOST)
    to the reconciler's recovery, over and over."""
    Settings.build({"lease": {"ttl_s": 30, "heartbeat_s": 10}})
    for heartbeat in (30, 45):
        with pytest.raises(ConfigError, match="heartbeat_s"):
            Settings.build({"lease": {"ttl_s": 30, "heartbeat_s": heartbeat}})


def test_a_backoff_cap_below_its_base_is_refused() -> None:
    with pytest.raises(ConfigError, match="poll_backoff_cap_s"):
        Settings.build({"reconciler": {"poll_backoff_base_s": 60, "poll_backoff_cap_s": 10}})
    with pytest.raises(ConfigError, match="retry_backoff_cap_s"):
        Settings.build({"runtime": {"retry_backoff_base_s": 60, "retry_backoff_cap_s": 10}})


def test_one_api_key_under_two_tenants_is_refused() -> None:
    # The key's holder was taken for whichever tenant came last in the file, and read and
    # changed that tenant's sessions, batches and deliveries.
    _, hashed = new_api_key()
    with pytest.raises(ConfigError, match="'acme' and 'beta'"):
        Settings.build(
            {"tenants": {"acme": {"api_keys": [hashed]}, "beta": {"api_keys": [hashed]}}}
        )
    Settings.build({"tenants": {"acme": {"api_keys": [hashed]}, "beta": {"api_keys": []}}})


@pytest.mark.parametrize("name", ["acme corp", "a/b", "..", "ü", "a" * 129])
def test_a_tenant_name_that_cannot_name_objects_is_refused(name: str) -> None:
    # A tenant's name is part of its object keys (submit keys, deliveries): one outside
    # their alphabet was accepted here, and then every submit of it with an
    # Idempotency-Key was refused (400 Invalid identifier) after its claim was taken.
    with pytest.raises(ConfigError, match="tenant name"):
        Settings.build({"tenants": {name: {"api_keys": []}}})


@pytest.mark.parametrize("name", ["", "acme corp", "a/b", "..", "a" * 129])
def test_a_source_speaking_for_a_tenant_no_api_tenant_could_be_is_refused(name: str) -> None:
    # As the API's tenants are named: the tenant names objects in storage, and "" is the
    # session registry's "tenant not known" (a session whose snapshot's header did not
    # read). A source for "" was accepted, and its events bound to that tenant.
    source = {"tenant": name, "secrets": ["s" * 32]}
    with pytest.raises(ConfigError, match="tenant"):
        Settings.build({"sources": {"erp": source}})
    Settings.build({"sources": {"erp": {**source, "tenant": "acme"}}})
