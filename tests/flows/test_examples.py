"""The bring-your-own-data example (configs/examples/ticket-routing) on the tiny model, from another folder:
its relative data path resolves against the config's folder, its custom reward imports from there and gets the
example's own column (``priority``), and the run registers a version."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from flows.cli import main
from tasks.config import load_config

EXAMPLE = Path(__file__).resolve().parents[2] / "configs" / "examples" / "ticket-routing" / "config.yaml"
TINY = {
    "model.source": "tiny-random",
    "sft.max_steps": 2,
    "grpo.max_steps": 2,
    "grpo.batch_size": 8,
    "grpo.num_generations": 4,
    "probe.num_prompts": 8,
    "probe.min_signal_share": 0.0,
    "evaluation.num_prompts": 8,
    "evaluation.n_samples": 2,
    "evaluation.k": [1, 2],
    "evaluation.bootstrap_resamples": 200,
}


class _Command:
    name = "grpoflow"

    def main(self, args: list[str], prog_name: str | None = None, **extra: object) -> None:
        main(list(args))


def test_check_passes_on_the_example_from_another_folder(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(_Command(), ["check", str(EXAMPLE), "--set", f"output_dir={tmp_path / 'out'}"])  # type: ignore[arg-type]
    assert result.exit_code == 0, result.output
    assert "data: ok (120/120 rows kept" in result.output and "tracking store: ok" in result.output


def test_the_example_runs_on_the_tiny_model_and_its_reward_gets_its_own_column(tmp_path: Path, monkeypatch) -> None:
    from flows.pipeline import pipeline

    monkeypatch.chdir(tmp_path)
    config = load_config(EXAMPLE, {**TINY, "output_dir": str(tmp_path / "out")})
    assert config.data.source == str(EXAMPLE.parent / "tickets.jsonl")
    summary = pipeline(config, "byod")
    route = summary["probes"]["base"]["per_function"]["route_reward"]
    assert route["none"] == 0 and route["mean"] == route["mean"]  # scored every sample: `priority` reached it
    assert summary["data"]["rows_kept"] == 120 and summary["promotion"]["version"] == "1"
    # docs/howto/own-reward.md: a reward tried on the finished run's samples (its canaries first)
    sets = [item for key, value in TINY.items() for item in ("--set", f"{key}={value}")]
    args = ["rescore", "byod", "--reward", "routing_rewards:route_reward", "--config", str(EXAMPLE), *sets]
    result = CliRunner().invoke(_Command(), [*args, "--set", f"output_dir={tmp_path / 'out'}"])  # type: ignore[arg-type]
    assert result.exit_code == 0, result.output
    assert "route_reward" in result.output
