"""The sampler–trainer agreement check: measured on every GRPO step, logged, and stopping the run at the first step
whose sampler no longer samples the policy being trained."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tasks.config import PipelineConfig, load_config
from tasks.training import SamplerAgreement, SamplerAgreementGuard, SamplerMismatch

REPO = Path(__file__).resolve().parents[3]
MEAN, MAX = "sampler/logp_difference/mean", "sampler/logp_difference/max"


class _State:
    def __init__(self, step: int) -> None:
        self.global_step = step


def test_the_guard_stops_at_the_first_step_past_the_bound_and_names_it() -> None:
    tally = SamplerAgreement()
    guard = SamplerAgreementGuard(tally, 0.05, "transformers")
    tally.add(0.4, 10, 0.1, step=1)  # mean 0.04: within
    guard.on_step_end(None, _State(1), None)
    tally.add(0.6, 10, 0.2, step=2)
    with pytest.raises(SamplerMismatch, match=r"^step 2: the transformers sampler's .* by 0\.0600 on average \(max"):
        guard.on_step_end(None, _State(2), None)
    tally.add(float("nan"), 1, 0.0, step=3)
    with pytest.raises(SamplerMismatch, match="step 3"):
        guard.on_step_end(None, _State(3), None)


def test_a_log_line_covers_the_steps_since_the_last_with_a_token_weighted_mean_and_the_max() -> None:
    tally = SamplerAgreement()
    tally.add(1.0, 10, 0.5, step=1)
    tally.add(3.0, 10, 0.9, step=2)
    assert tally.window() == {MEAN: 0.2, MAX: 0.9}
    assert tally.window() == {}
    tally.add(0.5, 5, 0.2, step=3)
    assert tally.window() == {MEAN: 0.1, MAX: 0.2}
    assert tally.summary() == {"mean": pytest.approx(0.5 / 3), "max_step_mean": 0.3, "max": 0.9, "steps": 3}


def _config(tmp_path: Path, precision: str, **changes: Any) -> PipelineConfig:
    """The tiny pipeline with a reward its random model can move (length), so the adapter changes every step."""
    settings = {
        "output_dir": str(tmp_path / "outputs"),
        "model.precision": precision,
        "rewards": [{"name": "length_closeness", "args": {"target_chars": 6}}],
        "canaries.enabled": False,
        "grpo.stop.dead_signal_steps": 0,
        "grpo.checkpoint_steps": 0,
        "grpo.log_completions_every": 0,
        "grpo.learning_rate": 5e-2,
        **changes,
    }
    return load_config(REPO / "configs" / "tiny.yaml", settings)


def _run(config: PipelineConfig, tmp_path: Path) -> Any:
    from tasks.grpo import run_grpo
    from tasks.models import resolve_model_source
    from tasks.validate import run_validate

    split = run_validate(config, tmp_path / "split")
    return run_grpo(config, split.train_path, resolve_model_source(config.model.source), None, tmp_path / "grpo")


def test_bf16_grpo_measures_agreement_on_every_step_and_its_sampler_is_the_trainers_policy(tmp_path: Path) -> None:
    result = _run(_config(tmp_path, "bf16", **{"grpo.max_steps": 4}), tmp_path)
    measured = [entry for entry in result.history if MEAN in entry]
    assert len(measured) == 4  # every step, not the first few
    assert max(entry[MAX] for entry in measured) < 1e-3  # the bound test_sampler_model measures
    assert "transformers" in result.generated_by


def test_a_sampler_that_stops_updating_mid_run_stops_grpo_at_that_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fp32 samples from a merged copy refreshed after each optimizer step; from the third step on, it is not:
    the samples come from the policy of step 2 while the trainer trains on, and the run stops at step 3."""
    from tasks.speedups import merged_copy

    refresh = merged_copy.MergedCopy.refresh
    refreshes: list[int] = []

    def stops_at_step_3(self: Any) -> Any:
        refreshes.append(1)
        # The copy refreshes once as it is built (step 1), then before each step's sampling: 2 is, 3 is not.
        return self.model if len(refreshes) >= 3 else refresh(self)

    monkeypatch.setattr(merged_copy.MergedCopy, "refresh", stops_at_step_3)
    config = _config(tmp_path, "fp32", **{"grpo.max_steps": 6, "grpo.generation.max_logp_difference": 0.01})
    with pytest.raises(SamplerMismatch, match=r"^step 3: the transformers sampler's log-probs differ"):
        _run(config, tmp_path)
