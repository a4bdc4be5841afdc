"""Promotion through a real ``mlflow server`` on 127.0.0.1, and a registry that goes away mid-stage."""

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from flows.services import free_port, stop_group
from tasks.config import PipelineConfig
from tasks.evaluation import paired_difference
from tasks.layout import RunLayout
from tasks.promote import PromotionCase, run_promote
from tasks.registry import CHAMPION, RegistryError, alias_version, client_for, fetch_adapter
from tasks.tracking import start_pipeline

pytestmark = pytest.mark.xdist_group("mlflow-server")  # one worker starts the module's server


def _start_server(root: Path, port: int) -> subprocess.Popen:
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    command = [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--backend-store-uri",
        f"sqlite:///{root / 'mlflow.db'}",
        "--artifacts-destination",
        str(root / "artifacts"),
        "--workers",
        "1",
    ]
    # Its own process group: the server forks a uvicorn worker that must go with it.
    server = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return server
        except OSError:
            time.sleep(0.5)
    stop_group(server)
    raise RuntimeError("mlflow server did not become healthy in 90 s")


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if text.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
    return found


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        patch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
        port = free_port()
        root = tmp_path_factory.mktemp("mlflow-server")
        server = {"uri": f"http://127.0.0.1:{port}", "root": root, "port": port, "process": _start_server(root, port)}
        try:
            yield server
        finally:
            stop_group(server["process"])
    assert _processes_mentioning(str(root)) == []  # no server or worker left behind


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
        stop_group(mlflow_server["process"])
        case = PromotionCase(
            scores("grpo", [1.0] * 20),
            scores("champion", [0.0] * 20),
            {"mean": 1.0, "low": 1.0, "high": 1.0, "n": 20},
            champion_version=first.version,
        )
        run_promote(stage, name, case, config.promotion, {"base_model": "tiny-random"}, tiny_adapter, tiny_adapter)
    # Closing the pipeline with the registry still down reports it and raises nothing: the stage's own error
    # (the RegistryError above) is the one the user sees.
    from tasks.tracking import close_pipeline

    assert close_pipeline(tracker, "FAILED", {}) is False
    mlflow_server["process"] = _start_server(mlflow_server["root"], mlflow_server["port"])
    assert str(alias_version(client_for(mlflow_server["uri"]), name, CHAMPION).version) == first.version
    versions = client_for(mlflow_server["uri"]).search_model_versions(f"name = '{name}'")
    assert len(versions) == 1  # nothing half-registered


def test_a_promotion_killed_inside_the_lease_lets_the_next_in(mlflow_server, lock_holder) -> None:
    """With a tracking server the promotion lock is a lease on the registered model: a killed holder stops
    renewing it and the next promotion gets in once it expires (3 s here; 30 s by default)."""
    from tasks.registry import promotion_lock
    from tasks.tracking import LockTimeout

    holder = lock_holder(mlflow_server["uri"])
    with (
        pytest.raises(LockTimeout, match="still held"),
        promotion_lock(mlflow_server["uri"], "locked-model", lease_s=3, timeout_s=6),
    ):
        pass  # renewed by a live holder: still serialised past its lease
    os.killpg(holder.pid, signal.SIGKILL)
    holder.wait()
    started = time.monotonic()
    with promotion_lock(mlflow_server["uri"], "locked-model", lease_s=3, timeout_s=60):
        waited = time.monotonic() - started
    assert waited < 15
