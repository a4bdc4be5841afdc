import os
import subprocess
import sys
import time
from pathlib import Path

from typer.testing import CliRunner

from flows.cli import app

runner = CliRunner()


def test_typo_in_config_fails_naming_the_key(tmp_path: Path) -> None:
    config = tmp_path / "typo.yaml"
    config.write_text("grpo:\n  num_generation: 4\n")
    result = runner.invoke(app, ["run", str(config)])
    assert result.exit_code == 2
    assert "grpo.num_generation" in result.output


def test_validate_command_writes_the_split(tmp_path: Path) -> None:
    result = runner.invoke(
        app,
        ["validate", "configs/tiny.yaml", "--set", f"output_dir={tmp_path}", "--set", "data.arithmetic.num_rows=50"],
    )
    assert result.exit_code == 0, result.output
    assert (tmp_path / "validate" / "train.jsonl").is_file()
    assert '"rows_in": 50' in result.output


def _registered(tmp_path: Path, adapter: Path, versions: int = 2) -> Path:
    """A config file whose MLflow store holds ``versions`` versions of the tiny adapter; the last is champion."""
    import yaml

    from tasks.config import load_config
    from tasks.layout import RunLayout
    from tasks.registry import client_for, move_champion, register_adapter
    from tasks.runs import start_pipeline

    config_path = tmp_path / "cli.yaml"
    config_path.write_text(
        yaml.safe_dump(
            {
                **yaml.safe_load(Path("configs/tiny.yaml").read_text()),
                "output_dir": str(tmp_path / "out"),
                "tracking": {"registered_model_name": "cli-model"},
            }
        )
    )
    config = load_config(config_path)
    tracker = start_pipeline(config, RunLayout(tmp_path / "out" / "cli-run"))
    client = client_for(config.resolved_tracking_uri())
    with tracker.stage("promote") as stage:
        stage.log_artifact(adapter, "adapter")
        for _ in range(versions):
            version = register_adapter(client, "cli-model", stage.run_id, "adapter", {"base_model": "tiny-random"})
            move_champion(client, "cli-model", version, "test")
    return config_path


def test_generate_export_rollback_and_evaluate_by_alias(tmp_path: Path, tiny_adapter: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from tasks.models import load_policy
    from tasks.sources import resolve_model_source

    config = _registered(tmp_path, tiny_adapter)
    result = runner.invoke(
        app,
        [
            "generate",
            "What is 1 + 1?",
            "--model",
            "models:/cli-model@champion",
            "--config",
            str(config),
            "--max-new-tokens",
            "5",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "version 2" in result.output

    merged = tmp_path / "merged"
    result = runner.invoke(
        app, ["export", "models:/cli-model@champion", "--merged", str(merged), "--config", str(config)]
    )
    assert result.exit_code == 0, result.output
    plain = AutoModelForCausalLM.from_pretrained(merged)
    assert not any("lora" in name for name, _ in plain.named_parameters())
    policy = load_policy(resolve_model_source("tiny-random"), tiny_adapter)
    ids = torch.tensor([[5, 6, 7, 8]])
    torch.testing.assert_close(plain(ids).logits, policy(ids).logits, rtol=1e-4, atol=1e-4)

    result = runner.invoke(app, ["rollback", "cli-model", "--config", str(config), "--reason", "bad outputs"])
    assert result.exit_code == 0, result.output
    assert "cli-model@champion → version 1" in result.output

    result = runner.invoke(app, ["evaluate", str(config), "--model", "models:/cli-model@champion"])
    assert result.exit_code == 0, result.output
    assert "v1" in result.output and "pass@1" in result.output


def _grpoflow(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "flows.cli", "run", "configs/tiny.yaml", "--set", f"output_dir={tmp_path}", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)


def test_a_user_error_prints_what_and_what_to_do_without_a_traceback(tmp_path: Path) -> None:
    result = _grpoflow(tmp_path, "--set", f"data.source={tmp_path / 'missing.jsonl'}")
    output = result.stdout + result.stderr
    assert result.returncode == 2 and "Traceback" not in output, output[-3000:]
    error_lines = [line for line in output.splitlines() if "ERROR" in line or line.startswith(("error:", "fix "))]
    assert len(error_lines) <= 3, error_lines  # Prefect's lines about it stay off the console
    assert result.stderr.strip().splitlines()[-2:] == [
        f"error: data file not found: {tmp_path / 'missing.jsonl'}",
        "fix the input named above and run again (exit 2; --debug shows the traceback)",
    ]


def test_an_unreachable_tracking_server_fails_fast_naming_it(tmp_path: Path) -> None:
    started = time.monotonic()
    result = _grpoflow(tmp_path, "--set", "tracking.tracking_uri=http://127.0.0.1:9", "--debug")
    assert result.returncode != 0 and time.monotonic() - started < 90  # MLflow's own retries took ~4 minutes
    assert "RegistryError: MLflow at http://127.0.0.1:9 is unavailable" in result.stderr  # --debug: the traceback
    assert "Traceback" in result.stderr
