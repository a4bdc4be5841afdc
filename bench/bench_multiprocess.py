"""Multi-process runs end cleanly: the tiny pipeline on two processes (SFT and GRPO each an accelerate-launched
group, gloo on CPU), N times in a row; prints how many runs had every rank of both stages exit 0.

Run: .venv/bin/python bench/bench_multiprocess.py [--runs 10]
Goal (issue 33): 10 of 10. A rank that aborts at exit after its work ("terminate called without an active
exception") shows here as a non-zero exit code in ``<stage>/launch/exit.json``, even though the stage keeps the
finished adapter.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")

from flows.pipeline import pipeline  # noqa: E402
from tasks.config import load_config  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    output = Path(tempfile.mkdtemp(prefix="bench-multiprocess-"))
    overrides = {
        "output_dir": str(output),
        "orchestration": {"num_processes": 2},
        "grpo": {"batch_size": 4},  # per process: 2 × 4 completions = two groups of 4 per step
        "model": {"precision": "bf16"},
    }
    config = load_config(REPO / "configs" / "tiny.yaml", overrides)
    clean, codes = 0, []
    for run in range(args.runs):
        started = time.perf_counter()
        run_id = f"mp-{run}"
        pipeline(config, run_id)
        exits = {
            stage: json.loads((output / run_id / stage / "launch" / "exit.json").read_text())["returncode"]
            for stage in ("sft", "grpo")
        }
        clean += all(code == 0 for code in exits.values())
        codes.append(exits)
        print(f"run {run + 1}: exit codes {exits} ({time.perf_counter() - started:.0f} s)", flush=True)
    print(json.dumps({"runs": args.runs, "clean": clean, "exit_codes": codes}))
    print(f"{clean} of {args.runs} runs ended cleanly")


if __name__ == "__main__":
    main()
