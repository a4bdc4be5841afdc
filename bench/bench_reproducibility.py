"""Same config, seed and thread count → the same adapter, on the real model: N short GRPO runs on SmolLM2 (the demo's
config, a fresh LoRA or ``--sft-adapter``, ``--steps`` steps), each in a fresh process, every other one with
processes burning every core beside it; prints each adapter's sha256 and how many distinct adapters there were.

Run: .venv/bin/python bench/bench_reproducibility.py [--runs 5] [--steps 3] [--sft-adapter DIR] [--set key=value]
Goal (issue 33): 1 distinct adapter.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def one_run(output: Path, steps: int, overrides: list[str], sft_adapter: Path | None) -> str:
    """One GRPO stage in this process; returns the adapter's sha256."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from flows.cli.common import parse_value  # what `grpoflow --set` does with a value
    from tasks.config import load_config
    from tasks.grpo import run_grpo
    from tasks.models import resolve_model_source
    from tasks.validate import run_validate

    values = {"output_dir": str(output), "grpo": {"max_steps": steps, "logging_steps": 1}}
    for item in overrides:
        key, _, value = item.partition("=")
        values[key] = parse_value(value)
    config = load_config(REPO / "configs" / "demo.yaml", values)
    split = run_validate(config, output / "validate")
    result = run_grpo(config, split.train_path, resolve_model_source(config.model.source), sft_adapter, output / "grpo")
    return hashlib.sha256((result.adapter_dir / "adapter_model.safetensors").read_bytes()).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="a config key, as key=value")
    parser.add_argument("--sft-adapter", type=Path, help="continue this SFT adapter (default: a fresh LoRA)")
    parser.add_argument("--one", type=Path, help=argparse.SUPPRESS)  # the child: one run into this folder
    args = parser.parse_args()
    if args.one:
        print("SHA256", one_run(args.one, args.steps, args.overrides, args.sft_adapter), flush=True)
        return
    root = Path(tempfile.mkdtemp(prefix="bench-reproducibility-"))
    hashes = []
    for run in range(args.runs):
        loaded = run % 2 == 1
        burners = (
            [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
            if loaded
            else []
        )
        started = time.perf_counter()
        try:
            child = [sys.executable, __file__, "--one", str(root / f"run-{run}"), "--steps", str(args.steps)]
            child += [item for override in args.overrides for item in ("--set", override)]
            child += ["--sft-adapter", str(args.sft_adapter)] if args.sft_adapter else []
            out = subprocess.run(child, capture_output=True, text=True, check=False)
        finally:
            for burner in burners:
                burner.kill()
                burner.wait()
        lines = [line for line in out.stdout.splitlines() if line.startswith("SHA256 ")]
        if out.returncode != 0 or not lines:
            sys.exit(f"run {run + 1} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
        hashes.append(lines[-1].split()[1])
        print(
            f"run {run + 1} ({'beside CPU burners' if loaded else 'idle'}, {time.perf_counter() - started:.0f} s): "
            f"{hashes[-1][:16]}",
            flush=True,
        )
    print(json.dumps({"runs": args.runs, "steps": args.steps, "distinct": len(set(hashes)), "sha256": hashes}))
    print(f"{len(set(hashes))} distinct adapter(s) in {args.runs} runs")


if __name__ == "__main__":
    main()
