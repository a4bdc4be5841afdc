"""Orchestration overhead: grpoflow's GRPO stage, run as a Prefect task inside a flow with its MLflow run and
callbacks, against (a) the same stage's plain function (``run_grpo``: grpoflow's trainer, no Prefect, no MLflow)
— the orchestration overhead — and (b) a plain TRL script with the identical GRPOConfig, model, LoRA, data and
reward — what a user would otherwise run. Same process, same machine. Reports the ratios of seconds per step
and of total wall time, on SmolLM2-135M and on the tiny model.

Run: .venv/bin/python bench/bench_overhead.py [--steps 6 --tiny-steps 20]   (about 4 minutes)
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from prefect import flow  # noqa: E402

import tasks  # noqa: E402,F401  (telemetry off)
from reward_fns.registry import build_reward_functions  # noqa: E402
from tasks.config import load_config  # noqa: E402
from tasks.grpo import grpo_examples, grpo_task, run_grpo  # noqa: E402
from tasks.layout import RunLayout  # noqa: E402
from tasks.models import (  # noqa: E402
    load_policy,
    load_tokenizer,
    resolve_model_source,  # noqa: E402
)
from tasks.tracking import finish_pipeline, start_pipeline  # noqa: E402
from tasks.training import (
    grpo_training_args,  # noqa: E402
    lora_config,  # noqa: E402
)
from tasks.validate import run_validate  # noqa: E402


def plain_trl(config, train_path: Path, base: Path, out: Path) -> tuple[float, list[float]]:
    """What a user would write with TRL alone: the same arguments, no Prefect, no MLflow, no callbacks."""
    from datasets import Dataset
    from trl import GRPOTrainer

    from tasks.inputs import read_jsonl

    started = time.perf_counter()
    tokenizer = load_tokenizer(base)
    dataset = Dataset.from_list(grpo_examples(read_jsonl(train_path), tokenizer, config))
    rewards, weights = build_reward_functions(config.rewards)
    args = grpo_training_args(config, out, "transformers", weights)  # the stage's own GRPOConfig, identical
    args.disable_tqdm = True
    trainer = GRPOTrainer(
        model=load_policy(base, None),
        reward_funcs=rewards,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=lora_config(config),
    )
    trainer.train()
    trainer.save_model(str(out / "adapter"))
    steps = [entry["step_time"] for entry in trainer.state.log_history if "step_time" in entry]
    return time.perf_counter() - started, steps


def plain_grpoflow(config, train_path: Path, base: Path, out: Path) -> tuple[float, list[float]]:
    """grpoflow's GRPO stage as a plain function: its trainer, without Prefect, MLflow or callbacks."""
    started = time.perf_counter()
    result = run_grpo(config, train_path, base, None, out)
    return time.perf_counter() - started, [entry["step_time"] for entry in result.history if "step_time" in entry]


@flow(name="bench-overhead")
def orchestrated(config, train_path: Path, base: Path) -> tuple[float, list[float]]:
    started = time.perf_counter()
    tracker = start_pipeline(config, RunLayout(config.output_dir / "bench-overhead"))
    result = grpo_task(config, tracker, train_path, base, None)
    finish_pipeline(tracker, "FINISHED")
    return time.perf_counter() - started, [entry["step_time"] for entry in result.history if "step_time" in entry]


def compare(model: str, steps: int, work: Path) -> dict:
    config = load_config(
        "configs/demo.yaml" if model != "tiny-random" else "configs/tiny.yaml",
        {
            "model.source": model,
            "grpo.max_steps": steps,
            "grpo.checkpoint_steps": 0,
            "grpo.log_completions_every": 0,
            "output_dir": str(work / model),
        },
    )
    data = run_validate(config, work / model / "validate")
    base = resolve_model_source(model)
    plain_total, plain_steps = plain_trl(config, data.train_path, base, work / model / "plain")
    bare_total, bare_steps = plain_grpoflow(config, data.train_path, base, work / model / "bare")
    ours_total, ours_steps = orchestrated(config, data.train_path, base)

    def per_step(times: list[float]) -> float:
        return sum(times[1:]) / len(times[1:])  # the first step warms up

    plain_step, bare_step, ours_step = per_step(plain_steps), per_step(bare_steps), per_step(ours_steps)
    return {
        "model": model,
        "steps": steps,
        "plain_trl_seconds_per_step": round(plain_step, 3),
        "bare_grpoflow_seconds_per_step": round(bare_step, 3),
        "grpoflow_seconds_per_step": round(ours_step, 3),
        "overhead_step_ratio": round(ours_step / bare_step, 3),
        "overhead_total_ratio": round(ours_total / bare_total, 3),
        "vs_trl_step_ratio": round(ours_step / plain_step, 3),
        "plain_trl_total_s": round(plain_total, 1),
        "bare_total_s": round(bare_total, 1),
        "grpoflow_total_s": round(ours_total, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--tiny-steps", type=int, default=20)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    results = [compare("smollm2-135m-instruct", args.steps, work), compare("tiny-random", args.tiny_steps, work)]
    print(json.dumps({"bench": "orchestration_overhead", "results": results}))
    print(
        f"{'model':24}{'TRL s/step':>11}{'bare s/step':>12}{'flow s/step':>12}{'overhead/step':>14}"
        f"{'overhead/total':>15}{'flow vs TRL':>12}"
    )
    for r in results:
        print(
            f"{r['model']:24}{r['plain_trl_seconds_per_step']:>11}{r['bare_grpoflow_seconds_per_step']:>12}"
            f"{r['grpoflow_seconds_per_step']:>12}{r['overhead_step_ratio']:>14}{r['overhead_total_ratio']:>15}"
            f"{r['vs_trl_step_ratio']:>12}"
        )


if __name__ == "__main__":
    main()
