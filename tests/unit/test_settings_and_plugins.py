"""Configuration: typed, from a file and the environment, secrets hidden and resolved late."""

from __future__ import annotations

from pathlib import Path

import pytest

from storage.factory import check_embedded_allowed
from torpor.errors import ConfigError, EmbeddedBackendOnCluster, PluginNotFound
from torpor.plugins import PluginResolver, load_object, resolve_env
from torpor.settings import Settings, resolve_secret


def test_defaults_are_embedded() -> None:
    settings = Settings()
    assert settings.embedded
    check_embedded_allowed(settings, alive_nodes=1)
    with pytest.raises(EmbeddedBackendOnCluster, match="3 nodes"):
        check_embedded_allowed(settings, alive_nodes=3)
    remote = Settings(object_store_url="s3://b/p", index_url="redis://r:6379/0")
    check_embedded_allowed(remote, alive_nodes=3)


def test_environment_overrides_file(tmp_path: Path) -> None:
    config = tmp_path / "torpor.toml"
    config.write_text('index_url = "sqlite://x.db"\nlease_ttl_s = 30\n[s3]\nregion = "eu"\n')
    env = {
        "TORPOR_CONFIG": str(config),
        "TORPOR_INDEX_URL": "redis://h:1/0",
        "TORPOR_ALLOW_PRIVATE_CALLBACKS": "true",
        "TORPOR_S3_ENDPOINT_URL": "http://minio:9000",
    }
    settings = Settings.from_env(env)
    assert settings.index_url == "redis://h:1/0"
    assert settings.lease_ttl_s == 30 and settings.allow_private_callbacks
    assert settings.s3.region == "eu" and settings.s3.endpoint_url == "http://minio:9000"


def test_bad_configuration_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        Settings.from_env({"TORPOR_CONFIG": str(tmp_path / "missing.toml")})
    bad = tmp_path / "bad.toml"
    bad.write_text("lease_ttl_s = [")
    with pytest.raises(ConfigError, match="not valid TOML"):
        Settings.from_env({"TORPOR_CONFIG": str(bad)})
    with pytest.raises(ConfigError, match="lease_ttl_s"):
        Settings.build({"lease_ttl_s": -1})


def test_secrets_resolve_from_the_environment_and_never_print() -> None:
    settings = Settings.build({"capability_keys": ["env:CAP"], "notify_key": "literal-secret"})
    assert "literal-secret" not in repr(settings) and "literal-secret" not in str(settings)
    assert resolve_secret(settings.capability_keys[0], {"CAP": "k"}) == "k"
    with pytest.raises(ConfigError, match="CAP"):
        resolve_secret(settings.capability_keys[0], {})


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
