"""Which GRPO loss to pick on the demo: the demo's GRPO stage (configs/demo.yaml) from one SFT adapter, with one
seed, once per loss — dapo (the default), grpo, dr_grpo, GSPO (grpo with sequence-level importance sampling),
cispo (ε_max 5), and dapo with clip-higher (epsilon_high 0.28) — each with the in-training hold-out evaluation on
(the curve), plus dapo with it off (what the evaluation costs, and that the adapter is the same). Each adapter is
then scored on the final evaluation's hold-out prompts (greedy + samples, as `evaluate` does, without the
forgetting check), with the sampled pass@1's paired 95 % interval against dapo's.

Run: .venv/bin/python bench/bench_losses.py [--out DIR] [--sft-adapter DIR] [--steps 30] [--only dapo,gspo]
[--config configs/tiny.yaml: a one-minute smoke run]
Prints one JSON line per run and a Markdown table (docs/losses.md); the whole bench takes about 40 minutes on
2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
VARIANTS: dict[str, dict] = {
    "dapo": {},
    "grpo": {"loss_type": "grpo"},
    "dr_grpo": {"loss_type": "dr_grpo", "scale_rewards": "none"},
    "gspo": {"loss_type": "grpo", "importance_sampling_level": "sequence"},
    "cispo": {"loss_type": "cispo"},
    "dapo clip-higher": {"epsilon_high": 0.28},
    "dapo, no in-training eval": {"eval_steps": 0, "select": "last"},
    "dapo, num_iterations 2": {"num_iterations": 2},  # what the second pass over each batch costs
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--sft-adapter", type=Path, default=None, help="reuse an SFT adapter of the demo config")
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps (default: the demo's)")
    parser.add_argument("--only", default="", help="comma-separated variant names")
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "demo.yaml", help="tiny.yaml: a smoke run")
    parser.add_argument(
        "--every",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a grpo setting for every variant, e.g. num_iterations=2 (off-policy: the clip and the weights act)",
    )
    options = parser.parse_args()
    out = options.out or Path(tempfile.mkdtemp(prefix="bench-losses-"))

    from tasks.config import PipelineConfig, load_config
    from tasks.evaluate import ModelSpec, compare, holdout_rows, score_models
    from tasks.grpo import run_grpo
    from tasks.models import resolve_model_source
    from tasks.sft import run_sft
    from tasks.validate import run_validate

    demo = load_config(options.config, {"output_dir": str(out / "outputs")})
    if options.steps:
        demo = demo.model_copy(update={"grpo": demo.grpo.model_copy(update={"max_steps": options.steps})})
    split = run_validate(demo, out / "validate")
    base = resolve_model_source(demo.model.source, demo.model.revision)
    sft = options.sft_adapter
    if sft is None:
        started = time.perf_counter()
        sft = run_sft(demo, split.train_path, base, out / "sft").adapter_dir
        print(json.dumps({"bench": "losses", "sft_seconds": round(time.perf_counter() - started, 1)}), flush=True)
    chosen = [name for name in options.only.split(",") if name] or list(VARIANTS)
    every = {key: yaml.safe_load(value) for key, value in (item.split("=", 1) for item in options.every)}
    runs: dict[str, dict] = {}
    adapters: dict[str, Path] = {}
    for name in chosen:
        config = PipelineConfig.model_validate(
            {**demo.model_dump(), "grpo": {**demo.grpo.model_dump(), **every, **VARIANTS[name]}}
        )
        folder = out / name.replace(" ", "-").replace(",", "")
        result = run_grpo(config, split.train_path, base, sft, folder)
        curve = [
            (int(e["step"]), round(e["eval_holdout_pass_at_1"], 4))
            for e in result.history
            if "eval_holdout_pass_at_1" in e
        ]
        runs[name] = {
            "steps": result.steps,
            "grpo_seconds": round(result.seconds, 1),
            "seconds_per_step": round(result.seconds / max(result.steps, 1), 2),
            "holdout_seconds": round(result.holdout_seconds, 1),
            "curve_pass_at_1": curve,
            "selected_step": (result.selection or {}).get("step"),
            "adapter_bytes_sha": _digest(result.adapter_dir / "adapter_model.safetensors"),
        }
        adapters[name] = result.adapter_dir
        print(json.dumps({"bench": "losses", "variant": name, **runs[name]}), flush=True)

    scoring = demo.model_copy(update={"evaluation": demo.evaluation.model_copy(update={"forgetting": False})})
    rows = holdout_rows(scoring, split.holdout_path)
    specs = {name: ModelSpec(name.replace(" ", "_"), base, adapter) for name, adapter in adapters.items()}
    scores = score_models(scoring, specs, rows)
    reference = scores.get("dapo")
    for name, score in scores.items():
        runs[name]["pass_at_1"] = round(score.pass_at_k[1], 4)
        runs[name]["greedy_accuracy"] = round(score.greedy_accuracy, 4)
        if reference is not None and name != "dapo":
            runs[name]["vs_dapo"] = {k: round(v, 4) for k, v in compare(scoring, score, reference).items()}
    (out / "losses.json").write_text(json.dumps(runs, indent=2))
    print(json.dumps({"bench": "losses", "prompts": len(rows), "runs": runs}), flush=True)
    print(table(runs, len(rows)))


def _digest(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def table(runs: dict[str, dict], prompts: int) -> str:
    """The Markdown table of docs/losses.md."""
    lines = [
        f"| loss | hold-out pass@1 ({prompts} prompts) | vs dapo, paired 95 % CI | greedy | s/step "
        "| in-training curve (pass@1 by step) |",
        "|---|---|---|---|---|---|",
    ]
    for name, run in runs.items():
        versus = run.get("vs_dapo")
        delta = f"{versus['mean']:+.3f} [{versus['low']:+.3f}, {versus['high']:+.3f}]" if versus else "—"
        curve = ", ".join(f"{step}: {value:.3f}" for step, value in run["curve_pass_at_1"]) or "—"
        greedy = run.get("greedy_accuracy", float("nan"))
        lines.append(
            f"| {name} | {run.get('pass_at_1', float('nan')):.3f} | {delta} | {greedy:.3f} "
            f"| {run['seconds_per_step']:.1f} | {curve} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
