"""End to end: the real Prefect flow on the tiny model, with a real MLflow store in a temp dir."""

import asyncio
import json
from pathlib import Path

import pytest

from flows.pipeline import pipeline
from tasks.config import PipelineConfig
from tasks.inputs import fingerprint, read_jsonl
from tasks.probe import NoLearningSignal
from tasks.tracking import RUN_ID_TAG, client_for

STAGES = {"validate", "probe_base", "sft", "probe_sft", "grpo", "champion", "evaluate", "promote"}


def _runs(config: PipelineConfig, run_id: str) -> list:
    client = client_for(config.resolved_tracking_uri())
    experiment = client.get_experiment_by_name(config.tracking.experiment_name)
    return client.search_runs([experiment.experiment_id], f"tags.`{RUN_ID_TAG}` = '{run_id}'")


def _flow_run_names() -> set[str]:
    from prefect.client.orchestration import get_client

    async def names() -> set[str]:
        async with get_client() as client:
            return {run.name for run in await client.read_flow_runs(limit=50)}

    return asyncio.run(names())


def test_pipeline_runs_every_stage_and_registers_versions(registered_tiny) -> None:
    tiny_config, summary = registered_tiny
    assert set(summary["stage_seconds"]) == STAGES
    assert set(summary["evaluation"]["models"]) == {"base", "sft", "grpo"}
    assert summary["promotion"]["version"] == "1"
    assert (tiny_config.output_dir / "tiny-e2e-1" / "summary.json").is_file()

    runs = _runs(tiny_config, "tiny-e2e-1")
    parent = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    stages = {r.data.tags["grpoflow.stage"]: r for r in runs if "mlflow.parentRunId" in r.data.tags}
    assert len(parent) == 1 and parent[0].info.status == "FINISHED"
    assert set(stages) == STAGES and all(r.info.status == "FINISHED" for r in stages.values())
    assert all(r.data.tags["mlflow.parentRunId"] == parent[0].info.run_id for r in stages.values())
    client = client_for(tiny_config.resolved_tracking_uri())
    grpo_history = client.get_metric_history(stages["grpo"].info.run_id, "reward")
    assert [m.step for m in grpo_history] == list(range(1, tiny_config.grpo.max_steps + 1))
    assert "loss" in stages["sft"].data.metrics and "peak_rss_mb" in stages["sft"].data.metrics
    assert "grpo_pass_at_1" in stages["evaluate"].data.metrics
    assert stages["validate"].data.tags["data_fingerprint"] == summary["data"]["fingerprint"]
    artifacts = {a.path for a in client.list_artifacts(stages["grpo"].info.run_id, "completions")}
    assert artifacts == {f"completions/step_{s:05d}.json" for s in range(1, tiny_config.grpo.max_steps + 1)}
    table_file = client.download_artifacts(stages["grpo"].info.run_id, "completions/step_00001.json")
    table = json.loads(Path(table_file).read_text())
    assert {
        "prompt",
        "completion",
        "reward/math_accuracy",
        "reward/boxed_format",
        "reward_total",
        "advantage",
        "trained",
    } <= set(table["columns"])
    ledger = {a.path for a in client.list_artifacts(stages["grpo"].info.run_id, "rollouts")}
    # one part per checkpoint: with select best (tiny.yaml), a checkpoint at every evaluation, here every step
    assert ledger == {f"rollouts/grpo-{s:06d}-{s:06d}.parquet" for s in range(1, tiny_config.grpo.max_steps + 1)}
    assert client.list_artifacts(stages["validate"].info.run_id, "validate/data_docs")
    assert summary["probes"]["sft"]["verdict"].startswith("GRPO goes ahead")

    name = tiny_config.tracking.registered_model_name
    version = client.get_model_version(name, "1")
    assert version.tags["pipeline_run_id"] == "tiny-e2e-1"
    assert version.tags["base_model"] == "tiny-random"
    assert version.tags["data_fingerprint"] == summary["data"]["fingerprint"]
    assert version.tags["config_hash"] == tiny_config.config_hash()
    assert client.get_model_version(f"{name}-sft", "1").tags["pipeline_run_id"] == "tiny-e2e-1"
    # Every result names the engine that sampled it: summary.json, the evaluation and probe runs, the version.
    saved = json.loads((tiny_config.output_dir / "tiny-e2e-1" / "summary.json").read_text())
    assert saved["evaluation"]["engine"] == "transformers"
    assert {m["engine"] for m in saved["evaluation"]["models"].values()} == {"transformers"}
    assert saved["probes"]["sft"]["engine"] == "transformers"
    assert stages["evaluate"].data.params["generation_engine"] == "transformers"
    assert stages["probe_sft"].data.params["generation_engine"] == "transformers"
    assert version.tags["evaluation_engine"] == "transformers"
    assert "tiny-e2e-1" in _flow_run_names()

    # Data lineage: the pipeline's run and every stage's run list the two validated splits as MLflow datasets,
    # digested by grpoflow's fingerprint of the split's rows; the version's tags name the digests.
    digests = {"train": summary["data"]["train_digest"], "holdout": summary["data"]["holdout_digest"]}
    assert digests["train"] == fingerprint(read_jsonl(Path(summary["data"]["train_path"])))
    assert digests["holdout"] == fingerprint(read_jsonl(Path(summary["data"]["holdout_path"])))
    assert _datasets(client, parent[0].info.run_id) == {
        "train": (digests["train"], "training"),
        "holdout": (digests["holdout"], "evaluation"),
    }
    assert all(_datasets(client, r.info.run_id) == _datasets(client, parent[0].info.run_id) for r in stages.values())
    assert (version.tags["data_train_digest"], version.tags["data_holdout_digest"]) == (
        digests["train"],
        digests["holdout"],
    )

    # In-training hold-out scores (tiny.yaml: every step, select best): curves in the GRPO run, the step handed on
    # named in its tags and the summary, and that checkpoint's adapter is the registered version's, byte for byte.
    steps = list(range(1, tiny_config.grpo.max_steps + 1))
    for key in ("eval_holdout_pass_at_1", "eval_holdout_greedy_accuracy", "eval_holdout_reward"):
        assert [m.step for m in client.get_metric_history(stages["grpo"].info.run_id, key)] == steps
    selected = summary["grpo"]["selected"]
    assert selected["select"] == "best" and selected["step"] in steps
    assert stages["grpo"].data.tags["grpo.selected_step"] == str(selected["step"])
    grpo_dir = tiny_config.output_dir / "tiny-e2e-1" / "grpo"
    chosen = (grpo_dir / "checkpoints" / f"checkpoint-{selected['step']}" / "adapter_model.safetensors").read_bytes()
    registered = Path(client.download_artifacts(version.run_id, "", str(tiny_config.output_dir / "v1")))
    assert {p.read_bytes() for p in registered.rglob("adapter_model.safetensors")} == {chosen}

    # A second run (another seed) registers a second version of each; the built-in task draws its rows from the
    # seed, so other data: other digests, each run's own.
    second = PipelineConfig.model_validate({**tiny_config.model_dump(), "seed": 2})
    second_summary = pipeline(second, "tiny-e2e-2")
    assert second_summary["promotion"]["version"] == "2"
    assert client.get_model_version(f"{name}-sft", "2")
    second_train = second_summary["data"]["train_digest"]
    assert client.get_model_version(name, "2").tags["data_train_digest"] == second_train != digests["train"]


def _datasets(client, run_id: str) -> dict[str, tuple[str, str]]:  # noqa: ANN001
    """``{name: (digest, context)}`` of the MLflow datasets a run lists (each once)."""
    inputs = client.get_run(run_id).inputs.dataset_inputs
    listed = {
        item.dataset.name: (item.dataset.digest, {t.key: t.value for t in item.tags}["mlflow.data.context"])
        for item in inputs
    }
    assert len(listed) == len(inputs)
    return listed


def test_probe_gate_stops_before_grpo_and_registers_nothing(tiny_config: PipelineConfig) -> None:
    gated = PipelineConfig.model_validate(
        {
            **tiny_config.model_dump(),
            "rewards": [{"name": "math_accuracy"}],
            "probe": {**tiny_config.probe.model_dump(), "min_signal_share": 0.5},
        }
    )
    with pytest.raises(NoLearningSignal, match="all rewards 0 in"):
        pipeline(gated, "tiny-gated")
    summary = json.loads((gated.output_dir / "tiny-gated" / "summary.json").read_text())
    assert "all-zero rewards" in summary["stopped"]
    assert "grpo" not in summary["stage_seconds"]
    runs = _runs(gated, "tiny-gated")
    assert all(r.info.status in ("FINISHED", "FAILED") for r in runs)  # nothing left RUNNING
    client = client_for(gated.resolved_tracking_uri())
    assert not client.search_model_versions(f"name = '{gated.tracking.registered_model_name}'")


def test_pipeline_with_speedups_off_runs_stock_trl_and_transformers(tiny_config: PipelineConfig) -> None:
    """The path GPU workers with vLLM take: TRL's own GRPOTrainer and SFTTrainer, transformers' generate."""
    stock = PipelineConfig.model_validate(
        {
            **tiny_config.model_dump(),
            "sft": {**tiny_config.sft.model_dump(), "speedups": "off"},
            "grpo": {**tiny_config.grpo.model_dump(), "speedups": "off"},
            "tracking": {**tiny_config.tracking.model_dump(), "registered_model_name": "tiny-stock"},
        }
    )
    summary = pipeline(stock, "tiny-stock")
    assert set(summary["stage_seconds"]) == STAGES and summary["promotion"]["version"] == "1"
    stages = {r.data.tags["grpoflow.stage"]: r for r in _runs(stock, "tiny-stock") if "grpoflow.stage" in r.data.tags}
    assert stages["grpo"].data.tags["grpo.trainer"] == "StockGRPOTrainer"
    assert stages["grpo"].data.metrics["train_steps"] == stock.grpo.max_steps
    assert summary["evaluation"]["models"]["grpo"]["n_samples"] == stock.evaluation.n_samples


def test_dead_signal_stops_grpo_which_still_goes_to_evaluation_and_promotion(
    tiny_config: PipelineConfig, tmp_path: Path
) -> None:
    (tmp_path / "always_zero.py").write_text("def never(completions, **kwargs):\n    return [0.0] * len(completions)\n")
    dead = PipelineConfig.model_validate(
        {
            **tiny_config.model_dump(),
            "rewards": [{"name": "always_zero:never", "path": str(tmp_path)}],
            "sft": {**tiny_config.sft.model_dump(), "enabled": False},
            "probe": {**tiny_config.probe.model_dump(), "min_signal_share": 0.0},  # the probe lets it through
            "grpo": {**tiny_config.grpo.model_dump(), "max_steps": 12, "stop": {"dead_signal_steps": 3}},
        }
    )
    summary = pipeline(dead, "tiny-dead")
    stopped = summary["grpo"]["stopped"]
    assert stopped["cause"] == "dead_signal" and stopped["step"] == 3 and summary["grpo"]["steps"] == 3
    assert "frac_reward_zero_std 1.00 > 0.95 for 3 steps" in stopped["message"]
    assert set(summary["evaluation"]["models"]) == {"base", "grpo"}  # the adapter it has is evaluated
    assert summary["promotion"]["reason"]  # and promotion decided on it
    grpo_run = next(r for r in _runs(dead, "tiny-dead") if r.data.tags.get("grpoflow.stage") == "grpo")
    assert grpo_run.data.tags["grpo.stopped"] == "dead_signal" and grpo_run.data.metrics["stopped_at_step"] == 3


@pytest.mark.pretrained
@pytest.mark.xdist_group("smollm2")  # one worker converts SmolLM2 for both tests that need it
def test_humaneval_config_stops_smollm2_at_the_base_probe(tmp_path: Path) -> None:
    """configs/humaneval.yaml on real data and the real SmolLM2: every sampled program runs in the sandbox, none
    solves its problem, and the gate stops the run before any training (fewer samples here than the config's)."""
    from tasks.config import load_config

    config = load_config(
        Path(__file__).resolve().parents[2] / "configs" / "humaneval.yaml",
        {
            "output_dir": str(tmp_path / "outputs"),
            "probe.num_prompts": 4,
            "grpo.num_generations": 4,
            "grpo.max_completion_length": 64,  # cut programs fail their tests too: judged all the same
        },
    )
    with pytest.raises(NoLearningSignal, match="differ in correctness"):
        pipeline(config, "humaneval-gate")
    summary = json.loads((config.output_dir / "humaneval-gate" / "summary.json").read_text())
    assert summary["data"]["rows_kept"] == 164 and summary["data"]["rows_quarantined"] == 0
    assert set(summary["stage_seconds"]) == {"validate", "probe_base"}
    samples = (config.output_dir / "humaneval-gate").rglob("probe_base_samples.jsonl")
    rows = [json.loads(line) for path in samples for line in path.read_text().splitlines()]
    assert len(rows) == 16 and all(row["code_tests"] is not None for row in rows)  # every program was judged


def test_missing_inputs_fail_before_any_stage_starts(tiny_config: PipelineConfig, tmp_path) -> None:
    """On a worker too (the flow itself checks): every missing input is named, and nothing was started."""
    from tasks.preflight import PreflightError

    broken = PipelineConfig.model_validate(
        {
            **tiny_config.model_dump(),
            "data": {**tiny_config.data.model_dump(), "source": str(tmp_path / "missing.jsonl")},
            "model": {"source": str(tmp_path / "no-such-model")},
        }
    )
    with pytest.raises(PreflightError) as error:
        pipeline(broken, "tiny-missing-data")
    assert f"data.source: data file not found: {tmp_path / 'missing.jsonl'}" in str(error.value)
    assert f"model.source: model folder not found: {tmp_path / 'no-such-model'}" in str(error.value)
    assert not (tiny_config.output_dir / "tiny-missing-data").exists()
    assert not (tiny_config.output_dir / "mlflow.db").exists()  # no MLflow run was opened


def test_stages_retry_transient_failures_only() -> None:
    """A user error or a gate's stop fails the same way again: not retried; a transient failure is."""
    from prefect import flow, task

    from flows.pipeline import worth_retrying
    from tasks.errors import UserError

    calls = {"user error": 0, "transient": 0}

    @task(retries=2, retry_delay_seconds=0, retry_condition_fn=worth_retrying)
    def fails(kind: str) -> None:
        calls[kind] += 1
        raise UserError("bad input") if kind == "user error" else ConnectionError("a blip")

    @flow
    def both() -> None:
        for kind in list(calls):
            with pytest.raises((UserError, ConnectionError)):
                fails(kind)

    both()
    assert calls == {"user error": 1, "transient": 3}
