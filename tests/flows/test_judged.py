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
from tasks.training import RewardNoneLimitExceeded

REPO = Path(__file__).resolve().parents[2]


def _with_rewards(config: PipelineConfig, extra: dict, name: str) -> PipelineConfig:
    return PipelineConfig.model_validate(
        {
            **config.model_dump(),
            "rewards": [*[spec.model_dump() for spec in config.rewards], extra],
            "tracking": {**config.tracking.model_dump(), "registered_model_name": name},
        }
    )


class _Command:
    name = "grpoflow"

    def main(self, args: list[str], prog_name: str | None = None, **extra: object) -> None:
        main(list(args))


def test_a_reward_model_trains_registers_and_rescore_reads_its_cached_verdicts(
    tiny_config: PipelineConfig, tiny_reward_model_dir: Path
) -> None:
    spec = {"name": "reward_model", "args": {"model": str(tiny_reward_model_dir)}, "weight": 0.5}
    config = _with_rewards(tiny_config, spec, "tiny-judged")
    summary = pipeline(config, "tiny-rm")
    assert summary["promotion"]["version"] == "1"
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


def test_a_judge_that_is_down_stops_grpo_at_the_none_guard_and_nothing_is_registered(
    tiny_config: PipelineConfig,
) -> None:
    spec = {
        "name": "llm_judge",
        "args": {"url": "http://127.0.0.1:9/v1", "model": "judge", "max_retries": 1, "backoff_s": 0.01},
    }
    config = _with_rewards(tiny_config, spec, "tiny-judge-down")
    with pytest.raises(RewardNoneLimitExceeded, match=r"reward llm_judge could not judge 16/16 .*ConnectError"):
        pipeline(config, "tiny-down")
    summary = json.loads((config.output_dir / "tiny-down" / "summary.json").read_text())
    assert "promotion" not in summary or not summary["promotion"].get("version")
