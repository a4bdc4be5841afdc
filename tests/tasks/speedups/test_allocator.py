"""glibc keeps freed memory for grpoflow's processes and their children, unless the user tuned it."""

import os
import subprocess
import sys
from pathlib import Path

from tasks.speedups.allocator import FREED_MEMORY_KEPT, keep_freed_memory

REPO = Path(__file__).resolve().parents[3]
PROBE = "import os, tasks; print(sorted(k for k in os.environ if k.startswith('MALLOC_')))"


def _fresh_interpreter(env: dict[str, str]) -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=REPO, env={**clean, **env}, capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


def test_importing_tasks_keeps_freed_memory_here_and_in_child_processes() -> None:
    assert _fresh_interpreter({}) == str(sorted(FREED_MEMORY_KEPT))
    environ: dict[str, str] = {}
    assert keep_freed_memory(environ) is True  # mallopt took every setting in this (glibc) process
    assert environ == {name: str(value) for name, (_, value) in FREED_MEMORY_KEPT.items()}


def test_a_users_own_allocator_setting_wins() -> None:
    assert _fresh_interpreter({"MALLOC_TRIM_THRESHOLD_": "0"}) == "['MALLOC_TRIM_THRESHOLD_']"
    assert keep_freed_memory({"MALLOC_TOP_PAD_": "0"}) is False
