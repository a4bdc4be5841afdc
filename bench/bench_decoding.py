"""grpoflow's decoding loop with grouped attention (``tasks/speedups/grouped_attention.py``) against the same loop
with eager attention and the stock KV cache, interleaved in one process (this machine's speed drifts by tens of
percent over minutes, so rounds alternate): evaluation's decoding (greedy + 4 samples per prompt, batch 64) and
GRPO's (a merged bf16 copy, 16 prompts × 8 samples), on SmolLM2-135M-Instruct with the demo's prompts. It also
checks that both ways give the same completions, token for token.

Run: .venv/bin/python bench/bench_decoding.py [--rounds 5]   (about 3 minutes)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, GenerationConfig  # noqa: E402

import tasks.models.generation as generation  # noqa: E402
from tasks.config import load_config  # noqa: E402
from tasks.inputs import arithmetic_rows, render_prompt  # noqa: E402
from tasks.models import compute_autocast, load_policy, load_tokenizer, resolve_model_source  # noqa: E402
from tasks.speedups.packing import pack_linears  # noqa: E402

GROUPED = generation.grouped_decoding


@contextlib.contextmanager
def _stock(*args: object, **kwargs: object) -> Iterator[None]:
    yield None


def _timed(run: Callable[[], object]) -> tuple[float, object]:
    started = time.perf_counter()
    result = run()
    return time.perf_counter() - started, result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=32)
    args = parser.parse_args()
    config = load_config("configs/demo.yaml")
    base = resolve_model_source(config.model.source)
    tokenizer = load_tokenizer(base)
    rows = arithmetic_rows(config.data.arithmetic, config.seed)[: args.prompts]
    prompts = [render_prompt(tokenizer, row["prompt"], config.data.system_prompt) for row in rows]
    policy = load_policy(base, None)
    settings = config.evaluation

    def evaluation() -> object:
        return generation.generate_completions(
            policy, tokenizer, prompts, n=settings.n_samples, max_new_tokens=settings.max_new_tokens,
            batch_size=settings.batch_size, seed=config.seed, precision=config.model.precision, greedy_first=True,
        )  # fmt: skip

    merged = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16, attn_implementation="eager").eval()
    pack_linears(merged, torch.bfloat16)  # GRPO's merged copy: bf16 weights, packed layers, no autocast
    group = config.grpo.num_generations
    encoded = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in prompts[:16]]
    grpo_ids = [ids for ids in encoded for _ in range(group)]  # TRL's batch: each prompt once per sample, in a row
    grpo_config = GenerationConfig(
        max_new_tokens=config.grpo.max_completion_length, do_sample=True, temperature=1.0, top_k=0,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip

    def grpo() -> object:
        """GRPO's sampler calls the merged copy without autocast (its weights are bf16 already)."""
        torch.manual_seed(config.seed)
        with torch.autocast("cpu", enabled=False):
            eos = [tokenizer.eos_token_id]
            return generation.sample_groups(merged, grpo_ids, grpo_config, tokenizer.pad_token_id, eos)

    seconds: dict[str, dict[str, list[float]]] = {"evaluation": {}, "grpo": {}}
    outputs: dict[str, dict[str, object]] = {"evaluation": {}, "grpo": {}}
    with compute_autocast(config.model.precision):
        for mode, run in (("evaluation", evaluation), ("grpo", grpo)):
            run()  # warm-up (and grouped attention's first-use check)
            for _ in range(args.rounds):
                for name, decoding in (("stock", _stock), ("grouped", GROUPED)):
                    generation.grouped_decoding = decoding
                    took, outputs[mode][name] = _timed(run)
                    seconds[mode].setdefault(name, []).append(took)
    generation.grouped_decoding = GROUPED
    report = {
        mode: {
            **{f"{name}_seconds_median": round(statistics.median(v), 2) for name, v in by_name.items()},
            **{f"{name}_seconds_min": round(min(v), 2) for name, v in by_name.items()},
            "speedup_median": round(statistics.median(by_name["stock"]) / statistics.median(by_name["grouped"]), 2),
            "same_completions": outputs[mode]["stock"] == outputs[mode]["grouped"],
        }
        for mode, by_name in seconds.items()
    }
    print(json.dumps({"bench": "decoding", "prompts": args.prompts, "rounds": args.rounds,
                      "threads": torch.get_num_threads(), **report}))  # fmt: skip
    for mode, row in report.items():
        print(
            f"{mode:<11} stock {row['stock_seconds_median']:>6.2f} s  grouped {row['grouped_seconds_median']:>6.2f} s"
            f"  ({row['speedup_median']:.2f}x, same completions: {row['same_completions']})"
        )


if __name__ == "__main__":
    main()
