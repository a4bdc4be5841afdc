"""The deployment material that cannot run on this machine (no Docker engine, no GPU, no cluster) is still
checked: it parses, names what the stack needs, keeps telemetry off and authentication on, and points at code
that exists."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest
import yaml

from tasks.config import load_config

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"


def test_compose_stack_has_every_service_with_auth_and_telemetry_off() -> None:
    compose = yaml.safe_load((INFRA / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"postgres", "minio", "prefect-server", "mlflow", "cpu-worker", "gpu-worker"} <= set(services)
    assert "PREFECT_SERVER_API_AUTH_STRING" in services["prefect-server"]["environment"]
    assert "--app-name basic-auth" in services["mlflow"]["command"]
    assert "postgresql://" in services["mlflow"]["command"] and "s3://" in services["mlflow"]["command"]
    for name in ("prefect-server", "mlflow", "cpu-worker", "gpu-worker"):
        env = services[name]["environment"]
        assert env["PREFECT_SERVER_ANALYTICS_ENABLED"] == "false" and env["MLFLOW_DISABLE_TELEMETRY"] == "true", name
    for worker in ("cpu-worker", "gpu-worker"):
        env = services[worker]["environment"]
        assert env["PREFECT_API_AUTH_STRING"] and env["MLFLOW_TRACKING_PASSWORD"], worker
    gpu = services["gpu-worker"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["capabilities"] == ["gpu"]
    for service in services.values():
        dockerfile = service.get("build", {}).get("dockerfile")
        if dockerfile:
            assert ((INFRA / service["build"]["context"]) / dockerfile).resolve().is_file(), dockerfile


def test_gpu_worker_image_installs_the_gpu_extra() -> None:
    text = (INFRA / "docker" / "worker-gpu.Dockerfile").read_text()
    assert "nvidia/cuda" in text and '".[gpu]"' in text and "bubblewrap" in text


def test_kubernetes_job_template_requests_gpus() -> None:
    template = json.loads((INFRA / "k8s" / "gpu-job-template.json").read_text())
    container = template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "{{ gpus }}"
    assert template["variables"]["properties"]["gpus"]["default"] >= 1


@pytest.mark.parametrize("name", ["ddp", "zero2", "zero3"])
def test_accelerate_configs_parse(name: str) -> None:
    config = yaml.safe_load((INFRA / "accelerate" / f"{name}.yaml").read_text())
    assert config["distributed_type"] in ("MULTI_GPU", "DEEPSPEED") and config["mixed_precision"] == "bf16"


def test_prefect_yaml_entrypoints_exist_and_pools_are_named() -> None:
    spec = yaml.safe_load((INFRA / "prefect.yaml").read_text())
    for deployment in spec["deployments"]:
        path, _, function = deployment["entrypoint"].partition(":")
        module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
        assert callable(getattr(module, function)), deployment["name"]
        assert deployment["work_pool"]["name"] in ("grpoflow-cpu", "grpoflow-gpu")


@pytest.mark.parametrize("name", ["demo", "tiny", "humaneval", "gsm8k-qwen2.5-0.5b", "gsm8k-qwen2.5-1.5b-multigpu"])
def test_shipped_configs_validate(name: str) -> None:
    config = load_config(ROOT / "configs" / f"{name}.yaml")
    assert config.name


def test_scale_configs_use_vllm_and_a_gpu_deployment() -> None:
    single = load_config(ROOT / "configs" / "gsm8k-qwen2.5-0.5b.yaml")
    assert single.grpo.generation.backend == "vllm" and single.grpo.generation.vllm_mode == "colocate"
    # The recipe runs on the embedded defaults; the stack is an overlay that only adds its two settings.
    assert single.tracking.tracking_uri is None and single.orchestration.grpo_deployment is None
    stacked = load_config(ROOT / "configs" / "stack" / "gsm8k-qwen2.5-0.5b.yaml")
    assert stacked.orchestration.grpo_deployment == "grpoflow-grpo/grpo-gpu"
    assert stacked.tracking.tracking_uri == "http://mlflow:5000"
    raw_single, raw_stacked = single.model_dump(mode="json"), stacked.model_dump(mode="json")
    raw_stacked["orchestration"]["grpo_deployment"] = raw_single["orchestration"]["grpo_deployment"]
    raw_stacked["tracking"]["tracking_uri"] = raw_single["tracking"]["tracking_uri"]
    assert raw_stacked == raw_single
    multi = load_config(ROOT / "configs" / "gsm8k-qwen2.5-1.5b-multigpu.yaml")
    assert multi.grpo.generation.vllm_mode == "server" and multi.grpo.generation.vllm_server_base_url


def test_champion_watch_automation_is_a_valid_prefect_automation_on_its_events() -> None:
    from prefect.events.schemas.automations import AutomationCore

    spec = yaml.safe_load((INFRA / "automations" / "champion-watch.yaml").read_text())
    (automation,) = spec["automations"]
    parsed = AutomationCore.model_validate(automation)
    assert set(parsed.trigger.expect) == {"grpoflow.champion.regressed", "grpoflow.champion.rolled-back"}
    assert parsed.actions[0].type == "send-notification"
    daily = {d["name"]: d for d in yaml.safe_load((INFRA / "prefect.yaml").read_text())["deployments"]}["daily"]
    assert daily["entrypoint"] == "flows/watch.py:watch_flow" and daily["schedules"][0]["cron"] == "0 6 * * *"


def test_the_serve_service_and_deployment_follow_the_champion_behind_a_key_and_restart() -> None:
    compose = yaml.safe_load((INFRA / "docker-compose.yml").read_text())
    serve = compose["services"]["serve"]
    assert serve["command"].startswith("grpoflow serve ") and "--host 0.0.0.0" in serve["command"]
    assert "GRPOFLOW_SERVE_API_KEY:?" in (INFRA / "docker-compose.yml").read_text()  # no key, no start beyond loopback
    assert serve["environment"]["GRPOFLOW_SERVE_API_KEY"] and serve["restart"] == "unless-stopped"
    assert "/health" in " ".join(serve["healthcheck"]["test"])
    assert "GRPOFLOW_SERVE_API_KEY=" in (INFRA / ".env.example").read_text()
    spec = yaml.safe_load((INFRA / "prefect.yaml").read_text())
    deployment = {d["name"]: d for d in spec["deployments"]}["champion"]
    assert deployment["entrypoint"] == "flows/serve.py:serve_flow" and deployment["parameters"]["alias"] == "champion"


def test_prefect_yaml_names_the_locked_prefect() -> None:
    locked = next(
        line.split("==")[1]
        for line in (ROOT / "constraints.txt").read_text().splitlines()
        if line.startswith("prefect==")
    )
    assert str(yaml.safe_load((INFRA / "prefect.yaml").read_text())["prefect-version"]) == locked


@pytest.mark.parametrize(
    "path", sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "configs").rglob("*.yaml") if "data" not in p.parts)
)
def test_every_config_opens_with_the_command_that_launches_it(path: str) -> None:
    lines = (ROOT / path).read_text().splitlines()
    opening = "\n".join(line for line in lines[: next(i for i, text in enumerate(lines) if not text.startswith("#"))])
    assert f"grpoflow run {path}" in opening or re.search(r"`?make demo[-\w]*`?", opening), opening
