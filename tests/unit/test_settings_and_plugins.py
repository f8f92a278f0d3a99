"""Configuration: typed, from a file and the environment, secrets hidden and resolved late."""

from __future__ import annotations

from pathlib import Path

import pytest

from storage import keys
from storage.factory import check_embedded_allowed
from torpor.errors import (
    ConfigError,
    EmbeddedBackendOnCluster,
    InvalidKey,
    PluginNotFound,
    WebhookSecretInvalid,
)
from torpor.plugins import PluginResolver, load_object, resolve_env
from torpor.settings import Settings, resolve_secret


def test_defaults_are_embedded() -> None:
    settings = Settings.build({})
    assert settings.embedded
    check_embedded_allowed(settings, alive_nodes=1)
    with pytest.raises(EmbeddedBackendOnCluster, match="3 nodes"):
        check_embedded_allowed(settings, alive_nodes=3)
    remote = Settings.build(
        {"storage": {"object_store_url": "s3://b/p", "index_url": "redis://r:6379/0"}}
    )
    check_embedded_allowed(remote, alive_nodes=3)


def test_environment_overrides_file(tmp_path: Path) -> None:
    config = tmp_path / "torpor.toml"
    config.write_text(
        '[storage]\nindex_url = "sqlite://x.db"\n[storage.s3]\nregion = "eu"\n'
        "[lease]\nttl_s = 30\nheartbeat_s = 10\n"
    )
    env = {
        "TORPOR_CONFIG": str(config),
        "TORPOR_STORAGE__INDEX_URL": "redis://h:1/0",
        "TORPOR_NOTIFICATIONS__ALLOW_PRIVATE_CALLBACKS": "true",
        "TORPOR_STORAGE__S3__ENDPOINT_URL": "http://minio:9000",
        "TORPOR_LEASE__HEARTBEAT_S": "5",
        "TORPOR_NAMESPACE": "prod",
    }
    settings = Settings.from_env(env)
    assert settings.storage.index_url == "redis://h:1/0"
    assert settings.lease.ttl_s == 30 and settings.notifications.allow_private_callbacks
    assert settings.lease.heartbeat_s == 5 and settings.namespace == "prod"
    assert (
        settings.storage.s3.region == "eu"
        and settings.storage.s3.endpoint_url == "http://minio:9000"
    )


def test_an_explicit_path_replaces_torpor_config(tmp_path: Path) -> None:
    chosen, other = tmp_path / "chosen.toml", tmp_path / "other.toml"
    chosen.write_text('namespace = "chosen"\n')
    other.write_text('namespace = "other"\n')
    settings = Settings.from_env({"TORPOR_CONFIG": str(other)}, config_path=chosen)
    assert settings.namespace == "chosen"


def test_configuration_written_for_0_1_still_loads_with_a_warning(tmp_path: Path) -> None:
    """The 0.1 test of file + environment, unchanged input: flat keys land in sections."""
    config = tmp_path / "torpor.toml"
    config.write_text(
        'index_url = "sqlite://x.db"\nlease_ttl_s = 30\nreplicas = 2\n[s3]\nregion = "eu"\n'
    )
    env = {
        "TORPOR_CONFIG": str(config),
        "TORPOR_INDEX_URL": "redis://h:1/0",
        "TORPOR_ALLOW_PRIVATE_CALLBACKS": "true",
        "TORPOR_S3_ENDPOINT_URL": "http://minio:9000",
    }
    with pytest.warns(DeprecationWarning) as caught:
        settings = Settings.from_env(env)
    assert settings.storage.index_url == "redis://h:1/0"
    assert settings.lease.ttl_s == 30 and settings.notifications.allow_private_callbacks
    assert (
        settings.storage.s3.region == "eu"
        and settings.storage.s3.endpoint_url == "http://minio:9000"
    )
    messages = {str(w.message) for w in caught}
    assert "torpor setting lease_ttl_s is deprecated; use lease.ttl_s" in messages
    assert "torpor setting s3 is deprecated; use storage.s3" in messages
    assert (
        "torpor environment variable TORPOR_INDEX_URL is deprecated; "
        "use TORPOR_STORAGE__INDEX_URL" in messages
    )
    assert any("replicas is ignored" in m and "Serve config" in m for m in messages)
    assert all("\n" not in m for m in messages)


def test_a_sectioned_key_wins_over_its_0_1_name() -> None:
    with pytest.warns(DeprecationWarning, match="heartbeat_s"):
        settings = Settings.build({"heartbeat_s": 1, "lease": {"heartbeat_s": 2}})
    assert settings.lease.heartbeat_s == 2


def test_bad_configuration_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        Settings.from_env({"TORPOR_CONFIG": str(tmp_path / "missing.toml")})
    bad = tmp_path / "bad.toml"
    bad.write_text("[lease]\nttl_s = [")
    with pytest.raises(ConfigError, match="not valid TOML"):
        Settings.from_env({"TORPOR_CONFIG": str(bad)})
    with pytest.raises(ConfigError, match=r"lease\.ttl_s") as caught:
        Settings.build({"lease": {"ttl_s": -1}})
    assert "\n" not in str(caught.value)
    with pytest.raises(ConfigError, match=r"pool\.size"):
        Settings.from_env({"TORPOR_POOL__SIZE": "many"})
    with pytest.raises(ConfigError, match="nope"):
        Settings.build({"storage": {"nope": 1}})


def test_secrets_resolve_from_the_environment_and_never_print() -> None:
    settings = Settings.build(
        {"security": {"capability_keys": ["env:CAP"]}, "notifications": {"key": "literal-secret"}}
    )
    assert "literal-secret" not in repr(settings) and "literal-secret" not in str(settings)
    assert resolve_secret(settings.security.capability_keys[0], {"CAP": "k"}) == "k"
    with pytest.raises(ConfigError, match="CAP"):
        resolve_secret(settings.security.capability_keys[0], {})


@pytest.mark.parametrize(
    "url",
    [
        "redis://:pw-in-userinfo@redis.internal:6379/0",
        "rediss://torpor:pw-in-userinfo@redis.internal:6380/1",
        "redis://redis.internal:6379/0?password=pw-in-query",
    ],
)
def test_a_password_in_the_index_url_never_prints_with_the_settings(url: str) -> None:
    # A plain str field: repr(settings), or a log line holding the settings, showed the
    # Redis password whole.
    settings = Settings.build({"storage": {"index_url": url}})
    for shown in (repr(settings), str(settings), repr(settings.storage), str(settings.storage)):
        assert "pw-in-" not in shown, shown
        assert "redis.internal" in shown  # still says where the index is
    assert settings.storage.index_url == url  # the value itself is unchanged for its users


def test_plugin_options_resolve_env_references(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLM_KEY", "sk-test")
    assert resolve_env({"api_key": "env:LLM_KEY", "n": [1, "env:LLM_KEY"]}) == {
        "api_key": "sk-test",
        "n": [1, "sk-test"],
    }
    with pytest.raises(ConfigError, match="NOPE"):
        resolve_env("env:NOPE")


def test_plugins_load_by_import_path_with_clear_errors() -> None:
    assert load_object("torpor.agents.plan:PlanAgent").__name__ == "PlanAgent"
    for bad in ("torpor.agents.plan", "no.such.module:x", "torpor.agents.plan:Nope"):
        with pytest.raises(PluginNotFound):
            load_object(bad)
    settings = Settings.build(
        {
            "agents": {
                "demo": {
                    "factory": "torpor.agents.plan:PlanAgent",
                    "options": {"plan": {"steps": [{"id": "done", "finish": "ok"}]}},
                    "tools": ["torpor.demo.tools:tools"],
                    "tool_options": {"torpor.demo.tools:tools": {"simulator_url": "http://x"}},
                }
            }
        }
    )
    loaded = PluginResolver(settings).agent("demo")
    assert {s.name for s in loaded.tools.specs()} == {
        "extract_fields",
        "request_approval",
        "create_purchase_order",
    }
    with pytest.raises(PluginNotFound, match="known: demo"):
        PluginResolver(settings).agent("other")
    broken = Settings.build(
        {
            "agents": {
                "x": {"factory": "torpor.agents.plan:PlanAgent", "options": {"plan": {"steps": []}}}
            }
        }
    )
    with pytest.raises(ConfigError):
        PluginResolver(broken).agent("x")


@pytest.mark.parametrize("name", ["torpor", "capability"])
def test_a_source_may_not_take_a_reserved_event_source_name(name: str) -> None:
    source = {"tenant": "acme", "secrets": ["s" * 32]}
    with pytest.raises(ConfigError, match="reserved") as refused:
        Settings.build({"sources": {name: source}})
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("tolerance_s", ["nan", "inf", "-inf", -1, 0, 2 * 86_400, 1e20])
def test_a_sources_timestamp_window_is_finite_and_positive(tolerance_s: object) -> None:
    # NaN turned the window off (every comparison with it is false); 1e20 overflowed the
    # replay claims' TTL, failing every delivery after its signature was checked.
    source = {"tenant": "acme", "secrets": ["s" * 32], "tolerance_s": tolerance_s}
    with pytest.raises(ConfigError, match=r"tolerance_s"):
        Settings.build({"sources": {"oa": source}})


@pytest.mark.parametrize(
    ("scheme", "secret", "problem"),
    [
        ("standard", "whsec_not*base64!", "not valid base64"),
        ("standard", "whsec_", "empty"),
        ("torpor", "", "empty"),
        ("stripe", "", "empty"),
        ("github", "", "empty"),
    ],
)
def test_a_source_secret_no_delivery_could_verify_with_is_refused_at_load(
    scheme: str, secret: str, problem: str
) -> None:
    # It was accepted, and every delivery to the source then failed with a 500.
    source = {"tenant": "acme", "scheme": scheme, "secrets": ["s" * 32, secret]}
    with pytest.raises(ConfigError, match=rf"sources\.oa\.secrets.*#1 is {problem}") as refused:
        Settings.build({"sources": {"oa": source}})
    assert "not*base64" not in str(refused.value)


def test_a_source_secret_from_the_environment_is_checked_where_it_is_resolved() -> None:
    # The loading process may not have the variable: refused only once it resolves.
    settings = Settings.build(
        {"sources": {"oa": {"tenant": "acme", "scheme": "standard", "secrets": ["env:TP_NONE"]}}}
    )
    with pytest.raises(WebhookSecretInvalid, match=r"source 'oa'.*TP_NONE"):
        settings.sources["oa"].secret_values("oa")


@pytest.mark.parametrize("max_body_bytes", [0, -1])
def test_a_sources_body_limit_is_positive(max_body_bytes: int) -> None:
    # 0 was accepted and refused every delivery as too large (413).
    source = {"tenant": "acme", "secrets": ["s" * 32], "max_body_bytes": max_body_bytes}
    with pytest.raises(ConfigError, match=r"sources\.oa\.max_body_bytes"):
        Settings.build({"sources": {"oa": source}})
    assert Settings.build({"sources": {"oa": {**source, "max_body_bytes": 1}}})


def test_a_capability_key_shorter_than_16_bytes_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # It was accepted, and every session that suspended then failed to mint its link.
    with pytest.raises(ConfigError, match=r"capability_keys.*#1 must be at least 16 bytes"):
        Settings.build({"security": {"capability_keys": ["k" * 16, "k" * 15]}})
    # An env: key is checked where it resolves: when a process opens its services.
    settings = Settings.build({"security": {"capability_keys": ["env:TP_TEST_CAP"]}})
    monkeypatch.setenv("TP_TEST_CAP", "k" * 15)
    with pytest.raises(WebhookSecretInvalid, match="#0 must be at least 16 bytes"):
        settings.capability_key_bytes()
    monkeypatch.setenv("TP_TEST_CAP", "é" * 8)  # bytes, not characters
    assert settings.capability_key_bytes() == ["é".encode() * 8]


@pytest.mark.parametrize(
    "name", ["my source", "é", "a/b", ".", "..", "x" * 129, "line\n", "", "ok-name_1.v2", "x" * 128]
)
def test_a_source_name_is_held_to_the_object_key_alphabet_at_load(name: str) -> None:
    # A name outside it was accepted, and every delivery failed once its signature had
    # passed, when the replay marker's key (storage.keys.safe) refused the name.
    source = {"tenant": "acme", "secrets": ["s" * 32]}
    try:
        keys.accepted_content(name, "0" * 64)
    except InvalidKey:
        with pytest.raises(ConfigError, match="source name") as refused:
            Settings.build({"sources": {name: source}})
        assert "\n" not in str(refused.value)
    else:
        assert name in Settings.build({"sources": {name: source}}).sources


SHARED = "shared-webhook-secret-0123456789"
STANDARD_KEY = "c2hhcmVkLXdlYmhvb2sta2V5LWJ5dGVzLTAxMjM0NTY3"  # base64 of 33 bytes


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (("torpor", SHARED), ("stripe", SHARED)),  # both sign hex HMAC of timestamp.body
        (("stripe", SHARED), ("stripe", SHARED)),
        (("standard", "whsec_" + STANDARD_KEY), ("standard", STANDARD_KEY + "=")),  # one key
        (("torpor", "env:TP_HOOK_SECRET"), ("stripe", "env:TP_HOOK_SECRET")),
    ],
)
def test_two_sources_that_would_accept_each_others_deliveries_are_refused(
    a: tuple[str, str], b: tuple[str, str]
) -> None:
    # Replay claims are per source: a delivery accepted by one was accepted again by the
    # other. The error names the sources, never the secret.
    sources = {
        "one": {"tenant": "acme", "scheme": a[0], "secrets": ["x" * 32, a[1]]},
        "two": {"tenant": "beta", "scheme": b[0], "secrets": [b[1]]},
    }
    with pytest.raises(ConfigError, match="sources 'one' and 'two' share a secret") as refused:
        Settings.build({"sources": sources})
    assert SHARED not in str(refused.value) and STANDARD_KEY not in str(refused.value)


@pytest.mark.parametrize("other", ["github", "standard"])
def test_sources_signing_different_bytes_may_share_a_secret(other: str) -> None:
    secret = "whsec_" + STANDARD_KEY
    sources = {
        "one": {"tenant": "acme", "scheme": "torpor", "secrets": [secret, secret]},
        "two": {"tenant": "acme", "scheme": other, "secrets": [secret]},
    }
    assert set(Settings.build({"sources": sources}).sources) == {"one", "two"}
