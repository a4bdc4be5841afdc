"""grpoflow's decoding loop three ways, interleaved in one process (this machine's speed drifts by tens of percent
over minutes, so rounds alternate): ``stock`` (eager attention, the stock KV cache, every row to the batch's end),
``grouped`` (grouped attention, ``tasks/speedups/grouped_attention.py``) and ``grouped+leave`` (also finished rows
leave the batch, ``tasks/models/compaction.py``). Evaluation's decoding (greedy + 4 samples per prompt, batch 64)
and GRPO's (a merged bf16 copy, 16 prompts × 8 samples), on SmolLM2-135M-Instruct with the demo's prompts; with
``--adapter`` (e.g. a demo run's ``sft/adapter``) evaluation samples that policy, whose answers end early as
trained ones do. It also checks that all ways give the same completions, token for token.

Run: .venv/bin/python bench/bench_decoding.py [--rounds 5] [--adapter DIR]   (about 4 minutes)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, GenerationConfig  # noqa: E402

import tasks.models.compaction as compaction  # noqa: E402
import tasks.models.generation as generation  # noqa: E402
from tasks.config import load_config  # noqa: E402
from tasks.inputs import arithmetic_rows, render_prompt  # noqa: E402
from tasks.models import compute_autocast, load_policy, load_tokenizer, resolve_model_source  # noqa: E402
from tasks.speedups.packing import pack_linears  # noqa: E402

GROUPED = generation.grouped_decoding
CHECK = compaction.check_once
MODES = {  # name -> (decoding context, compaction check)
    "stock": (None, False),
    "grouped": (GROUPED, False),
    "grouped+leave": (GROUPED, True),
}


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
    parser.add_argument("--adapter", type=Path, default=None, help="a LoRA adapter for evaluation's policy")
    args = parser.parse_args()
    config = load_config("configs/demo.yaml")
    base = resolve_model_source(config.model.source)
    tokenizer = load_tokenizer(base)
    rows = arithmetic_rows(config.data.arithmetic, config.seed)[: args.prompts]
    prompts = [render_prompt(tokenizer, row["prompt"], config.data.system_prompt) for row in rows]
    policy = load_policy(base, args.adapter)
    settings = config.evaluation

    def evaluation() -> object:
        return generation.generate_completions(
            policy,
            tokenizer,
            prompts,
            n=settings.n_samples,
            max_new_tokens=settings.max_new_tokens,
            batch_size=settings.batch_size,
            seed=config.seed,
            precision=config.model.precision,
            greedy_first=True,
        )

    merged = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16, attn_implementation="eager").eval()
    pack_linears(merged, torch.bfloat16)  # GRPO's merged copy: bf16 weights, packed layers, no autocast
    group = config.grpo.num_generations
    encoded = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in prompts[:16]]
    grpo_ids = [ids for ids in encoded for _ in range(group)]  # TRL's batch: each prompt once per sample, in a row
    grpo_config = GenerationConfig(
        max_new_tokens=config.grpo.max_completion_length,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )

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
                for name, (decoding, leave) in MODES.items():
                    generation.grouped_decoding = decoding or _stock
                    compaction.check_once = CHECK if leave else (lambda *args: False)
                    took, outputs[mode][name] = _timed(run)
                    seconds[mode].setdefault(name, []).append(took)
    generation.grouped_decoding, compaction.check_once = GROUPED, CHECK
    report = {
        mode: {
            **{f"{name}_seconds_median": round(statistics.median(v), 2) for name, v in by_name.items()},
            **{f"{name}_seconds_min": round(min(v), 2) for name, v in by_name.items()},
            **{
                f"{name}_speedup_median": round(statistics.median(by_name["stock"]) / statistics.median(v), 2)
                for name, v in by_name.items()
                if name != "stock"
            },
            "same_completions": all(outputs[mode][name] == outputs[mode]["stock"] for name in MODES),
        }
        for mode, by_name in seconds.items()
    }
    print(
        json.dumps(
            {
                "bench": "decoding",
                "prompts": args.prompts,
                "rounds": args.rounds,
                "adapter": str(args.adapter),
                "threads": torch.get_num_threads(),
                **report,
            }
        )
    )
    for mode, row in report.items():
        times = "  ".join(
            f"{name} {row[f'{name}_seconds_median']:.2f} s"
            + (f" ({row[f'{name}_speedup_median']:.2f}x)" if name != "stock" else "")
            for name in MODES
        )
        print(f"{mode:<11} {times}  same completions: {row['same_completions']}")


if __name__ == "__main__":
    main()
