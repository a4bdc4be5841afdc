"""The remote GRPO flow's checkpoints outlive its worker: killed mid-training, the next worker continues from the
newest checkpoint the store kept (the pipeline's MLflow run artifacts), past its step, also when the pipeline was
resumed (`grpoflow run --resume` opens a new parent run)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from flows.remote import grpo_remote_flow
from tasks.config import PipelineConfig
from tasks.layout import HANDOFF_GRPO_ADAPTER, HANDOFF_TRAIN, RemoteGrpoRequest
from tasks.tracking import Tracker, client_for, handoff_upload
from tasks.training import ARTIFACT_DIR, MlflowStore

REPO = Path(__file__).resolve().parents[2]
SLOW_REWARD = """
import time

def slow_length(completions, **kwargs):
    time.sleep(0.5)  # each GRPO step long enough to kill the worker between checkpoints
    return [-abs(8 - len(c if isinstance(c, str) else c[-1]["content"])) / 8 for c in completions]
"""
WORKER = """
import json, sys
from flows.remote import grpo_remote_flow
grpo_remote_flow(**json.loads(open(sys.argv[1]).read()))
"""


def test_a_killed_remote_grpo_worker_is_continued_by_the_next(tiny_config, tiny_split, tmp_path: Path) -> None:
    (tmp_path / "slowreward.py").write_text(SLOW_REWARD)
    raw = tiny_config.model_dump(mode="json")
    raw["rewards"] = [{"name": "slowreward:slow_length", "path": str(tmp_path)}]
    raw["grpo"].update(max_steps=10, checkpoint_steps=2)
    config = PipelineConfig.model_validate(raw)
    # The pipeline's side: its parent MLflow run, with the training file handed off.
    client = client_for(config.resolved_tracking_uri())
    experiment_id = client.create_experiment("remote-grpo")
    parent = client.create_run(experiment_id, tags={"grpoflow.run_id": "remote-1"}).info.run_id
    tracker = Tracker(config.resolved_tracking_uri(), experiment_id, parent, "remote-1", tmp_path / "pipeline")
    handoff_upload(tracker, tiny_split.train_path, HANDOFF_TRAIN)
    request = RemoteGrpoRequest(
        config.model_dump(mode="json"),
        "remote-1",
        tracker.tracking_uri,
        experiment_id,
        parent,
        tiny_split.train_path.name,
        has_sft_adapter=False,
    )
    (tmp_path / "request.json").write_text(json.dumps(request.parameters()))
    store = MlflowStore(tracker.tracking_uri, parent)

    first = subprocess.Popen(
        [sys.executable, "-c", WORKER, str(tmp_path / "request.json")],
        cwd=REPO,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 240
    while "checkpoint-4" not in store.complete():
        assert first.poll() is None, first.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "the remote GRPO never stored its second checkpoint"
        time.sleep(0.2)
    os.killpg(first.pid, signal.SIGKILL)  # the worker dies with its temporary folder's checkpoints
    first.wait()
    kept = store.complete()
    assert kept[0] in ("checkpoint-4", "checkpoint-6") and len(kept) <= 2  # pruned to the newest two

    # `grpoflow run --resume`: a new parent run for the same pipeline run, the training file handed off again.
    resumed = client.create_run(experiment_id, tags={"grpoflow.run_id": "remote-1"}).info.run_id
    retracker = Tracker(config.resolved_tracking_uri(), experiment_id, resumed, "remote-1", tmp_path / "resumed")
    handoff_upload(retracker, tiny_split.train_path, HANDOFF_TRAIN)
    # A new worker (its own temporary folder) under the new parent run.
    result = grpo_remote_flow(**replace(request, parent_run_id=resumed).parameters())
    assert result["steps"] == 10
    grpo_runs = sorted(
        (r for r in client.search_runs([experiment_id]) if r.data.tags.get("grpoflow.stage") == "grpo"),
        key=lambda r: r.info.start_time,
    )
    assert len(grpo_runs) == 2  # the killed worker's stage run and the one that continued
    continued = grpo_runs[-1]
    assert continued.data.metrics["resumed_from_step"] == int(kept[0].split("-")[1])  # not from step 0
    assert continued.data.metrics["train_steps"] == 10
    assert store.complete() == []  # done: the killed attempt's checkpoints were cleared
    handed_back = {Path(a.path).name for a in client.list_artifacts(resumed, f"handoff/{HANDOFF_GRPO_ADAPTER}")}
    assert "adapter_model.safetensors" in handed_back
    assert [a.path for a in client.list_artifacts(resumed, ARTIFACT_DIR)] == []
