"""GRPO's bf16 sampler, merged (the path before issue 59: the adapter folded into bf16 weights) against kept apart
(``UnmergedView``: the trainer's own weights), on the demo: seconds per GRPO step and the sampler–trainer agreement
each measures (``sampler/logp_difference``), from the demo run's SFT adapter and training file, alternated A/B so
the machine's drift falls on both. Names the CPU and whether it multiplies bf16 natively.

Run (after ``make demo``): .venv/bin/python bench/bench_bf16_sampler.py outputs/demo/RUN [--steps 10 --rounds 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import tasks.speedups.grpo_trainer as grpo_trainer  # noqa: E402
from tasks.config import load_config  # noqa: E402
from tasks.grpo import run_grpo  # noqa: E402
from tasks.models import resolve_model_source  # noqa: E402
from tasks.models.hardware import cpu_name  # noqa: E402
from tasks.models.precision import bf16_supported  # noqa: E402
from tasks.speedups.merged_copy import MergedCopy  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
KEY = "sampler/logp_difference"


def merged_sampler(policy: object, precision: str) -> object:
    """The sampler before the fix: a copy with the adapter merged into bf16 weights, sampled without autocast."""
    return grpo_trainer._Plain(MergedCopy(policy, torch.bfloat16), "fp32")


def one_run(run: Path, variant: str, steps: int) -> dict[str, float]:
    config = load_config(
        REPO / "configs" / "demo.yaml",
        {
            "output_dir": tempfile.mkdtemp(),
            "model.precision": "bf16",
            "grpo.max_steps": steps,
            "grpo.eval_steps": 0,
            "grpo.select": "last",
            "grpo.checkpoint_steps": 0,
            "grpo.stop.dead_signal_steps": 0,
            "grpo.generation.max_logp_difference": 10.0,  # measure the merged sampler, do not stop it
        },
    )
    original = grpo_trainer.sampler_model
    if variant == "merged":
        grpo_trainer.sampler_model = merged_sampler
    try:
        result = run_grpo(
            config,
            run / "validate" / "train.jsonl",
            resolve_model_source(config.model.source),
            run / "sft" / "adapter",
            Path(tempfile.mkdtemp()),
        )
    finally:
        grpo_trainer.sampler_model = original
    logged = [h for h in result.history if "step_time" in h][1:]  # the first step builds the sampler
    return {
        "step_s": statistics.median(h["step_time"] for h in logged),
        "mean": statistics.mean(h[f"{KEY}/mean"] for h in result.history if f"{KEY}/mean" in h),
        "max": max(h[f"{KEY}/max"] for h in result.history if f"{KEY}/max" in h),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run", type=Path, help="a demo run folder (outputs/demo/RUN)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    print(f"CPU: {cpu_name() or '?'}; native bf16: {bf16_supported()}; torch threads {torch.get_num_threads()}")
    results: dict[str, list[dict[str, float]]] = {"merged": [], "apart": []}
    for _ in range(args.rounds):
        for variant in ("merged", "apart"):
            results[variant].append(one_run(args.run, variant, args.steps))
            print(variant, {k: round(v, 4) for k, v in results[variant][-1].items()}, flush=True)
    print("| sampler | s / GRPO step (median of rounds) | agreement mean | agreement max |")
    print("|---|---|---|---|")
    for variant, runs in results.items():
        step = statistics.median(r["step_s"] for r in runs)
        print(
            f"| {variant} | {step:.2f} | {statistics.mean(r['mean'] for r in runs):.4f} | "
            f"{max(r['max'] for r in runs):.3f} |"
        )


if __name__ == "__main__":
    main()
