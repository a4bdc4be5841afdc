import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from flows.cli import main

runner = CliRunner()
REPO = Path(__file__).resolve().parents[2]


class _Command:
    """What CliRunner calls (``.main``): here ``flows.cli.main``, the error boundary the console script runs."""

    name = "grpoflow"

    def main(self, args: list[str], prog_name: str | None = None, **extra: object) -> None:
        main(list(args))


def grpoflow(*args: str) -> Result:
    return runner.invoke(_Command(), list(args))  # type: ignore[arg-type]


def test_typo_in_config_fails_naming_the_key(tmp_path: Path) -> None:
    config = tmp_path / "typo.yaml"
    config.write_text("grpo:\n  num_generation: 4\n")
    result = grpoflow(*["run", str(config)])
    assert result.exit_code == 2
    assert "grpo.num_generation" in result.output and "did you mean grpo.num_generations?" in result.output


def test_validate_command_writes_the_split(tmp_path: Path) -> None:
    # validate tracks nothing: a tracking server that does not answer (only a run checks it) does not stop it
    result = grpoflow(
        *[
            "validate",
            "configs/tiny.yaml",
            "--set",
            f"output_dir={tmp_path}",
            "--set",
            "data.arithmetic.num_rows=50",
            "--set",
            "tracking.tracking_uri=http://127.0.0.1:9",
        ],
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
    from tasks.tracking import start_pipeline

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

    from tasks.models import load_policy, resolve_model_source

    config = _registered(tmp_path, tiny_adapter)
    result = grpoflow(
        *[
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
    result = grpoflow(*["export", "models:/cli-model@champion", "--merged", str(merged), "--config", str(config)])
    assert result.exit_code == 0, result.output
    plain = AutoModelForCausalLM.from_pretrained(merged)
    assert not any("lora" in name for name, _ in plain.named_parameters())
    policy = load_policy(resolve_model_source("tiny-random"), tiny_adapter)
    ids = torch.tensor([[5, 6, 7, 8]])
    torch.testing.assert_close(plain(ids).logits, policy(ids).logits, rtol=1e-4, atol=1e-4)

    result = grpoflow(*["rollback", "cli-model", "--config", str(config), "--reason", "bad outputs"])
    assert result.exit_code == 0, result.output
    assert "cli-model@champion → version 1" in result.output
    # A forced move, then a plain rollback: back to the champion before the forced move (v1), by any store option.
    result = grpoflow("rollback", "cli-model", "--to", "2", "--set", f"output_dir={tmp_path / 'out'}")
    assert result.exit_code == 0 and "cli-model@champion → version 2" in result.output, result.output
    uri = f"sqlite:///{tmp_path / 'out' / 'mlflow.db'}"
    result = grpoflow("rollback", "cli-model", "--tracking-uri", uri)
    assert result.exit_code == 0 and "cli-model@champion → version 1" in result.output, result.output
    assert f"store: {uri}" in result.output
    result = grpoflow("history", "cli-model", "--config", str(config))
    assert result.exit_code == 0 and "(now: v1)" in result.output, result.output
    cells = [line.split("│") for line in result.output.splitlines() if line.startswith("│")]
    assert [row[3].strip() for row in cells if row[1].strip()] == ["promote", "promote", "undo", "set", "undo"]
    result = grpoflow("versions", "cli-model", "--config", str(config))
    assert result.exit_code == 0 and "champion" in result.output, result.output

    result = grpoflow(*["evaluate", str(config), "--model", "models:/cli-model@champion"])
    assert result.exit_code == 0, result.output
    assert "v1" in result.output and "pass@1" in result.output


def _grpoflow(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "flows.cli", "run", "configs/tiny.yaml", "--set", f"output_dir={tmp_path}", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)


def test_a_user_error_inside_the_flow_prints_what_and_what_to_do_without_a_traceback(tmp_path: Path) -> None:
    data = tmp_path / "gsm.jsonl"
    data.write_text('{"question": "1+1?", "answer": "2"}\n' * 20)
    result = _grpoflow(tmp_path, "--set", f"data.source={data}")
    output = result.stdout + result.stderr
    assert result.returncode == 2 and "Traceback" not in output, output[-3000:]
    error_lines = [line for line in output.splitlines() if "ERROR" in line or line.startswith(("error:", "fix "))]
    assert len(error_lines) <= 3, error_lines  # Prefect's lines about it stay off the console
    last = result.stderr.strip().splitlines()[-2:]
    assert last[0].startswith(f"error: {data} has no column 'prompt', 'ground_truth' (its columns: 'answer', ")
    assert "map yours with data.columns" in last[0]
    assert last[1] == "fix the input named above and run again (exit 2; --debug shows the traceback)"


USER_ERRORS = {
    "missing data file": (["run", "--set", "data.source=missing.jsonl"], "data.source: data file not found: "),
    "missing model folder": (["run", "--set", "model.source=./models/none"], "model folder not found: "),
    "path taken for a Hub id": (["run", "--set", "model.source=models/my-model"], "is neither a folder"),
    "reward not importable": (
        ["check", "--set", 'rewards=[{"name": "no_such_module:score"}]'],
        "the module must be importable",
    ),
    "registry command before any run": (["generate", "hi", "--model", "models:/nope/3"], "no tracking store at "),
    "rollback before any run": (["rollback", "nope"], "no tracking store at "),
}


@pytest.mark.parametrize("case", list(USER_ERRORS))
def test_user_errors_print_at_most_three_lines_and_exit_2(tmp_path: Path, case: str) -> None:
    args, expected = USER_ERRORS[case]
    config = tmp_path / "c.yaml"
    config.write_text(Path("configs/tiny.yaml").read_text() + f"\noutput_dir: {tmp_path / 'out'}\n")
    command = [sys.executable, "-m", "flows.cli", args[0], *(["--config", str(config)]), *args[1:]]
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)},
    )
    lines = result.stderr.splitlines()
    errors = lines[next((i for i, line in enumerate(lines) if line.startswith("error:")), 0) :]
    assert result.returncode == 2 and len(errors) <= 3 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert not any("ERROR" in line or "Error" in line for line in lines if line not in errors), lines
    assert expected in errors[0], errors


def test_an_unreachable_tracking_server_fails_fast_naming_it(tmp_path: Path) -> None:
    started = time.monotonic()
    result = _grpoflow(tmp_path, "--set", "tracking.tracking_uri=http://127.0.0.1:9", "--debug")
    assert result.returncode != 0 and time.monotonic() - started < 90  # MLflow's own retries took ~4 minutes
    assert "RegistryError: MLflow at http://127.0.0.1:9 is unavailable" in result.stderr  # --debug: the traceback
    assert "Traceback" in result.stderr


def test_registry_commands_touch_nothing_and_name_user_errors(registered_tiny, tmp_path: Path) -> None:
    """A registry command on a store that does not exist creates none; an unknown model or version, or a rollback
    with no earlier champion, is a user error (exit 2); a rollback on a local store starts no Prefect server."""
    config, _ = registered_tiny
    uri = config.resolved_tracking_uri()
    fresh = tmp_path / "fresh"
    result = grpoflow("versions", "grpoflow-tiny", "--set", f"output_dir={fresh}")
    assert result.exit_code == 2 and "no tracking store at" in result.output and not fresh.exists()
    result = grpoflow("rollback", "nope", "--tracking-uri", uri)
    assert result.exit_code == 2 and "no registered model 'nope'" in result.output
    result = grpoflow("generate", "hi", "--model", "models:/grpoflow-tiny/99", "--tracking-uri", uri)
    assert result.exit_code == 2 and "models:/grpoflow-tiny/99 does not exist" in result.output
    script = (
        "import sys; from flows.cli import main\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit as exit:\n    code = exit.code\nelse:\n    code = 0\n"
        "print('EXIT', code, 'prefect server imported:', 'prefect.server.api.server' in sys.modules)\n"
    )
    command = [sys.executable, "-c", script, "rollback", "grpoflow-tiny", "--tracking-uri", uri]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=120, cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"}
    )
    assert "EXIT 2 prefect server imported: False" in done.stdout, done.stdout + done.stderr[-2000:]
    assert "has no earlier champion to roll back to" in done.stderr
    history = grpoflow("history", "grpoflow-tiny-sft", "--tracking-uri", uri)  # never champion: no moves
    assert history.exit_code == 0 and "(none)" in history.output.splitlines()[-1]


def test_check_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = grpoflow("check", "configs/tiny.yaml", "--set", f"output_dir={out}")
    assert result.exit_code == 0, result.output
    assert "data: ok (" in result.output and "a new local store, created at" in result.output
    assert not out.exists()
    # What the machine offers and what this config will use of it (a GPU user's first question).
    import torch

    output = " ".join(result.output.split())  # the console wraps long lines
    assert "hardware: no CUDA device" in output and f"torch {torch.__version__}" in output
    assert "uses: precision auto → " in output and "trains on the CPU, samples with transformers" in output


def test_check_refuses_an_in_training_slice_the_hold_out_cannot_spare(tmp_path: Path) -> None:
    """What the split decides is known in validate: check (and run, before any model) name the keys."""
    sets = ["grpo.eval_steps=1", "grpo.eval_prompts=500", f"output_dir={tmp_path / 'out'}"]
    result = grpoflow("check", "configs/tiny.yaml", *[arg for value in sets for arg in ("--set", value)])
    assert result.exit_code == 2, result.output
    assert "grpo.eval_prompts (500) takes every row of the hold-out split" in result.output
    assert "data.holdout_fraction" in result.output


def test_quiet_shows_only_the_result_and_verbose_shows_every_log_line(tmp_path: Path) -> None:
    def validate(*flags: str) -> str:
        command = [
            sys.executable,
            "-m",
            "flows.cli",
            "validate",
            "configs/tiny.yaml",
            "--set",
            f"output_dir={tmp_path}",
            "--set",
            "data.arithmetic.num_rows=50",
            *flags,
        ]
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout + done.stderr

    normal, quiet, verbose = validate(), validate("--quiet"), validate("--verbose")
    for output in (normal, quiet, verbose):
        assert '"rows_in": 50' in output  # the result, whatever the console shows
    assert "config: configs/tiny.yaml" in normal and "Created temporary directory" not in normal
    assert "config:" not in quiet and "INFO" not in quiet
    # --verbose: the libraries' info lines too (Great Expectations' docs-site folder).
    assert "config: configs/tiny.yaml" in verbose and "Created temporary directory" in verbose


def test_the_command_line_starts_without_the_heavy_stack() -> None:
    """Every command imports the CLI first: neither torch nor math-verify's sympy may come with it (the registry
    commands answer in about a second; math-verify is loaded where reward functions are built)."""
    probe = (
        "import sys, flows.cli; heavy = ('torch', 'transformers', 'sympy', 'math_verify'); "
        "before = [m for m in heavy if m in sys.modules]; "
        "from reward_fns.registry import build_reward_functions; build_reward_functions([{'name': 'math_accuracy'}]); "
        "print(before, 'math_verify' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[] True", out.stdout + out.stderr


GENERATION_MISTAKES = {
    # vLLM asked for in-process where it is not installed (make test's venv has none): a user error.
    "vllm missing": (["--set", "grpo.generation.backend=vllm"], 2, "vLLM is not installed here"),
    # a server that does not answer: an infrastructure error.
    "server down": (
        [
            "--set",
            "grpo.generation.vllm_mode=server",
            "--set",
            "grpo.generation.vllm_server_base_url=http://127.0.0.1:9",
        ],
        4,
        "vLLM server http://127.0.0.1:9 is not answering",
    ),
}


@pytest.mark.parametrize("case", list(GENERATION_MISTAKES))
def test_check_names_the_generation_mistakes_run_refuses_with_the_same_message(tmp_path: Path, case: str) -> None:
    args, code, expected = GENERATION_MISTAKES[case]
    outputs = {}
    for command in ("check", "run"):
        done = subprocess.run(
            [sys.executable, "-m", "flows.cli", command, "configs/tiny.yaml", "--set", f"output_dir={tmp_path}", *args],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        assert done.returncode == code and len(errors) == 1 and expected in errors[0], done.stderr[-2000:]
        outputs[command] = errors[0]
    assert outputs["check"] == outputs["run"]
