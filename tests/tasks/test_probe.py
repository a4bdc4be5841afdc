"""The probe on the tiny model with real reward functions: an all-zero reward stops, a mixed one passes."""

from pathlib import Path

import pytest

from tasks.config import PipelineConfig
from tasks.probe import gate_message, pass_rate_filter, run_probe


def _with_rewards(config: PipelineConfig, rewards: list[dict]) -> PipelineConfig:
    return PipelineConfig.model_validate({**config.model_dump(), "rewards": rewards})


def test_all_zero_reward_gives_the_all_zero_message(tiny_config, tiny_split, tiny_model_dir, tmp_path) -> None:
    # A random model never boxes a correct sum: math accuracy is 0 in every group.
    config = _with_rewards(tiny_config, [{"name": "math_accuracy"}])
    result = run_probe(config, tiny_split.train_path, tiny_model_dir, None, tmp_path, "base")
    assert result.signal_share == 0.0 and result.all_zero_groups == result.prompts
    message = gate_message(result, 0.1, ["sample text"])
    assert message is not None
    assert f"all rewards 0 in {result.prompts}/{result.prompts} groups" in message
    assert "all-zero rewards" in message and "sample text" in message
    assert result.histogram_path.is_file() and result.samples_path.is_file()


def test_mixed_reward_passes_the_gate(tiny_config, tiny_split, tiny_model_dir, tmp_path) -> None:
    # Completion lengths differ within a group, so a length reward carries signal.
    config = _with_rewards(tiny_config, [{"name": "length_closeness", "args": {"target_chars": 5}}])
    result = run_probe(config, tiny_split.train_path, tiny_model_dir, None, tmp_path, "base")
    assert result.signal_share > 0.5
    assert gate_message(result, 0.1) is None


def test_probe_is_reproducible(tiny_config, tiny_split, tiny_model_dir, tmp_path) -> None:
    config = _with_rewards(tiny_config, [{"name": "length_closeness"}])
    first = run_probe(config, tiny_split.train_path, tiny_model_dir, None, tmp_path / "a", "base")
    second = run_probe(config, tiny_split.train_path, tiny_model_dir, None, tmp_path / "b", "base")
    assert first.reward_mean == second.reward_mean
    assert Path(first.samples_path).read_text() == Path(second.samples_path).read_text()


@pytest.mark.parametrize("band", [(0.1, 0.9), (0.0, 0.0), (0.5, 1.0)])
def test_pass_rate_filter_keeps_exactly_the_band(band) -> None:
    from tasks.probe import ProbeResult

    rates = {f"p{i}": i / 8 for i in range(9)}
    result = ProbeResult("sft", 9, 8, 0.0, 0.0, {}, 1.0, 0, 0, 0.5, rates)
    kept = pass_rate_filter(result, band)
    assert kept == {k for k, v in rates.items() if band[0] <= v <= band[1]}


def test_two_processes_sample_what_one_samples(tiny_config, tiny_split, tiny_model_dir, tmp_path, caplog) -> None:
    """Every other batch in a forked worker: the same completions and rewards, prompt for prompt."""
    config = _with_rewards(tiny_config, [{"name": "length_closeness"}])

    def probe(processes: int, folder: str):
        probe_settings = config.probe.model_copy(update={"processes": processes, "batch_size": 8})
        return run_probe(
            config.model_copy(update={"probe": probe_settings}),
            tiny_split.train_path,
            tiny_model_dir,
            None,
            tmp_path / folder,
            "base",
        )

    one = probe(1, "one")
    with caplog.at_level("INFO", logger="tasks.evaluation.parallel"):
        two = probe(2, "two")
    assert "in 2 processes" in caplog.text
    assert Path(one.samples_path).read_text() == Path(two.samples_path).read_text()
    assert one.reward_mean == two.reward_mean and one.prompts > 8 // config.grpo.num_generations  # several batches
