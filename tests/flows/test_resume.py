"""Kill the pipeline with SIGKILL while GRPO is between checkpoints, resume it, and check what the issue asks:
GRPO continues from its checkpoint, earlier stages are not recomputed, one registered version, no orphan runs."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from tasks.config import load_config
from tasks.tracking import RUN_ID_TAG, client_for

REPO = Path(__file__).resolve().parents[2]
SLOW_REWARD = """
import time

def slow_length(completions, **kwargs):
    time.sleep(0.4)  # makes each GRPO step long enough to kill between checkpoints
    return [-abs(8 - len(c if isinstance(c, str) else c[-1]["content"])) / 8 for c in completions]
"""


def _run(args: list[str], env: dict[str, str], **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "run", *args],
        cwd=REPO,
        env=env,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kwargs,
    )


def test_sigkill_during_grpo_then_resume(tmp_path: Path) -> None:
    (tmp_path / "slowreward.py").write_text(SLOW_REWARD)
    config = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    config.update(output_dir=str(tmp_path / "out"), rewards=[{"name": "slowreward:slow_length"}])
    config["grpo"].update(max_steps=12, checkpoint_steps=2)
    config["tracking"] = {"registered_model_name": "resume-model"}
    config_path = tmp_path / "resume.yaml"
    config_path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    checkpoints = tmp_path / "out" / "resume-1" / "grpo" / "checkpoints"

    first = _run([str(config_path), "--run-id", "resume-1"], env)
    deadline = time.monotonic() + 240
    while not (checkpoints / "checkpoint-4").is_dir():
        assert first.poll() is None, first.stdout.read()
        assert time.monotonic() < deadline, "GRPO never reached its second checkpoint"
        time.sleep(0.1)
    time.sleep(0.5)  # inside step 5 or 6: between checkpoints
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    assert not (checkpoints / "checkpoint-12").exists()

    second = _run([str(config_path), "--resume", "resume-1"], env)
    output, _ = second.communicate(timeout=300)
    assert second.returncode == 0, output
    assert "resuming resume-1" in output
    # A console people can read: no raw metric dicts, foreign progress bars or warnings nobody can act on.
    for noise in (
        "{'loss'",
        "Calculating Metrics",
        "Timeout is disabled",
        "Downloading artifacts",
        "without a flow run id",
        "clean_up_tokenization_spaces",
        "Type hint used in the model's predict",
        "Add type hints to the `predict`",
        "examples/s",  # datasets' map bars
    ):
        assert noise not in output, (noise, output[-3000:])
    # Log lines during training are written above the training bar, never on its line.
    assert re.search(r"\] *\d\d:\d\d:\d\d\.\d{3} \|", output) is None, output[-3000:]
    assert "grpo step 5/12" not in output  # the bar shows each step's loss and reward; the Prefect log keeps the line
    from tasks.training import read_ledger

    # The rollout ledger after a SIGKILL between checkpoints and a resume: every step's samples, each once.
    ledger = read_ledger(tmp_path / "out" / "resume-1" / "grpo" / "rollouts")
    steps = [row["step"] for row in ledger]
    assert sorted(set(steps)) == list(range(1, 13)) and all(steps.count(s) == 8 for s in range(1, 13))

    cfg = load_config(config_path)
    client = client_for(cfg.resolved_tracking_uri())
    experiment = client.get_experiment_by_name(cfg.tracking.experiment_name)
    runs = client.search_runs([experiment.experiment_id], f"tags.`{RUN_ID_TAG}` = 'resume-1'")
    assert all(run.info.status != "RUNNING" for run in runs)  # the killed attempt's runs were closed
    stages = [run.data.tags.get("grpoflow.stage") for run in runs]
    for stage in ("validate", "probe_base", "sft", "probe_sft"):
        assert stages.count(stage) == 1, (stage, stages)  # not recomputed on resume
    grpo_runs = sorted(
        (r for r in runs if r.data.tags.get("grpoflow.stage") == "grpo"), key=lambda r: r.info.start_time
    )
    assert len(grpo_runs) == 2 and grpo_runs[0].info.status == "FAILED"
    resumed = grpo_runs[1].info.run_id
    assert client.get_run(resumed).data.metrics["resumed_from_step"] == 4  # continued from checkpoint-4, not from 0
    resumed_steps = [m.step for m in client.get_metric_history(resumed, "reward")]
    assert sorted(resumed_steps) == list(range(1, 13))  # the whole curve: replayed up to 4, trained after
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert sorted(r.info.status for r in parents) == ["FAILED", "FINISHED"]
    assert len(client.search_model_versions("name = 'resume-model'")) == 1
    assert len(client.search_model_versions("name = 'resume-model-sft'")) == 1
    summary = json.loads((tmp_path / "out" / "resume-1" / "summary.json").read_text())
    assert summary["promotion"]["version"] == "1"

    # Resuming a run that finished does nothing, and says so (no second finished parent run).
    third = _run([str(config_path), "--resume", "resume-1"], env)
    output, _ = third.communicate(timeout=120)
    assert third.returncode == 0 and "already finished" in output, output[-2000:]
    parents = [
        r
        for r in client.search_runs([experiment.experiment_id], f"tags.`{RUN_ID_TAG}` = 'resume-1'")
        if "mlflow.parentRunId" not in r.data.tags
    ]
    assert sorted(r.info.status for r in parents) == ["FAILED", "FINISHED"]


def test_a_run_killed_with_sigterm_says_how_to_resume_it(tmp_path: Path) -> None:
    config = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    config.update(output_dir=str(tmp_path / "out"))
    config_path = tmp_path / "term.yaml"
    config_path.write_text(yaml.safe_dump(config))
    run = _run([str(config_path), "--run-id", "term-1"], dict(os.environ))
    validated = tmp_path / "out" / "term-1" / "validate"
    deadline = time.monotonic() + 180
    while not validated.is_dir():  # inside the flow, in its first stage
        assert run.poll() is None, run.stdout.read()
        assert time.monotonic() < deadline, "the run never started its first stage"
        time.sleep(0.1)
    os.killpg(run.pid, signal.SIGTERM)  # what a scheduler, systemd or `kill` sends the process group
    output, _ = run.communicate(timeout=120)
    assert run.returncode == -signal.SIGTERM, output[-2000:]
    assert f"killed (SIGTERM): `grpoflow run {config_path} --resume term-1` continues it" in output, output[-2000:]
