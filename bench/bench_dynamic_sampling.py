"""The online difficulty filter (``grpo.dynamic_sampling``) off vs on, on a setting where signal is scarce: the demo
task (SmolLM2, 2-digit sums, boxed answers) after an SFT cut short, rewarded by correctness alone (``math_accuracy``;
the demo's format reward would give most groups some signal), so most groups are all-wrong. Both arms start
from the same SFT adapter, with the same seed and the same GRPO wall-time budget; then both are scored on the
same hold-out prompts.

Prints, per arm: steps done, the informative-group share per step (off: 1 − frac_reward_zero_std, what the loss
trained on; on: before and after the filter), extra prompts sampled, prompts retired, and hold-out greedy
accuracy and sampled pass@1; and the paired 95 % interval of the pass@1 difference (on − off).

    .venv/bin/python bench/bench_dynamic_sampling.py [--sft-steps 6] [--budget-s 240] [--prompts 100]
    .venv/bin/python bench/bench_dynamic_sampling.py --demo      # the demo's SFT and rewards: signal is plentiful
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transformers import TrainerCallback  # noqa: E402

import tasks  # noqa: E402,F401  (environment defaults)
from tasks.config import load_config  # noqa: E402
from tasks.evaluate import ModelSpec, compare, score_model  # noqa: E402
from tasks.grpo import run_grpo  # noqa: E402
from tasks.inputs import read_jsonl  # noqa: E402
from tasks.models import resolve_model_source  # noqa: E402
from tasks.sft import run_sft  # noqa: E402
from tasks.validate import run_validate  # noqa: E402


class WallBudget(TrainerCallback):
    """Stops training once ``seconds`` of training have passed (checked after each step)."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.started = seconds, None

    def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201, D102
        self.started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201, D102
        if time.perf_counter() - self.started > self.seconds:
            control.should_training_stop = True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sft-steps", type=int, default=6)
    parser.add_argument("--budget-s", type=float, default=240)
    parser.add_argument("--prompts", type=int, default=100)
    parser.add_argument("--oversample", type=float, default=3.0)
    parser.add_argument("--rewards", default="math_accuracy", help="comma-separated reward names (weight 1)")
    parser.add_argument("--demo", action="store_true", help="the demo's own setting: its SFT (30 steps), its rewards")
    args = parser.parse_args()
    if args.demo:
        args.sft_steps, args.rewards = 30, "demo"
    work = Path(tempfile.mkdtemp(prefix="bench-dynamic-"))
    config = load_config(
        ROOT / "configs" / "demo.yaml",
        {
            "output_dir": str(work / "out"),
            "sft.max_steps": args.sft_steps,
            **({} if args.demo else {"rewards": [{"name": name} for name in args.rewards.split(",")]}),
            "grpo.max_steps": 10_000,
            "grpo.checkpoint_steps": 0,
            "grpo.log_completions_every": 0,
            "grpo.stop.dead_signal_steps": 0,
            "evaluation.num_prompts": args.prompts,
            "evaluation.forgetting": False,
        },
    )
    base = resolve_model_source(config.model.source)
    split = run_validate(config, work / "validate")
    started = time.perf_counter()
    sft = run_sft(config, split.train_path, base, work / "sft")
    print(f"SFT {args.sft_steps} steps: {time.perf_counter() - started:.0f} s", flush=True)
    holdout = read_jsonl(split.holdout_path)[: args.prompts]
    arms = {}
    for name, enabled in (("off", False), ("on", True)):
        arm = load_config(
            ROOT / "configs" / "demo.yaml",
            {
                **{k: v for k, v in config.model_dump(mode="json").items() if k != "grpo"},
                "grpo": {
                    **config.grpo.model_dump(mode="json"),
                    "dynamic_sampling": {"enabled": enabled, "max_oversample": args.oversample},
                },
            },
        )
        started = time.perf_counter()
        result = run_grpo(
            arm, split.train_path, base, sft.adapter_dir, work / f"grpo-{name}", callbacks=[WallBudget(args.budget_s)]
        )
        seconds = time.perf_counter() - started
        steps = [entry for entry in result.history if "frac_reward_zero_std" in entry]
        trained_on = [1.0 - entry["frac_reward_zero_std"] for entry in steps]
        before = [entry.get("signal/informative_before", 1.0 - entry["frac_reward_zero_std"]) for entry in steps]
        scores = score_model(arm, ModelSpec(f"grpo-{name}", base, result.adapter_dir), holdout)
        arms[name] = {
            "steps": result.steps,
            "grpo_seconds": round(seconds, 1),
            "seconds_per_step": round(seconds / max(result.steps, 1), 2),
            "informative_sampled_mean": round(sum(before) / len(before), 3),
            "informative_trained_mean": round(sum(trained_on) / len(trained_on), 3),
            "informative_trained_per_step": [round(v, 2) for v in trained_on],
            "extra_prompts": sum(entry.get("signal/extra_prompts", 0.0) for entry in steps),
            "prompts_retired": max((entry.get("signal/prompts_retired", 0.0) for entry in steps), default=0.0),
            "greedy_accuracy": scores.greedy_accuracy,
            "sampled_pass1": scores.pass_at_k[1],
            "_scores": scores,
        }
        print(f"arm {name}: {json.dumps({k: v for k, v in arms[name].items() if not k.startswith('_')})}", flush=True)
    difference = compare(config, arms["on"]["_scores"], arms["off"]["_scores"])
    ratio = arms["on"]["informative_trained_mean"] / max(arms["off"]["informative_trained_mean"], 1e-9)
    report = {
        "bench": "dynamic_sampling",
        "rewards": args.rewards,
        "sft_steps": args.sft_steps,
        "budget_s": args.budget_s,
        "arms": {name: {k: v for k, v in arm.items() if not k.startswith("_")} for name, arm in arms.items()},
        "informative_share_ratio": round(ratio, 2),
        "pass1_difference_on_minus_off": difference,
    }
    print(json.dumps(report))
    print(f"\n{'':28}{'off':>10}{'on':>10}")
    shown = ["steps", "seconds_per_step", "informative_sampled_mean", "informative_trained_mean", "extra_prompts"]
    for key in [*shown, "prompts_retired", "greedy_accuracy", "sampled_pass1"]:
        print(f"{key:28}{arms['off'][key]:>10.3g}{arms['on'][key]:>10.3g}")
    print(f"informative share trained on: {ratio:.2f}× with the filter")
    print(
        f"sampled pass@1 on − off: {difference['mean']:+.1%} [{difference['low']:+.1%}, {difference['high']:+.1%}] "
        f"(paired 95% CI, n={difference['n']})"
    )


if __name__ == "__main__":
    main()
