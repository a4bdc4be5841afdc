"""Registered versions are MLflow models: loaded with ``mlflow.pyfunc`` by alias, served by ``mlflow models
serve``, each with its own model card and numbers, and nothing pickled (the real pipeline registers them)."""

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from flows.services import free_port, stop_group
from tasks.registry import CHAMPION, alias_version, client_for


def _alias(config) -> str:
    client = client_for(config.resolved_tracking_uri())
    return CHAMPION if alias_version(client, config.tracking.registered_model_name, CHAMPION) else "challenger"


def test_a_version_loads_by_alias_and_predicts_with_its_card(registered_tiny, tmp_path: Path, monkeypatch) -> None:
    import mlflow
    from huggingface_hub import ModelCard

    config, summary = registered_tiny
    name, uri = config.tracking.registered_model_name, config.resolved_tracking_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # where models:/ URIs are looked up, for this test only
    model = mlflow.pyfunc.load_model(f"models:/{name}@{_alias(config)}")
    answers = model.predict(["What is 23+45?", "What is 1+1?"], params={"max_new_tokens": 6})
    assert len(answers) == 2 and all(isinstance(a, str) for a in answers)
    assert {p.name for p in model.metadata.get_params_schema().params} == {"max_new_tokens", "temperature"}

    client = client_for(uri)
    version = client.get_model_version(name, summary["promotion"]["version"])
    local = Path(mlflow.artifacts.download_artifacts(version.source, dst_path=str(tmp_path), tracking_uri=uri))
    shipped = [p for p in local.rglob("*") if p.is_file()]
    assert not [p for p in shipped if p.suffix in (".bin", ".pt", ".pkl", ".pickle", ".pth")], shipped
    card = ModelCard.load(local / "README.md")
    assert card.data.base_model == "tiny-random" and card.data.library_name == "peft"
    assert "## Evaluation" in card.text and "mlflow.pyfunc.load_model" in card.text
    assert (local / "artifacts" / "adapter" / "README.md").read_text() == card.content
    adapter_config = json.loads((local / "artifacts" / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == "tiny-random"  # portable, not this machine's path
    assert 0 < len(version.description) <= 5000 and "Model card" in version.description
    # grpoflow's own generate / evaluate / export find the adapter inside the MLflow model.
    from tasks.registry import fetch_adapter

    base, adapter_dir, _ = fetch_adapter(uri, f"models:/{name}/{version.version}", tmp_path / "fetched")
    assert base == "tiny-random" and (adapter_dir / "adapter_model.safetensors").is_file()
    # The registered copy is the run's adapter: it keys the evaluation cache as the run's own folder does, so a
    # later run's champion is not sampled and scored again.
    from tasks.evaluation.cache import model_content_key
    from tasks.models import resolve_model_source

    trained = Path(summary["run_dir"]) / "grpo" / "adapter"  # the run that registered this version
    base_dir = resolve_model_source(base)
    assert model_content_key(base_dir, adapter_dir) == model_content_key(base_dir, trained)

    # Each version carries its own model's numbers: the SFT backup the SFT policy's.
    sft = client.get_model_version(f"{name}-sft", summary["promotion"]["sft_version"])
    sft_pass1 = summary["evaluation"]["models"]["sft"]["pass_at_k"]["1"]
    assert float(sft.tags["metric.pass_at_1"]) == pytest.approx(sft_pass1, abs=1e-4)
    assert "metric.gain_vs_base" not in sft.tags


def test_the_loader_refuses_another_base_model(tiny_model_dir: Path) -> None:
    from tasks.models import ModelSourceError
    from tasks.registry import base_fingerprint, check_base_fingerprint

    check_base_fingerprint(tiny_model_dir, base_fingerprint(tiny_model_dir), "tiny-random")
    with pytest.raises(ModelSourceError, match="not the one this adapter was trained on"):
        check_base_fingerprint(tiny_model_dir, "0123456789abcdef", "tiny-random")


def test_mlflow_models_serve_answers_over_http(registered_tiny, tmp_path: Path) -> None:
    config, _ = registered_tiny
    port = free_port()
    env = {**os.environ, "MLFLOW_TRACKING_URI": config.resolved_tracking_uri(), "HF_HUB_OFFLINE": "1"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # it runs uvicorn from there
    command = [
        sys.executable,
        "-m",
        "mlflow",
        "models",
        "serve",
        "-m",
        f"models:/{config.tracking.registered_model_name}/1",
        "--env-manager",
        "local",
        "-h",
        "127.0.0.1",
        "-p",
        str(port),
    ]
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen(command, env=env, stdout=log, stderr=log, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2):
                    break
            except OSError:
                assert time.monotonic() < deadline, "the model server did not come up in 120 s"
                time.sleep(0.5)
        body = json.dumps({"inputs": ["What is 1+1?"], "params": {"max_new_tokens": 4}}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/invocations", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            predictions = json.loads(response.read())["predictions"]
        assert len(predictions) == 1 and isinstance(predictions[0], str)
    finally:
        stop_group(server)
        log.close()


def test_versions_registered_before_are_migrated_to_mlflow_models(tiny_config, tiny_adapter, tmp_path, monkeypatch):
    import mlflow

    from tasks.layout import RunLayout
    from tasks.registry import migrate_versions, move_champion, register_adapter
    from tasks.tracking import start_pipeline

    uri, name = tiny_config.resolved_tracking_uri(), "old-model"
    tracker = start_pipeline(tiny_config, RunLayout(tmp_path / "old-run"))
    client = client_for(uri)
    with tracker.stage("promote") as stage:  # registered the way versions were before: the adapter folder
        stage.log_artifact(tiny_adapter, "adapter")
        tags = {"base_model": "tiny-random", "metric.pass_at_1": "0.5"}
        old = register_adapter(client, name, stage.run_id, "adapter", tags)
    move_champion(client, name, old, "test")
    moved = migrate_versions(uri, name, tiny_config.tracking.experiment_name, tmp_path / "scratch")
    assert moved == {old: "2"}
    assert str(client.get_model_version_by_alias(name, CHAMPION).version) == "2"
    assert client.get_model_version(name, "2").tags["metric.pass_at_1"] == "0.5"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    model = mlflow.pyfunc.load_model(f"models:/{name}@champion")
    assert len(model.predict(["1+1?"], params={"max_new_tokens": 2})) == 1
    assert migrate_versions(uri, name, tiny_config.tracking.experiment_name, tmp_path / "again") == {}
