"""The deployable stack for real: Prefect and MLflow servers on 127.0.0.1, deployments on a process work pool, a
worker, flow runs triggered through the API, and the results read back through both servers' REST APIs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from flows.services import CPU_POOL, GPU_POOL, PROJECT_ROOT, Services, _bin, deploy, free_port, start_services


def _request(request: urllib.request.Request | str) -> dict | list:
    """JSON from a server; a busy server's 503 (SQLite-backed Prefect under load) is retried a few times."""
    for attempt in range(6):
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            if exc.code != 503 or attempt == 5:
                raise
            time.sleep(2)
    raise AssertionError("unreachable")


def _get(url: str) -> dict:
    return _request(url)


def _post(url: str, body: dict) -> dict | list:
    return _request(
        urllib.request.Request(
            url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
        )
    )


def _flow_runs(services: Services) -> list[dict]:
    return _post(f"{services.prefect_api_url}/flow_runs/filter", {"limit": 50})


def _trigger(services: Services, env: dict[str, str], deployment: str, parameters: dict) -> str:
    """Start a flow run of ``deployment`` through the Prefect API; returns its id."""
    deployment_id = _get(f"{services.prefect_api_url}/deployments/name/{deployment}")["id"]
    created = _post(
        f"{services.prefect_api_url}/deployments/{deployment_id}/create_flow_run", {"parameters": parameters}
    )
    return created["id"]


def _wait_for(services: Services, flow_run_id: str, timeout: float, states: tuple[str, ...]) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = _get(f"{services.prefect_api_url}/flow_runs/{flow_run_id}")
        if run["state_type"] in states:
            return run
        time.sleep(2)
    raise AssertionError(f"flow run {flow_run_id} not in {states} after {timeout} s: {run['state_type']}")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):
    """Servers, deployments and one process worker, started once for this module's tests (each keeps to its own
    output folder and MLflow experiment) and all stopped at the end."""
    tmp_path = tmp_path_factory.mktemp("stack")
    services = start_services(tmp_path / "services", free_port(), free_port())
    env = {
        **os.environ,
        **services.env(),
        "PREFECT_HOME": str(tmp_path / "prefect-client"),
        "PREFECT_WORKER_QUERY_SECONDS": "1",
        "PREFECT_LOGGING_LEVEL": "INFO",
    }
    workers = []
    try:
        names = deploy(env=env)
        worker_log = (tmp_path / "worker.log").open("wb")
        workers.append(
            subprocess.Popen(
                [_bin("prefect"), "worker", "start", "--pool", CPU_POOL, "--type", "process"],
                env=env,
                cwd=PROJECT_ROOT,
                stdout=worker_log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
        # A second worker, on the GPU pool, on "another machine": its own writable folders (a private /tmp holds
        # its home, Prefect home and grpoflow cache), the code and venv read-only, nothing shared with the first
        # but the Prefect and MLflow servers (which proxies the artifacts).
        if shutil.which("bwrap"):
            from tasks.training.nodes.launchers import SANDBOX_UID_CLAIMS, bubblewrap_prefix

            Path(SANDBOX_UID_CLAIMS).mkdir(mode=0o700, parents=True, exist_ok=True)
            private = bubblewrap_prefix(chdir=str(PROJECT_ROOT))  # as a node of its own: see that launcher
            elsewhere = {
                **env,
                "HOME": "/tmp/home",
                "PREFECT_HOME": "/tmp/prefect",
                "GRPOFLOW_CACHE": "/tmp/cache",
                "TMPDIR": "/tmp",
                "PREFECT_RESULTS_LOCAL_STORAGE_PATH": "/tmp/prefect/storage",
            }
            second_log = (tmp_path / "second-worker.log").open("wb")
            command = [_bin("prefect"), "worker", "start", "--pool", GPU_POOL, "--type", "process"]
            workers.append(
                subprocess.Popen(
                    [*private, *command, "--name", "second-worker"],
                    env=elsewhere,
                    stdout=second_log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        yield services, env, names, tmp_path
    finally:
        for worker in workers:
            os.killpg(worker.pid, 2)
            try:
                worker.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(worker.pid, 9)
        services.stop()


@pytest.mark.xdist_group("services-stack")  # one worker starts the stack for both of its tests
def test_deployed_pipeline_runs_on_a_worker_and_registers_in_mlflow(stack, lora_adapter) -> None:
    services, env, names, tmp_path = stack
    assert {
        "grpoflow-watch/daily",
        "grpoflow-scheduled/nightly",
        "grpoflow-rollback/rollback",
        "grpoflow-grpo/grpo",
        "grpoflow-grpo/grpo-gpu",
        "grpoflow-serve/champion",
    } <= set(names)
    schedules = _get(f"{services.prefect_api_url}/deployments/name/grpoflow-scheduled/nightly")["schedules"]
    assert schedules[0]["schedule"]["cron"] == "0 2 * * *"
    _deploy_a_config_of_ones_own(services, env, tmp_path)
    overrides = {
        "output_dir": str(tmp_path / "outputs"),
        "tracking.tracking_uri": services.mlflow_url,
        # GRPO as its own deployment, on the second worker (its own files): the stage's inputs and adapter must
        # travel through MLflow's artifact store.
        "orchestration.grpo_deployment": "grpoflow-grpo/grpo-gpu" if shutil.which("bwrap") else "grpoflow-grpo/grpo",
    }
    parameters = {"config_path": "configs/tiny.yaml", "overrides": overrides}
    first = _trigger(services, env, "grpoflow-scheduled/nightly", parameters)
    finished = _wait_for(services, first, 900, ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"))
    assert finished["state_type"] == "COMPLETED", (tmp_path / "worker.log").read_text()[-3000:]

    # The registered version, found through the MLflow REST API.
    query = urllib.parse.urlencode({"filter": "name='grpoflow-tiny'"})
    versions = _get(f"{services.mlflow_url}/api/2.0/mlflow/model-versions/search?{query}")["model_versions"]
    assert [v["version"] for v in versions] == ["1"]
    tags = {t["key"]: t["value"] for t in versions[0]["tags"]}
    assert tags["base_model"] == "tiny-random" and tags["data_fingerprint"]
    model = _get(f"{services.mlflow_url}/api/2.0/mlflow/registered-models/get?name=grpoflow-tiny")
    aliases = {a["alias"]: a["version"] for a in model["registered_model"]["aliases"]}
    assert "1" in aliases.values() and "grpoflow.promotion_decision" in tags  # champion, or challenger with reason

    # GRPO ran as its own flow run, a child of the scheduled run, taken by the second worker from the GPU pool.
    runs = {r["name"]: r for r in _flow_runs(services)}
    grpo_runs = [r for name, r in runs.items() if name.endswith("-grpo")]
    assert len(grpo_runs) == 1 and grpo_runs[0]["state_type"] == "COMPLETED"
    if shutil.which("bwrap"):
        assert grpo_runs[0]["work_pool_name"] == GPU_POOL
        assert runs[finished["name"]]["work_pool_name"] == CPU_POOL
        second = (tmp_path / "second-worker.log").read_text()
        assert grpo_runs[0]["id"] in second and "second-worker" in second  # it submitted the GRPO run
        assert grpo_runs[0]["id"] not in (tmp_path / "worker.log").read_text()  # and the first did not
    # The Prefect UI links each stage to its MLflow run.
    artifacts = _post(f"{services.prefect_api_url}/artifacts/filter", {"limit": 200})
    links = {a["key"]: a["data"] for a in artifacts if (a["key"] or "").startswith("mlflow-")}
    assert {"mlflow-validate", "mlflow-grpo", "mlflow-promote"} <= set(links)
    assert all(f"]({services.mlflow_url}/#/experiments/" in text for text in links.values())

    # The Prefect UI's run logs carry the stage progress: stages, training steps, verdicts, the decision.
    expected = ("stage validate finished", "sft step 1/", "grpo step 1/", "probe-sft-verdict: ", "promote: ")
    for _ in range(30):  # the server ingests log batches asynchronously
        messages = []
        for offset in range(0, 4000, 200):
            page = _post(f"{services.prefect_api_url}/logs/filter", {"limit": 200, "offset": offset})
            messages += [entry["message"] for entry in page]
            if len(page) < 200:
                break
        missing = [line for line in expected if line not in "\n".join(messages)]
        if not missing:
            break
        time.sleep(1)
    assert not missing, missing

    # The same config and data again: the scheduled run skips training and says so.
    second = _trigger(services, env, "grpoflow-scheduled/nightly", parameters)
    assert _wait_for(services, second, 300, ("COMPLETED", "FAILED", "CRASHED"))["state_type"] == "COMPLETED"
    versions = _get(f"{services.mlflow_url}/api/2.0/mlflow/model-versions/search?{query}")["model_versions"]
    assert len(versions) == 1
    skipped = _post(
        f"{services.mlflow_url}/api/2.0/mlflow/runs/search",
        {"experiment_ids": ["1"], "filter": "tags.`grpoflow.skipped` != ''"},
    )
    assert len(skipped["runs"]) == 1
    # Prefect events an automation can notify on (the server ingests them asynchronously).
    seen: set[str] = set()
    for _ in range(30):
        found = _post(f"{services.prefect_api_url}/events/filter", {"filter": {"event": {"prefix": ["grpoflow.run."]}}})
        seen = {e["event"] for e in found["events"]}
        if "grpoflow.run.skipped-unchanged" in seen:
            break
        time.sleep(1)
    assert "grpoflow.run.skipped-unchanged" in seen, seen

    # The champion watch as a deployment: v1 champion, then a damaged v2 (random output-layer weights: it forgets)
    # registered and forced to champion by hand; the daily watch (action alert) reports it and emits the event.
    from tasks.config import load_config
    from tasks.layout import RunLayout
    from tasks.registry import CHAMPION, alias_version_number, client_for, register_adapter, rollback_champion
    from tasks.tracking import start_pipeline

    config = load_config("configs/tiny.yaml", overrides)
    client = client_for(services.mlflow_url)
    rollback_champion(client, "grpoflow-tiny", to_version="1", reason="test: v1 is the champion")
    tracker = start_pipeline(config, RunLayout(tmp_path / "outputs" / "damaged"))
    with tracker.stage("promote") as stage:
        stage.log_artifact(lora_adapter(tmp_path / "damaged-adapter", 1.0), "adapter")
        damaged = register_adapter(client, "grpoflow-tiny", stage.run_id, "adapter", {"base_model": "tiny-random"})
    rollback_champion(client, "grpoflow-tiny", to_version=damaged, reason="test: forced by hand")
    watch_overrides = {**overrides, "watch.action": "alert", "watch.cooldown_h": 0}
    watched = _trigger(
        services, env, "grpoflow-watch/daily", {"config_path": "configs/tiny.yaml", "overrides": watch_overrides}
    )
    ended = _wait_for(services, watched, 300, ("COMPLETED", "FAILED", "CRASHED"))
    assert ended["state_type"] == "COMPLETED", (tmp_path / "worker.log").read_text()[-3000:]
    assert alias_version_number(client, "grpoflow-tiny", CHAMPION) == damaged  # alert: nothing moved
    watch_runs = client.search_runs(["1"], "tags.`grpoflow.stage` = 'watch'")
    assert [r.data.tags["grpoflow.watch.status"] for r in watch_runs] == ["regressed"]
    assert "forgets" in watch_runs[0].data.tags["grpoflow.watch.reason"]
    for _ in range(30):
        found = _post(
            f"{services.prefect_api_url}/events/filter", {"filter": {"event": {"prefix": ["grpoflow.champion."]}}}
        )
        if {e["event"] for e in found["events"]} == {"grpoflow.champion.regressed"}:
            break
        time.sleep(1)
    assert {e["event"] for e in found["events"]} == {"grpoflow.champion.regressed"}
    assert found["events"][0]["resource"]["prefect.resource.id"] == "grpoflow.model.grpoflow-tiny"


@pytest.mark.xdist_group("services-stack")
def test_cancelling_a_run_from_the_api_leaves_no_mlflow_run_open(stack) -> None:
    services, env, _, tmp_path = stack
    overrides = {
        "output_dir": str(tmp_path / "cancelled"),
        "tracking.tracking_uri": services.mlflow_url,
        "tracking.experiment_name": "grpoflow-cancelled",  # the servers are shared: this test's runs alone
        "grpo.max_steps": 2000,  # long enough to be cancelled mid-training
        "sft.max_steps": 2000,
    }
    parameters = {"config_path": "configs/tiny.yaml", "overrides": overrides, "skip_unchanged": False}
    flow_run_id = _trigger(services, env, "grpoflow-scheduled/nightly", parameters)
    _wait_for(services, flow_run_id, 300, ("RUNNING",))
    for _ in range(180):  # the run creates its experiment when it starts
        found = _post(f"{services.mlflow_url}/api/2.0/mlflow/experiments/search", {"max_results": 100})
        ids = [e["experiment_id"] for e in found.get("experiments", []) if e["name"] == "grpoflow-cancelled"]
        if ids:
            break
        time.sleep(1)
    search = {"experiment_ids": ids, "filter": "attributes.run_name = 'sft' and attributes.status = 'RUNNING'"}
    for _ in range(180):  # until SFT is training
        if _post(f"{services.mlflow_url}/api/2.0/mlflow/runs/search", search).get("runs"):
            break
        time.sleep(1)
    _post(f"{services.prefect_api_url}/flow_runs/{flow_run_id}/set_state", {"state": {"type": "CANCELLING"}})
    # Prefect ends a cancelled process-worker run as CANCELLED or, when the engine reports the SIGTERM first,
    # CRASHED ("aborted by a termination signal"); either way the run is stopped, which is what this checks.
    ended = _wait_for(services, flow_run_id, 120, ("CANCELLED", "FAILED", "CRASHED", "COMPLETED"))
    assert ended["state_type"] in ("CANCELLED", "CRASHED")
    runs = _post(f"{services.mlflow_url}/api/2.0/mlflow/runs/search", {"experiment_ids": ids})["runs"]
    assert runs and not [r["info"]["run_name"] for r in runs if r["info"]["status"] == "RUNNING"], [
        (r["info"]["run_name"], r["info"]["status"]) for r in runs
    ]
    parent = [r for r in runs if not any(t["key"] == "mlflow.parentRunId" for t in r["data"].get("tags", []))]
    assert [r["info"]["status"] for r in parent] == ["KILLED"]


def test_up_serves_the_store_and_the_prefect_runs_a_local_run_wrote(registered_tiny, tmp_path, monkeypatch) -> None:
    """One store: after a run on the local defaults, `grpoflow up` shows that run's registered model (MLflow)
    and its flow run (Prefect), and while it runs, `grpoflow run` reports to it."""
    import signal

    import yaml

    from flows.cli.run import _prefect_server, _ui_base
    from flows.services import running_up

    config, summary = registered_tiny
    config_file = tmp_path / "c.yaml"
    config_file.write_text(
        yaml.safe_dump({**yaml.safe_load(Path("configs/tiny.yaml").read_text()), "output_dir": str(config.output_dir)})
    )
    monkeypatch.setenv("GRPOFLOW_CACHE", str(tmp_path / "cache"))  # where `up` notes what it serves
    prefect_port, mlflow_port = free_port(), free_port()
    ports = ["--prefect-port", str(prefect_port), "--mlflow-port", str(mlflow_port)]
    command = [sys.executable, "-m", "flows.cli", "up", "--config", str(config_file), *ports, "--home", str(tmp_path)]
    log = (tmp_path / "up.log").open("wb")
    up = subprocess.Popen(command, cwd=PROJECT_ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while running_up() is None and time.monotonic() < deadline and up.poll() is None:
            time.sleep(1)
        state = running_up()
        assert state is not None, (tmp_path / "up.log").read_text()[-3000:]
        mlflow_url = f"http://127.0.0.1:{mlflow_port}"
        model = _get(f"{mlflow_url}/api/2.0/mlflow/registered-models/get?name=grpoflow-tiny")["registered_model"]
        assert model["aliases"]  # other tests share this store and may move aliases; the run's version is there:
        query = urllib.parse.urlencode({"filter": "name='grpoflow-tiny'"})
        versions = _get(f"{mlflow_url}/api/2.0/mlflow/model-versions/search?{query}")["model_versions"]
        assert summary["promotion"]["version"] in [v["version"] for v in versions]
        names = [r["name"] for r in _post(f"{state['prefect_api_url']}/flow_runs/filter", {"limit": 200})]
        assert summary["run_id"] in names
        assert _prefect_server()[0] == state["prefect_api_url"]  # `grpoflow run` reports here while `up` runs
        assert _ui_base(config.resolved_tracking_uri()) == (mlflow_url, "")  # and its links open this UI
    finally:
        os.killpg(up.pid, signal.SIGINT)
        up.wait(timeout=60)
    assert running_up() is None


def _deploy_a_config_of_ones_own(services: Services, env: dict[str, str], tmp_path: Path) -> None:
    """``grpoflow deploy CONFIG --cron``: the pipeline on a config outside the project on its own schedule."""
    own = tmp_path / "my-nightly.yaml"  # a config outside the project: its absolute path is what workers read
    own.write_text("extends: " + str(PROJECT_ROOT / "configs" / "tiny.yaml") + "\nname: mine\n")
    command = [_bin("grpoflow"), "deploy", str(own), "--cron", "30 4 * * 1-5", "--timezone", "Europe/Paris"]
    done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "grpoflow-scheduled/nightly-mine" in done.stdout
    deployment = _get(f"{services.prefect_api_url}/deployments/name/grpoflow-scheduled/nightly-mine")
    assert deployment["parameters"]["config_path"] == str(own)
    assert [(s["schedule"]["cron"], s["schedule"]["timezone"]) for s in deployment["schedules"]] == [
        ("30 4 * * 1-5", "Europe/Paris")
    ]
    refused = subprocess.run([*command[:3], "--cron", "nightly"], env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "five fields" in refused.stderr
