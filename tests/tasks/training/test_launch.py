"""Multi-process training: SFT and GRPO on two CPU processes (accelerate launch, torch.distributed with gloo),
the flow itself once; a failing rank ends the group with its own error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow import MlflowClient

from flows.pipeline import pipeline
from tasks.config import PipelineConfig
from tasks.errors import GateStop


def _two_processes(tiny_config: PipelineConfig, name: str, **changes) -> PipelineConfig:
    raw = tiny_config.model_dump()
    raw["orchestration"] = {**raw["orchestration"], "num_processes": 2}
    raw["grpo"] = {**raw["grpo"], "batch_size": 4}  # per process: 2 × 4 completions = two groups of 4 per step
    raw["tracking"] = {**raw["tracking"], "registered_model_name": name}
    # bf16 on any CPU: frozen weights stored in bf16 meet TRL's own generation, which several processes use.
    raw["model"] = {**raw["model"], "precision": "bf16"}
    return PipelineConfig.model_validate({**raw, **changes})


@pytest.mark.xdist_group("ranks")  # runs of two processes, one after the other on one worker
def test_the_tiny_pipeline_trains_on_two_processes(tiny_config: PipelineConfig) -> None:
    config = _two_processes(tiny_config, "tiny-two-processes")
    # rank 0 scores the hold-out at every step while rank 1 waits for its numbers; both save the best checkpoint
    steering = {"eval_steps": 1, "eval_prompts": 8, "select": "best"}
    config = config.model_copy(update={"grpo": config.grpo.model_copy(update=steering)})
    summary = pipeline(config, "tiny-ddp")
    assert summary["promotion"]["version"] == "1"  # a registered version
    assert summary["grpo"]["selected"]["select"] == "best" and summary["grpo"]["selected"]["step"] in (1, 2)
    client = MlflowClient(config.resolved_tracking_uri())
    experiment = client.get_experiment_by_name(config.tracking.experiment_name)
    runs = client.search_runs([experiment.experiment_id], "tags.grpoflow.run_id = 'tiny-ddp'")
    for stage, steps in (("sft", config.sft.max_steps), ("grpo", config.grpo.max_steps)):
        stage_runs = [r for r in runs if r.data.tags.get("grpoflow.stage") == stage]
        assert len(stage_runs) == 1, stage  # one MLflow stage run, not one per rank
        loss = client.get_metric_history(stage_runs[0].info.run_id, "loss")
        assert sorted(m.step for m in loss) == list(range(1, steps + 1)), stage  # each step logged once
        assert stage_runs[0].data.metrics["train_steps"] == steps
        if stage == "grpo":  # the hold-out's numbers, once per step (from rank 0)
            scored = client.get_metric_history(stage_runs[0].info.run_id, "eval_holdout_pass_at_1")
            assert sorted(m.step for m in scored) == list(range(1, steps + 1))
    for stage in ("sft", "grpo"):  # every rank ended cleanly: none aborted at exit after its work
        exit_file = config.output_dir / "tiny-ddp" / stage / "launch" / "exit.json"
        assert json.loads(exit_file.read_text()) == {"returncode": 0}, stage
        done = sorted(path.name for path in exit_file.parent.glob("rank-*.done"))
        assert done == ["rank-0.done", "rank-1.done"], stage  # each rank marked its work done past the barrier
    launch = config.output_dir / "tiny-ddp" / "grpo" / "launch"
    log = (launch / "ranks.log").read_text()
    assert "[rank 1]" not in log or "[rank 0]" in log  # both ranks ran; rank 0 logged
    assert json.loads((launch / "result.json").read_text())["steps"] == config.grpo.max_steps
    # The adapter the ranks trained loads (and generates) as the registered version.
    assert summary["evaluation"]["models"]["grpo"]["n_samples"] == config.evaluation.n_samples


@pytest.mark.xdist_group("ranks")
def test_a_failing_rank_ends_the_group_with_its_error(tiny_config: PipelineConfig, tmp_path: Path) -> None:
    """A reward that cannot judge on rank 1 only: rank 1 stops (the None-share gate), rank 0 would wait for it in
    the next collective forever; the launcher ends it, and the stage raises rank 1's own error, as a gate stop."""
    (tmp_path / "rank_reward.py").write_text(
        "import os\n"
        "def judged_on_rank_0(completions, **kwargs):\n"
        "    return [None if os.environ.get('RANK') == '1' else 1.0 for _ in completions]\n"
    )
    config = _two_processes(
        tiny_config,
        "tiny-dead-rank",
        rewards=[{"name": "rank_reward:judged_on_rank_0", "path": str(tmp_path)}],
        sft={**tiny_config.sft.model_dump(), "enabled": False},
        probe={**tiny_config.probe.model_dump(), "enabled": False},
        canaries={"enabled": False},
    )
    with pytest.raises(GateStop, match=r"grpo rank 1: reward judged_on_rank_0 could not judge"):
        pipeline(config, "tiny-dead-rank")
    errors = list((config.output_dir / "tiny-dead-rank" / "grpo" / "launch").glob("rank-*.error.json"))
    assert [json.loads(p.read_text())["rank"] for p in errors] == [1]


def test_a_global_batch_that_splits_a_group_fails_at_load_time() -> None:
    from pydantic import ValidationError

    with pytest.raises(
        ValidationError, match=r"grpo.batch_size \(3, per process\) × 2 processes = 6 must be a multiple"
    ):
        PipelineConfig.model_validate(
            {"orchestration": {"num_processes": 2}, "grpo": {"batch_size": 3, "num_generations": 4}}
        )
    # Across processes a per-process batch smaller than a group is fine (TRL spreads a group over ranks).
    PipelineConfig.model_validate(
        {"orchestration": {"num_processes": 2}, "grpo": {"batch_size": 2, "num_generations": 4}}
    )
