"""vLLM's records under the console's rules, in a real process (no vLLM needed: its records come through the
``vllm`` logger, which grpoflow routes before vLLM is imported). tests/vllm checks a real engine's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

# What vLLM does: records while it is imported, then more once the engine runs (after its log file is named).
SCRIPT = """
import logging, os, sys
from pathlib import Path
import tasks
from tasks.models.vllm_logs import route_vllm_logging
assert os.environ["VLLM_CONFIGURE_LOGGING"] == "0"
log = logging.getLogger("vllm.platforms")
log.info("early info"); log.warning("early warning")
route_vllm_logging(Path(sys.argv[1]))
log.warning("later warning"); log.error("an error")
logging.getLogger("tasks.x").warning("grpoflow's own warning")
"""


def _run(tmp_path: Path, mode: str) -> tuple[str, str]:
    log_file = tmp_path / mode / "vllm.log"
    env = {**os.environ, "GRPOFLOW_CONSOLE": mode}
    env.pop("VLLM_CONFIGURE_LOGGING", None)
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(log_file)], capture_output=True, text=True, env=env, cwd=REPO, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout + done.stderr, log_file.read_text()


@pytest.mark.parametrize("mode", ["normal", "quiet"])
def test_vllm_records_go_to_their_file_and_only_errors_to_the_console(tmp_path: Path, mode: str) -> None:
    console, kept = _run(tmp_path, mode)
    assert "an error" in console
    assert not any(line in console for line in ("early info", "early warning", "later warning"))
    assert "grpoflow's own warning" in console  # the rule is vLLM's, not everyone's
    # Everything vLLM said, in order, the records before the file was named included.
    said = [line.split(": ", 1)[1] for line in kept.splitlines()]
    assert said == ["early info", "early warning", "later warning", "an error"]


def test_verbose_shows_vllm_records_on_the_console_too(tmp_path: Path) -> None:
    console, kept = _run(tmp_path, "verbose")
    for line in ("early info", "early warning", "later warning", "an error"):
        assert line in console and line in kept
