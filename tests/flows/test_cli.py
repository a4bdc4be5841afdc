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
