"""Promotion through a real ``mlflow server`` on 127.0.0.1, and a registry that goes away mid-stage."""

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tasks.config import PipelineConfig
from tasks.layout import RunLayout
from tasks.promote import PromotionCase, run_promote
from tasks.registry import CHAMPION, RegistryError, alias_version, client_for, fetch_adapter
from tasks.runs import start_pipeline
from tasks.scoring import paired_difference


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _start_server(root: Path, port: int) -> subprocess.Popen:
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    command = [
        sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
        "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination", str(root / "artifacts"),
        "--workers", "1",
    ]  # fmt: skip
    server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return server
        except OSError:
            time.sleep(0.5)
    server.kill()
    raise RuntimeError("mlflow server did not become healthy in 90 s")


def _stop(server: subprocess.Popen) -> None:
    server.terminate()
    try:
        server.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.kill()


@pytest.fixture
def mlflow_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    port = _free_port()
    root = tmp_path / "server"
    server = _start_server(root, port)
    yield {"uri": f"http://127.0.0.1:{port}", "root": root, "port": port, "process": server}
    _stop(server)


def test_promote_through_a_server_then_registry_down_leaves_aliases(
    tiny_config: PipelineConfig, tiny_adapter: Path, mlflow_server, tmp_path: Path, make_scores
) -> None:
    scores = make_scores
    config = PipelineConfig.model_validate(
        {
            **tiny_config.model_dump(),
            "tracking": {**tiny_config.tracking.model_dump(), "tracking_uri": mlflow_server["uri"]},
        }
    )
    name = config.tracking.registered_model_name
    tracker = start_pipeline(config, RunLayout(tmp_path / "server-run"))

    def promote(candidate, reference, champion):
        with tracker.stage("promote") as stage:
            difference = paired_difference(candidate.per_prompt_pass1, reference.per_prompt_pass1)
            case = PromotionCase(candidate, reference, difference, champion_version=champion)
            lineage = {"base_model": "tiny-random"}
            return run_promote(stage, name, case, config.promotion, lineage, tiny_adapter, tiny_adapter)

    first = promote(scores("grpo", [1.0] * 20), scores("base", [0.0] * 20), None)
    assert first.promoted
    client = client_for(mlflow_server["uri"])
    assert str(alias_version(client, name, CHAMPION).version) == first.version
    # The version's adapter went through the server's artifact proxy and comes back from it.
    _, local, _ = fetch_adapter(mlflow_server["uri"], f"models:/{name}@champion", tmp_path / "download")
    assert (local / "adapter_config.json").is_file()

    # The registry goes away in the middle of the next promotion: a clear error, and no alias moved.
    with pytest.raises(RegistryError), tracker.stage("promote") as stage:
        _stop(mlflow_server["process"])
        case = PromotionCase(
            scores("grpo", [1.0] * 20), scores("champion", [0.0] * 20), {"mean": 1.0, "low": 1.0, "high": 1.0, "n": 20},
            champion_version=first.version,
        )  # fmt: skip
        run_promote(stage, name, case, config.promotion, {"base_model": "tiny-random"}, tiny_adapter, tiny_adapter)
    mlflow_server["process"] = _start_server(mlflow_server["root"], mlflow_server["port"])
    assert str(alias_version(client_for(mlflow_server["uri"]), name, CHAMPION).version) == first.version
    versions = client_for(mlflow_server["uri"]).search_model_versions(f"name = '{name}'")
    assert len(versions) == 1  # nothing half-registered
