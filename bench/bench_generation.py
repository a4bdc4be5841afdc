"""Generation throughput of grpoflow's shared generation component (probe and evaluation) against a naive
per-prompt loop over ``model.generate`` and against TRL GRPOTrainer-style batched generation, by precision and
batch size, on SmolLM2-135M-Instruct: same prompts, same machine, same run.

Run: .venv/bin/python bench/bench_generation.py   (prints one JSON line and a table)
"""

from __future__ import annotations

import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from tasks.config import ArithmeticSettings  # noqa: E402
from tasks.inputs import arithmetic_rows, render_prompt  # noqa: E402
from tasks.models import (  # noqa: E402  # noqa: E402  # noqa: E402
    SMOLLM2,
    GenerationStats,
    generate_completions,
    load_base_model,
    load_tokenizer,
    resolve_model_source,
)

PROMPTS, SAMPLES, NEW_TOKENS = 32, 8, 16


def naive(model, tokenizer, prompts: list[str]) -> tuple[float, int]:
    """One ``generate`` call per prompt (its samples as num_return_sequences), as a quick script would."""
    started, tokens = time.perf_counter(), 0
    for text in prompts:
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)
        with torch.inference_mode():
            out = model.generate(
                **ids,
                do_sample=True,
                top_k=0,
                num_return_sequences=SAMPLES,
                max_new_tokens=NEW_TOKENS,
                pad_token_id=tokenizer.pad_token_id,
            )
        tokens += int((out[:, ids["input_ids"].shape[1] :] != tokenizer.pad_token_id).sum())
    return time.perf_counter() - started, tokens


def trl_style(model, tokenizer, prompts: list[str], batch: int = 16) -> tuple[float, int]:
    """What TRL's GRPOTrainer does with transformers generation: every prompt repeated G times, left-padded
    batches of ``per_device_train_batch_size`` (16 in the demo) sequences, one plain ``generate`` per batch."""
    repeated = [text for text in prompts for _ in range(SAMPLES)]
    started, tokens = time.perf_counter(), 0
    for start in range(0, len(repeated), batch):
        ids = tokenizer(
            repeated[start : start + batch],
            return_tensors="pt",
            padding=True,
            padding_side="left",
            add_special_tokens=False,
        )
        with torch.inference_mode():
            out = model.generate(
                **ids, do_sample=True, top_k=0, max_new_tokens=NEW_TOKENS, pad_token_id=tokenizer.pad_token_id
            )
        tokens += int((out[:, ids["input_ids"].shape[1] :] != tokenizer.pad_token_id).sum())
    return time.perf_counter() - started, tokens


def main() -> None:
    model_dir = resolve_model_source(SMOLLM2)
    tokenizer, model = load_tokenizer(model_dir), load_base_model(model_dir)
    rows = arithmetic_rows(ArithmeticSettings(num_rows=PROMPTS), seed=0)
    prompts = [render_prompt(tokenizer, row["prompt"]) for row in rows]
    generate_completions(model, tokenizer, prompts[:2], n=2, max_new_tokens=2)  # warm-up
    seconds, tokens = naive(model, tokenizer, prompts)
    results = {
        "naive per-prompt loop (fp32)": (seconds, tokens),
        "TRL GRPO-style batches of 16 (fp32)": trl_style(model, tokenizer, prompts),
    }
    for precision in ("fp32", "bf16"):
        for batch in (64, 256):
            stats = GenerationStats()
            generate_completions(
                model,
                tokenizer,
                prompts,
                n=SAMPLES,
                max_new_tokens=NEW_TOKENS,
                batch_size=batch,
                stats=stats,
                precision=precision,
            )
            results[f"grpoflow batch {batch} ({precision})"] = (stats.seconds, stats.new_tokens)
    base = results["naive per-prompt loop (fp32)"]
    rates = {name: tokens / seconds for name, (seconds, tokens) in results.items()}
    print(
        json.dumps(
            {
                "bench": "generation",
                "prompts": PROMPTS,
                "samples": SAMPLES,
                "max_new_tokens": NEW_TOKENS,
                "tokens_per_s": {k: round(v, 1) for k, v in rates.items()},
                "ratio_vs_naive": {k: round(v / (base[1] / base[0]), 2) for k, v in rates.items()},
                "ratio_vs_trl_style": {
                    k: round(v / rates["TRL GRPO-style batches of 16 (fp32)"], 2) for k, v in rates.items()
                },
            }
        )
    )
    print(f"{'':38}{'seconds':>9}{'tokens/s':>10}{'vs naive':>10}{'vs TRL':>8}")
    naive_rate = rates["naive per-prompt loop (fp32)"]
    for name, (seconds, tokens) in results.items():
        trl_rate = rates["TRL GRPO-style batches of 16 (fp32)"]
        print(
            f"{name:38}{seconds:>9.1f}{tokens / seconds:>10.1f}{rates[name] / naive_rate:>9.2f}x"
            f"{rates[name] / trl_rate:>7.2f}x"
        )


if __name__ == "__main__":
    main()
