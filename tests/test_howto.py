"""The how-to pages' commands and example files, run as a user runs them where this CPU allows (docs/howto/): the
configs pass ``grpoflow check`` from another folder (the tiny model standing in for a Hub model this machine cannot
fetch), the custom reward's canaries all run, the tool's canary and trace rows pass, and every page is linked."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "configs" / "examples"


def check(config: Path, tmp_path: Path, *overrides: str) -> str:
    """``grpoflow check CONFIG`` from another folder; its output (stderr and stdout)."""
    sets = [f"--set=output_dir={tmp_path / 'out'}", *(f"--set={item}" for item in overrides)]
    done = subprocess.run(
        [sys.executable, "-m", "flows.cli", "check", str(config), *sets],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return " ".join((done.stdout + done.stderr).split())


def test_own_data_checks_on_a_cpu_with_the_tiny_model_for_the_hub_model(tmp_path: Path) -> None:
    said = check(
        EXAMPLES / "my-math" / "config.yaml",
        tmp_path,
        "model.source=tiny-random",
        "grpo.generation.backend=transformers",
    )
    assert "data: ok (40/40 rows kept" in said and "tracking store: ok" in said


def test_own_tool_checks_its_canary_and_keeps_its_trace_rows(tmp_path: Path) -> None:
    said = check(EXAMPLES / "exchange-tool" / "config.yaml", tmp_path, "model.source=tiny-random-tools")
    assert "tools: ok (exchange_rate: 1 canaries passed" in said and "data: ok (60/60 rows kept" in said


def test_own_reward_has_canaries_for_every_configured_reward(tmp_path: Path) -> None:
    from tasks.config import load_config
    from tasks.validate import run_validate

    config = load_config(EXAMPLES / "ticket-routing" / "config.yaml", {"output_dir": str(tmp_path / "out")})
    run_validate(config, tmp_path / "validate")
    report = __import__("json").loads((tmp_path / "validate" / "canaries.json").read_text())
    assert report["unchecked"] == [] and report["disagreements"] == [] and report["checks"]["route_reward"] == 6


@pytest.mark.parametrize("page", sorted((REPO / "docs" / "howto").glob("*.md")), ids=lambda p: p.name)
def test_every_how_to_is_linked_from_readme_and_names_what_was_tested(page: Path) -> None:
    assert f"docs/howto/{page.name}" in (REPO / "README.md").read_text()
    assert re.search(r"\*\*Tested here\*\*", page.read_text())
