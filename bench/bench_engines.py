"""Do grpoflow's two engines score an adapter the same? Greedy (and sampled) answers of one adapter on a run's
first 100 hold-out prompts (the demo's config; PROMPTS after SAMPLES sets how many), by engine variant, then a
comparison of the saved answers: accuracy, identical greedy text, greedy verdict agreement, and the greedy and
sampled pass@1 differences with paired bootstrap intervals (docs/vllm.md, "Do the engines agree?").

Variants: ``hf-fp32``, ``hf-bf16`` (grpoflow's transformers loop; in bf16 the adapter kept apart from the weights),
``hf-bf16-merged`` (the path before the fix: merged, then bf16), ``vllm-fp32``, ``vllm-bf16`` (the in-process
engine; run those with ``.venv-vllm/bin/python``). Each variant runs in a process of its own:

    .venv/bin/python bench/bench_engines.py sample RUN_DIR ADAPTER_DIR hf-fp32 out/sft-hf.json [SAMPLES]
    .venv-vllm/bin/python bench/bench_engines.py sample RUN_DIR ADAPTER_DIR vllm-fp32 out/sft-vllm.json [SAMPLES]
    .venv/bin/python bench/bench_engines.py compare out/sft-hf.json out/sft-vllm.json
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def sample(run: Path, adapter: Path, variant: str, out: Path, n: int = 0, prompts: int = 100) -> None:
    """Save the greedy answers (and ``n`` samples per prompt) of ``adapter`` on the run's first ``prompts``
    hold-out prompts through ``variant``."""
    from tasks.config import load_config
    from tasks.inputs import render_prompt
    from tasks.models import load_policy, load_tokenizer, pipeline_engine_spec, resolve_model_source, shared_engine
    from tasks.models.sampling import TransformersSampler

    engine, precision = variant.split("-")[0], variant.split("-")[1]
    config = load_config(REPO / "configs" / "demo.yaml", overrides={"model.precision": precision})
    base = resolve_model_source(config.model.source)
    rows = [json.loads(line) for line in (run / "validate" / "holdout.jsonl").read_text().splitlines()][:prompts]
    tokenizer = load_tokenizer(base)
    prompts = [render_prompt(tokenizer, r["prompt"], config.data.system_prompt) for r in rows]
    started = time.time()
    if engine == "hf":
        merged = variant.endswith("merged")
        model = load_policy(base, adapter, precision="fp32" if merged else precision)
        sampler = TransformersSampler(model, tokenizer, 64, precision, stock=False)
    else:
        from tasks.models.vllm_engine import VllmSampler

        sampler = VllmSampler(shared_engine(pipeline_engine_spec(config, base)), tokenizer, adapter)
    greedy = [g[0] for g in sampler.sample(prompts, greedy=True, max_new_tokens=16)]
    sampled = sampler.sample(prompts, n=n, temperature=1.0, max_new_tokens=16, seed=0) if n else []
    print(variant, f"{time.time() - started:.1f} s", flush=True)
    out.write_text(json.dumps({"gt": [r["ground_truth"] for r in rows], "greedy": greedy, "sampled": sampled}))


def correct(texts: list[str], truths: list[str]) -> np.ndarray:
    from reward_fns.math import math_accuracy

    return np.array([1.0 if v == 1.0 else 0.0 for v in math_accuracy(completions=texts, ground_truth=truths)])


def pass1(run: dict) -> np.ndarray:
    return np.array([correct(s, [g] * len(s)).mean() for s, g in zip(run["sampled"], run["gt"], strict=True)])


def paired_interval(differences: np.ndarray, rng: np.random.Generator) -> str:
    """A 95 % bootstrap interval of the mean of per-prompt differences, as ``[low, high]``."""
    boots = [differences[rng.integers(0, len(differences), len(differences))].mean() for _ in range(10000)]
    low, high = np.percentile(boots, [2.5, 97.5])
    return f"[{low:+.3f}, {high:+.3f}]"


def compare(paths: list[str]) -> None:
    """Print each variant's accuracy and, for each pair, how far they agree."""
    runs = {Path(p).stem: json.loads(Path(p).read_text()) for p in paths}
    for name, run in runs.items():
        line = f"{name:28s} greedy {correct(run['greedy'], run['gt']).mean():.1%}"
        print(line + (f"  sampled pass@1 {pass1(run).mean():.1%}" if run["sampled"] else ""))
    names, rng = list(runs), np.random.default_rng(0)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            ra, rb = runs[a], runs[b]
            same = np.mean([x == y for x, y in zip(ra["greedy"], rb["greedy"], strict=True)])
            verdicts = np.mean(correct(ra["greedy"], ra["gt"]) == correct(rb["greedy"], rb["gt"]))
            print(f"{a} vs {b}: greedy text identical {same:.0%}, greedy verdict the same {verdicts:.0%}")
            d = correct(ra["greedy"], ra["gt"]) - correct(rb["greedy"], rb["gt"])
            print(f"  greedy {a} − {b}: {d.mean():+.3f}, paired 95 % CI {paired_interval(d, rng)}")
            if ra["sampled"] and rb["sampled"]:
                d = pass1(ra) - pass1(rb)
                print(f"  sampled pass@1 {a} − {b}: {d.mean():+.3f}, paired 95 % CI {paired_interval(d, rng)}")


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    if sys.argv[1] == "compare":
        compare(sys.argv[2:])
    else:
        run_dir, adapter_dir, chosen, output = sys.argv[2:6]
        counts = [int(a) for a in sys.argv[6:8]]  # [SAMPLES [PROMPTS]]
        sample(Path(run_dir), Path(adapter_dir), chosen, Path(output), *counts)
