"""Judged rewards in the whole pipeline: a locally built reward model trains the tiny model to a registered
version, its verdicts cached and ``rescore`` answered from the cache; a judge that is down stops the run at the
None guard with one clear error and nothing is registered."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from flows.cli import main
from flows.pipeline import pipeline
from tasks.config import PipelineConfig
from tasks.tracking import RUN_ID_TAG, client_for
from tasks.training import RewardNoneLimitExceeded
from tasks.validate import JudgeCanaryFailed
from tests.conftest import rule_judge

REPO = Path(__file__).resolve().parents[2]


def _with_rewards(config: PipelineConfig, extra: dict, name: str, **canaries: object) -> PipelineConfig:
    return PipelineConfig.model_validate(
        {
            **config.model_dump(),
            "rewards": [*[spec.model_dump() for spec in config.rewards], extra],
            "tracking": {**config.tracking.model_dump(), "registered_model_name": name},
            "canaries": {**config.canaries.model_dump(), **canaries},
        }
    )


class _Command:
    name = "grpoflow"

    def main(self, args: list[str], prog_name: str | None = None, **extra: object) -> None:
        main(list(args))


def test_a_reward_model_trains_registers_and_rescore_reads_its_cached_verdicts(
    tiny_config: PipelineConfig, tiny_reward_model_dir: Path, judge_server, tmp_path: Path, capfd
) -> None:
    """Beside it an LLM judge that needs a key, given in a file: the run's artifacts, files and logs hold no key."""
    key = "judge-secret-4f0b2e"
    judge_server.api_key = key
    (tmp_path / "judge.key").write_text(key)
    llm = {"url": judge_server.url, "model": "judge", "api_key_file": str(tmp_path / "judge.key")}
    spec = {"name": "reward_model", "args": {"model": str(tiny_reward_model_dir)}, "weight": 0.5}
    config = _with_rewards(tiny_config, spec, "tiny-judged", judge_min_ordered=0.0)  # random weights order nothing
    config = _with_rewards(config, {"name": "llm_judge", "args": llm, "weight": 0.25}, "tiny-judged")
    config = config.model_copy(update={"promotion": config.promotion.model_copy(update={"metric": "judged_win_rate"})})
    summary = pipeline(config, "tiny-rm")
    assert summary["promotion"]["version"] == "1" and "judged win rate" in summary["promotion"]["reason"]
    rate = summary["evaluation"]["judged_win_rate"]["reward_model"]
    assert rate["against"] == "sft" and rate["n"] == config.evaluation.num_prompts and 0.0 <= rate["mean"] <= 1.0
    client = client_for(config.resolved_tracking_uri())
    experiment = client.get_experiment_by_name(config.tracking.experiment_name)
    runs = client.search_runs([experiment.experiment_id], f"tags.`{RUN_ID_TAG}` = 'tiny-rm'")
    probe = next(r for r in runs if r.data.tags.get("grpoflow.stage") == "probe_base")
    bias = {k: v for k, v in probe.data.metrics.items() if k.startswith("judge_bias/reward_model/")}
    # (no correlation: the tiny model is never right, so the verifiable reward does not vary)
    assert {"length_gain", "padded_higher_share", "judged_on_incorrect"} <= {k.rsplit("/", 1)[1] for k in bias}
    steps = config.grpo.batch_size * config.grpo.max_steps
    result = CliRunner().invoke(
        _Command(),  # type: ignore[arg-type]
        [
            "rescore",
            "tiny-rm",
            "--reward",
            "reward_model",
            "-c",
            str(REPO / "configs" / "tiny.yaml"),
            "--set",
            f"output_dir={config.output_dir}",
            "--set",
            f"rewards={json.dumps([s.model_dump(mode='json') for s in config.rewards])}",
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout[result.stdout.index("{") :])
    assert report["rows"] == steps and report["agreement"] == 1.0  # the same verdicts the run trained on
    assert report["judge"] == {"from_cache": steps, "asked": 0, "requests": 0}  # none computed again
    assert len(judge_server.requests) > steps  # the keyed judge answered: canaries, probes, GRPO, evaluation
    said = capfd.readouterr()
    assert key not in said.out + said.err
    store = Path(config.resolved_tracking_uri().removeprefix("sqlite:///")).parent
    for folder in {config.output_dir, store}:
        for path in folder.rglob("*"):
            assert not path.is_file() or key.encode() not in path.read_bytes(), path


def test_a_judge_that_is_down_stops_the_run_at_its_canaries_or_mid_run_at_the_none_guard(
    tiny_config: PipelineConfig,
) -> None:
    args = {"url": "http://127.0.0.1:9/v1", "model": "judge", "max_retries": 1, "backoff_s": 0.01}
    down = _with_rewards(tiny_config, {"name": "llm_judge", "args": args}, "tiny-judge-down")
    with pytest.raises(JudgeCanaryFailed, match=r"ordered 0/16 canary pairs .* 16 unjudged"):
        pipeline(down, "tiny-down-early")
    # Down only once training started (no canaries to catch it): GRPO's verdicts are None, the guard stops the run
    # before evaluation and promotion.
    late = _with_rewards(tiny_config, {"name": "llm_judge", "args": args}, "tiny-judge-down", judge_pairs=0)
    with pytest.raises(RewardNoneLimitExceeded, match=r"reward llm_judge could not judge 16/16 .*ConnectError"):
        pipeline(late, "tiny-down")
    summary = json.loads((late.output_dir / "tiny-down" / "summary.json").read_text())
    assert "promotion" not in summary or not summary["promotion"].get("version")


def test_a_judge_that_cannot_order_its_canaries_stops_the_run_before_training(
    tiny_config: PipelineConfig, judge_server
) -> None:
    judge_server.answer = lambda payload: "5"  # the same score for every answer: every pair ties
    spec = {"name": "llm_judge", "args": {"url": judge_server.url, "model": "judge"}}
    config = _with_rewards(tiny_config, spec, "tiny-judge-blind")
    with pytest.raises(JudgeCanaryFailed, match=r"ordered 0/16 canary pairs right \(0% < .* 80%\): 16 tied"):
        pipeline(config, "tiny-blind")
    summary = json.loads((config.output_dir / "tiny-blind" / "summary.json").read_text())
    assert set(summary["stage_seconds"]) <= {"validate"}
    judge_server.answer = rule_judge  # a judge that reads the reference passes them (another judge: its digest)
    spec["args"]["model_digest"] = "rule-judge"
    pipeline_ok = _with_rewards(tiny_config, spec, "tiny-judge-ok", judge_pairs=8)
    from tasks.validate import run_validate

    result = run_validate(pipeline_ok, pipeline_ok.output_dir / "validate-only")
    assert [r["passed"] for r in result.judge_canaries] == [True] and result.judge_canaries[0]["pairs"] == 8
