"""bench/gpu_check.py: the GPU check runs the SFT and GRPO stage functions where the lent GPU machine's packages
are all there is (no Prefect, MLflow or Great Expectations), and every wheel it carries is pinned by the lock."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.py"

# Run the script as if Prefect, MLflow and Great Expectations were not installed: importing them fails as a missing
# package does, and find_spec (how grpoflow, accelerate and transformers ask) says they are absent.
WITHOUT_ORCHESTRATION = """
import importlib.abc, importlib.util, runpy, sys
ABSENT = ("prefect", "mlflow", "great_expectations")
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ABSENT:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Absent())
find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a, **k: None if name.split(".")[0] in ABSENT else find_spec(name, *a, **k)
sys.argv = [sys.argv[1], *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
loaded = sorted({name.split(".")[0] for name in sys.modules} & set(ABSENT))
assert not loaded, loaded
"""


def test_gpu_check_runs_the_stage_functions_without_prefect_or_mlflow(tmp_path: Path, tiny_model_dir: Path) -> None:
    report_file = tmp_path / "report.json"
    small = [
        "--sft-steps",
        "2",
        "--grpo-steps",
        "2",
        "--completion-tokens",
        "8",
        "--gen-prompts",
        "4",
        "--gen-samples",
        "2",
        "--gen-tokens",
        "8",
        "--gen-batch",
        "8",
        "--recipe-steps",
        "2",
        "--recipe-batch",
        "4",
        "--recipe-generations",
        "2",
        "--recipe-tokens",
        "6",
    ]
    command = [
        sys.executable,
        "-c",
        WITHOUT_ORCHESTRATION,
        str(SCRIPT),
        "run",
        "--allow-cpu",
        "--model",
        "tiny-random",
        "--precision",
        "fp32",
        *small,
        "--json",
        str(report_file),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(report_file.read_text())
    assert report["weights"] == "random" and report["device"] == "cpu"
    assert report["sft"]["steps"] == 2 and report["grpo"]["steps"] == 2
    assert report["sft"]["step_s"] > 0 and report["grpo"]["step_s"] > 0
    assert 0 < report["grpo"]["mean_completion_tokens"] <= 8
    assert report["generation"]["new_tokens"] > 0 and report["generation"]["tokens_per_s"] > 0
    assert "| GRPO step |" in done.stdout  # the table a person reads, besides the JSON line
    # The GSM8K recipe's GRPO shapes (here shrunk): its steps, lengths and the sampler agreement, every step.
    recipe = report["recipe"]
    assert recipe["steps"] == 2 and recipe["batch_size"] == 4 and recipe["max_completion_length"] == 6
    assert 0 < recipe["mean_completion_tokens"] <= 6 and recipe["logp_difference_mean"] is not None
    assert "| GRPO step, GSM8K recipe's shapes |" in done.stdout


def test_every_carried_wheel_is_pinned_by_the_lock() -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(ROOT / "bench"))
    pins = gpu_check.lock_versions(gpu_check.WHEELS)
    assert [pin.split("==")[0] for pin in pins] == list(gpu_check.WHEELS)
    assert all(pin.split("==")[1][0].isdigit() for pin in pins)
    assert "trl==1.16.0" in pins
