"""``grpoflow rollouts`` and ``grpoflow rescore`` on the tiny pipeline's run (its folder and its MLflow run)."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from flows.cli import main

REPO = Path(__file__).resolve().parents[2]


class _Command:
    name = "grpoflow"

    def main(self, args: list[str], prog_name: str | None = None, **extra: object) -> None:
        main(list(args))


def grpoflow(*args: str):
    return CliRunner().invoke(_Command(), list(args))  # type: ignore[arg-type]


def _common(config) -> list[str]:
    return ["-c", str(REPO / "configs" / "tiny.yaml"), "--set", f"output_dir={config.output_dir}"]


def test_rollouts_filters_a_runs_ledger(registered_tiny) -> None:
    config, _ = registered_tiny
    batch = config.grpo.batch_size
    result = grpoflow("rollouts", "tiny-e2e-1", "--steps", "2", "--format", "jsonl", "--limit", "0", *_common(config))
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == batch and {r["step"] for r in rows} == {2} and all(r["role"] == "grpo" for r in rows)
    worst = grpoflow("rollouts", "tiny-e2e-1", "--worst", "1", "--format", "jsonl", "--limit", "0", *_common(config))
    groups = {(r["generation_batch"], r["group"]) for r in map(json.loads, worst.stdout.splitlines())}
    assert len(groups) == 1
    probe = grpoflow(
        "rollouts", "tiny-e2e-1", "--role", "probe_base", "--format", "jsonl", "--limit", "0", *_common(config)
    )
    assert len(probe.stdout.splitlines()) == config.probe.num_prompts * config.grpo.num_generations
    one = rows[0]
    same = grpoflow(
        "rollouts",
        "tiny-e2e-1",
        "--prompt-id",
        one["prompt_id"],
        "--grep",
        one["completion"][:3],
        "--format",
        "jsonl",
        *_common(config),
    )
    assert one["prompt_id"] in same.stdout
    table = grpoflow("rollouts", "tiny-e2e-1", "--diff", "1", "2", *_common(config))
    text = " ".join(table.output.split())  # two steps of 2 prompts from ~100: none is drawn twice
    assert table.exit_code == 0 and "no prompt was sampled both by step 1 and from step 2" in text
    assert "1→2" in text


def test_rollouts_reads_the_mlflow_run_when_the_folder_is_gone(registered_tiny, tmp_path: Path) -> None:
    config, _ = registered_tiny
    uri = config.resolved_tracking_uri()
    result = grpoflow(
        "rollouts",
        "tiny-e2e-1",
        "--format",
        "jsonl",
        "--limit",
        "0",
        "--tracking-uri",
        uri,
        "-c",
        str(REPO / "configs" / "tiny.yaml"),
        "--set",
        f"output_dir={tmp_path}",
    )
    assert result.exit_code == 0, result.output
    assert len(result.stdout.splitlines()) == config.grpo.batch_size * config.grpo.max_steps
    missing = grpoflow(
        "rollouts",
        "no-such-run",
        "--tracking-uri",
        uri,
        "-c",
        str(REPO / "configs" / "tiny.yaml"),
        "--set",
        f"output_dir={tmp_path}",
    )
    assert missing.exit_code == 2 and "no rollout ledger for 'no-such-run'" in missing.output


def test_rescore_says_what_a_changed_reward_would_have_done(registered_tiny, tmp_path: Path) -> None:
    config, _ = registered_tiny
    (tmp_path / "new_rewards.py").write_text(
        "def longer(completions, **kwargs):\n    return [len(c) / 12 for c in completions]\n\n\n"
        "def math_accuracy(completions, **kwargs):\n    return [1.0] * len(completions)\n"
    )
    same = grpoflow("rescore", "tiny-e2e-1", "--reward", "boxed_format", *_common(config))
    assert same.exit_code == 0, same.output
    report = json.loads(same.stdout[same.stdout.index("{") :])
    assert report["agreement"] == 1.0 and report["to_informative"] == report["to_uninformative"] == 0
    changed = grpoflow(
        "rescore", "tiny-e2e-1", "--reward", "new_rewards:longer", "--path", str(tmp_path), *_common(config)
    )
    report = json.loads(changed.stdout[changed.stdout.index("{") :])
    assert report["rows"] == config.grpo.batch_size * config.grpo.max_steps and report["to_informative"] > 0
    broken = grpoflow(
        "rescore", "tiny-e2e-1", "--reward", "new_rewards:math_accuracy", "--path", str(tmp_path), *_common(config)
    )
    assert broken.exit_code == 2 and "fails" in broken.output and "canary" in broken.output
