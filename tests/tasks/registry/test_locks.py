"""Locks a killed holder cannot keep: the promotion lock after a SIGKILL, and the first use of a new tracking
store by two processes at once (real processes, a real SQLite store)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tasks.registry import promotion_lock
from tasks.tracking import LockTimeout

REPO = Path(__file__).resolve().parents[3]
OPEN_STORE = """
import sys
from tasks.tracking import client_for
client = client_for(sys.argv[1])
client.create_experiment(sys.argv[2])
print("ok")
"""


def test_a_promotion_killed_inside_the_lock_does_not_block_the_next(tmp_path: Path, lock_holder) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    holder = lock_holder(uri)
    try:
        with pytest.raises(LockTimeout, match="pid"), promotion_lock(uri, "locked-model", timeout_s=1):
            pass  # a live holder still serialises promotions
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()
    started = time.monotonic()
    with promotion_lock(uri, "locked-model", timeout_s=60):
        waited = time.monotonic() - started
    assert waited < 5  # released by the kernel with its holder, not after a lease or by hand


def test_two_processes_can_open_a_new_store_at_once(tmp_path: Path) -> None:
    for attempt in range(3):
        uri = f"sqlite:///{tmp_path / f'store-{attempt}' / 'mlflow.db'}"
        (tmp_path / f"store-{attempt}").mkdir()
        processes = [
            subprocess.Popen(
                [sys.executable, "-c", OPEN_STORE, uri, name],
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for name in ("first", "second")
        ]
        for process in processes:
            out, err = process.communicate(timeout=120)
            assert process.returncode == 0 and out.strip() == "ok", err[-2000:]
