"""What Ray would persist as actor and replica arguments holds no secret value."""

from __future__ import annotations

from pathlib import Path

import pytest
from ray import cloudpickle

from actors.config_ref import ConfigRef, settings_digest
from torpor.errors import ConfigError
from torpor.settings import Settings

SECRET = "s3cr3t-value-that-must-not-persist"


def persisted(*args: object) -> bytes:
    """The bytes Ray keeps in its control store for ``.remote(*args)`` / ``.bind(*args)``."""
    return cloudpickle.dumps(args)


def test_the_serve_app_built_from_a_file_carries_the_path_not_the_secrets(
    tmp_path: Path,
) -> None:
    from ray.serve._private.build_app import build_app as serve_build

    from serve_app import AppArgs, build_app

    toml = tmp_path / "torpor.toml"
    toml.write_text(
        f'[security]\ncapability_keys = ["{SECRET}"]\n'
        f'[storage]\nindex_url = "redis://:{SECRET}@127.0.0.1:6379/0"\n'
    )
    built = serve_build(build_app(AppArgs(config=str(toml))), name="torpor")
    for deployment in built.deployments:
        data = persisted(deployment.init_args, deployment.init_kwargs)
        assert SECRET.encode() not in data, deployment.name
    replica = ConfigRef.from_file(str(toml)).load()  # what a replica reads for itself
    assert replica.capability_key_bytes() == [SECRET.encode()]


def test_settings_with_env_references_travel_and_resolve_where_used(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = Settings.build(
        {
            "security": {"capability_keys": ["env:TP_TEST_CAP"], "audit_key": "env:TP_TEST_AU"},
            "storage": {"index_url": "env:TP_TEST_REDIS"},
            "sources": {"oa": {"tenant": "a", "secrets": ["env:TP_TEST_SRC"]}},
        }
    )
    ref = ConfigRef.of(settings)
    monkeypatch.setenv("TP_TEST_CAP", SECRET)  # set in the actor's process only
    data = persisted(ref, "session-id")
    assert SECRET.encode() not in data
    loaded = cloudpickle.loads(data)[0].load()
    assert loaded.capability_key_bytes() == [SECRET.encode()]
    assert loaded.sources["oa"].secrets[0].get_secret_value() == "env:TP_TEST_SRC"


@pytest.mark.parametrize(
    "data",
    [
        {"security": {"capability_keys": [SECRET]}},
        {"security": {"audit_key": SECRET}},
        {"notifications": {"key": SECRET}},
        {"sources": {"oa": {"tenant": "a", "secrets": [SECRET]}}},
        {"storage": {"s3": {"secret_access_key": SECRET}}},
        {"storage": {"index_url": f"redis://:{SECRET}@127.0.0.1:6379/0"}},
        # redis-py takes the password from the query too
        {"storage": {"index_url": f"redis://127.0.0.1:6379/0?password={SECRET}"}},
    ],
)
def test_an_inline_secret_is_refused_at_the_ray_boundary(data: dict[str, object]) -> None:
    from serve_app import application

    with pytest.raises(ConfigError, match="env:NAME"):
        ConfigRef.of(Settings.build(data))
    with pytest.raises(ConfigError):
        application(Settings.build(data))


def test_tests_may_opt_in_to_inline_secrets() -> None:
    settings = Settings.build(
        {"security": {"capability_keys": [SECRET], "inline_secrets_in_ray": True}}
    )
    assert ConfigRef.of(settings).load() == settings


def test_settings_read_from_a_file_with_inline_secrets_travel_as_the_path(
    tmp_path: Path,
) -> None:
    toml = tmp_path / "torpor.toml"
    toml.write_text(f'[security]\ncapability_keys = ["{SECRET}"]\n')
    settings = Settings.from_env({}, config_path=toml)
    ref = ConfigRef.of_loaded(settings, str(toml))
    assert SECRET.encode() not in persisted(ref)
    assert ref.load().capability_key_bytes() == [SECRET.encode()]
    plain = Settings.from_env({"TORPOR_NAMESPACE": "n1"})  # nothing secret: as data
    assert ConfigRef.of_loaded(plain).load().namespace == "n1"


def test_the_settings_digest_tells_apart_any_change_and_only_a_change(
    tmp_path: Path,
) -> None:
    """A restarted holder inherits a standby only if both run on the same settings: the
    digest is the same for the same settings however they travelled, and differs for a
    changed default, a changed secret, a changed file."""
    base = {"security": {"capability_keys": ["env:TP_TEST_CAP"]}}
    settings = Settings.build(base)
    digest = settings_digest(settings)
    assert settings_digest(Settings.build(base)) == digest
    travelled = cloudpickle.loads(persisted(ConfigRef.of(settings)))[0].load()
    assert settings_digest(travelled) == digest
    renamed = {"security": {"capability_keys": ["env:TP_TEST_CAP_2"]}}
    assert settings_digest(Settings.build(renamed)) != digest
    slower = {**base, "runtime": {"standby_idle_s": 30.0}}
    assert settings_digest(Settings.build(slower)) != digest
    # Every field counts, set or left at its default: the same values, the same digest.
    spelled_out = {**base, "runtime": {"standby_idle_s": Settings.build({}).runtime.standby_idle_s}}
    assert settings_digest(Settings.build(spelled_out)) == digest
    inline = settings_digest(Settings.build({"security": {"capability_keys": [SECRET]}}))
    rotated = {"security": {"capability_keys": [SECRET + "-2"]}}
    assert settings_digest(Settings.build(rotated)) != inline
    toml = tmp_path / "torpor.toml"
    toml.write_text("[runtime]\nstandby_idle_s = 30.0\n")
    before = settings_digest(ConfigRef.from_file(str(toml)).load())
    toml.write_text("[runtime]\nstandby_idle_s = 60.0\n")
    assert settings_digest(ConfigRef.from_file(str(toml)).load()) != before


LLM = {"factory": "torpor.agents.openai_agent:OpenAIAgent"}


@pytest.mark.parametrize(
    "agent",
    [
        {**LLM, "options": {"api_key": SECRET}},
        {**LLM, "options": {"extra_headers": {"x-api-key": SECRET}}},
        {**LLM, "tool_options": {"my.tools:Erp": {"client": {"password": SECRET}}}},
        {**LLM, "tool_options": {"my.tools:Erp": {"auth_token": SECRET}}},
    ],
    ids=["api_key", "header", "nested-password", "token"],
)
def test_a_key_written_in_an_agents_options_is_refused_at_the_ray_boundary(
    agent: dict[str, object],
) -> None:
    """Options are plain data: an LLM key written in them went to Ray's control store with
    the actors' arguments, where every SecretStr and storage URL is checked."""
    with pytest.raises(ConfigError, match="env:NAME"):
        ConfigRef.of(Settings.build({"agents": {"assistant": agent}}))


def test_options_named_like_keys_but_not_secrets_travel() -> None:
    options = {
        "api_key": "env:LLM_KEY",
        "business_key_path": "doc_id",
        "max_tokens": 512,
        "token": "",
    }
    ref = ConfigRef.of(Settings.build({"agents": {"assistant": {**LLM, "options": options}}}))
    assert ref.load().agents["assistant"].options == options
