"""The deployment files parse and point at the real app."""

from __future__ import annotations

import importlib
import warnings
from pathlib import Path

import pytest
import yaml

from serve_app import AppArgs
from torpor.entry.ingress import HOOKS_FIRST, SERVER_MIDDLEWARES, USER_LOOP
from torpor.settings import Placement, Settings, load_toml

ROOT = Path(__file__).resolve().parents[2]


def _app_import(path: str) -> object:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def test_cluster_yaml_is_a_launcher_config_that_installs_torpor() -> None:
    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    assert config["provider"]["type"] == "aws"
    assert config["head_node_type"] in config["available_node_types"]
    assert all("node_config" in t for t in config["available_node_types"].values())
    setup = " ".join(config["setup_commands"])
    assert "pip install" in setup and "/home/ubuntu/torpor" in setup
    assert any("ray start --head" in c for c in config["head_start_ray_commands"])
    assert "install -y -q haproxy" in setup  # on every node: each runs a Serve proxy
    for node in ("head_start_ray_commands", "worker_start_ray_commands"):
        # Read by each replica's own process: an ingress replica on a worker without it
        # would not open the port HAProxy routes to.
        assert any("RAY_SERVE_ENABLE_HA_PROXY=1" in c for c in config[node])
        assert any("RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0" in c for c in config[node])
        assert any(f"{SERVER_MIDDLEWARES}={HOOKS_FIRST}" in c for c in config[node])
    assert any("ray start --address" in c for c in config["worker_start_ray_commands"])
    assert "." in config["file_mounts"].values()


def test_serve_config_names_the_app_builder_and_its_deployments() -> None:
    config = yaml.safe_load((ROOT / "deploy" / "serve_config.yaml").read_text())
    [app] = config["applications"]
    assert app["import_path"] == "serve_app:build_app"
    assert callable(_app_import(app["import_path"]))
    AppArgs.model_validate(app["args"])
    assert [d["name"] for d in app["deployments"]] == ["Ingress", "ReconcilerStarter"]


def test_rayservice_manifest_embeds_a_valid_serve_config() -> None:
    docs = list(yaml.safe_load_all((ROOT / "deploy" / "rayservice.yaml").read_text()))
    kinds = {d["kind"] for d in docs}
    assert kinds == {"ConfigMap", "RayService"}
    service = next(d for d in docs if d["kind"] == "RayService")
    serve_config = yaml.safe_load(service["spec"]["serveConfigV2"])
    [app] = serve_config["applications"]
    assert app["import_path"] == "serve_app:build_app"
    assert AppArgs.model_validate(app["args"]).config == "/etc/torpor/torpor.toml"
    cluster = service["spec"]["rayClusterConfig"]
    env = {
        e["name"]: e.get("value")
        for e in cluster["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]
    }
    # HAProxy, the app on the replica's loop, and webhooks before Serve's wrappers: on
    # every pod (the workers share the head's list).
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1" and env[USER_LOOP] == "0"
    assert env[SERVER_MIDDLEWARES] == HOOKS_FIRST
    worker_env = cluster["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["env"]
    assert {e["name"]: e.get("value") for e in worker_env} == env
    assert cluster["workerGroupSpecs"][0]["maxReplicas"] >= 1
    config_map = next(d for d in docs if d["kind"] == "ConfigMap")
    import tomllib

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # written in the current form: no deprecation
        settings = Settings.build(tomllib.loads(config_map["data"]["torpor.toml"]))
    assert settings.storage.object_store_url.startswith("s3://")


def test_example_configuration_is_valid_settings() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # written in the current form: no deprecation
        settings = Settings.build(load_toml(ROOT / "deploy" / "torpor.example.toml"))
    assert settings.storage.index_url.startswith("redis://")
    assert settings.agents["procurement"].placement is Placement.POOLED
    assert settings.sources["oa"].mapping is not None
    # secrets stay references until used, and never print
    assert "env:" in settings.sources["oa"].secrets[0].get_secret_value()
    assert "OA_WEBHOOK_SECRET" not in repr(settings)


def test_app_args_refuse_unknown_keys() -> None:
    with pytest.raises(ValueError, match="replicas"):
        AppArgs.model_validate({"config": "x.toml", "replicas": 2})
