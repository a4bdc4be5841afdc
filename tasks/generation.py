"""Batched sampling shared by probe and evaluation (transformers backend).

Prompts are tokenized once, sorted by length so each batch pads little, and left-padded. Each prompt is
prefilled once: its KV cache is then copied to its ``n`` samples, so the prompt is not recomputed per sample.
Decoding uses the KV cache and a batch stops as soon as every sequence has hit EOS. With ``precision="bf16"``
the matrix products run under bf16 autocast.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from tasks.models import compute_autocast

logger = logging.getLogger(__name__)


@dataclass
class GenerationStats:
    sequences: int = 0
    new_tokens: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0


def generate_completions(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    *,
    n: int = 1,
    temperature: float = 1.0,
    max_new_tokens: int = 32,
    batch_size: int = 64,
    seed: int = 0,
    greedy: bool = False,
    progress: Callable[[int, int], None] | None = None,
    stats: GenerationStats | None = None,
    precision: str = "fp32",
) -> list[list[str]]:
    """``n`` completions for each rendered prompt, in prompt order. Same seed and batch size → same output.

    ``batch_size`` counts sequences (prompts × n); ``greedy`` ignores ``temperature`` and ``n`` > 1 repeats.
    """
    if not prompts:
        return []
    started = time.perf_counter()
    samples = 1 if greedy else n
    encoded = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in prompts]
    order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]), reverse=True)
    prompts_per_batch = max(1, batch_size // samples)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos_ids = model.generation_config.eos_token_id or tokenizer.eos_token_id
    results: list[list[str]] = [[] for _ in prompts]
    sampling = (
        {"do_sample": False} if greedy else {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    )
    was_training = model.training
    model.eval()
    new_tokens = 0
    try:
        for batch_number, start in enumerate(range(0, len(order), prompts_per_batch)):
            indices = order[start : start + prompts_per_batch]
            torch.manual_seed(seed + batch_number)
            with torch.inference_mode(), compute_autocast(precision):
                output, width = _sample_with_shared_prefill(
                    model,
                    [encoded[i] for i in indices],
                    samples,
                    pad_id,
                    max_new_tokens=max_new_tokens,
                    eos_token_id=eos_ids,
                    **sampling,
                )
            generated = output[:, width:]
            new_tokens += int((generated != pad_id).sum())
            texts = tokenizer.batch_decode(generated, skip_special_tokens=True)
            for offset, index in enumerate(indices):
                results[index] = texts[offset * samples : (offset + 1) * samples]
            done = min(start + prompts_per_batch, len(order))
            logger.debug("generated %d/%d prompts", done, len(order))
            if progress:
                progress(done, len(order))
    finally:
        model.train(was_training)
    if stats is not None:
        stats.sequences += len(prompts) * samples
        stats.new_tokens += new_tokens
        stats.seconds += time.perf_counter() - started
    return results


def sample_groups(
    model: Any,
    prompt_ids: Sequence[Sequence[int]],
    generation_config: Any,
    pad_id: int,
    eos_ids: Sequence[int],
    precision: str = "fp32",
) -> list[list[int]]:
    """Completion token ids for TRL's generation batch, in which each prompt appears once per sample, in a row:
    each run of equal prompts is prefilled once (``_shared_prefill``) and its samples decoded together. Every
    completion ends at its first EOS (kept), as TRL expects; the order is the input's."""
    groups: list[tuple[list[int], int]] = []
    for ids in prompt_ids:
        if groups and groups[-1][0] == list(ids):
            groups[-1] = (groups[-1][0], groups[-1][1] + 1)
        else:
            groups.append((list(ids), 1))
    eos = set(eos_ids)
    results: dict[int, list[list[int]]] = {}
    with torch.inference_mode(), compute_autocast(precision):
        for samples in sorted({count for _, count in groups}):  # one batch per group size (usually one size)
            indices = [i for i, (_, count) in enumerate(groups) if count == samples]
            output, width = _sample_with_shared_prefill(
                model, [groups[i][0] for i in indices], samples, pad_id, generation_config=generation_config
            )
            rows = output[:, width:].tolist()
            for k, i in enumerate(indices):
                results[i] = [_until_eos(tokens, eos) for tokens in rows[k * samples : (k + 1) * samples]]
    return [tokens for i in range(len(groups)) for tokens in results[i]]


def _until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    """``tokens`` up to and including the first EOS.

    >>> _until_eos([5, 6, 2, 2, 2], {2})
    [5, 6, 2]
    """
    return next((tokens[: i + 1] for i, token in enumerate(tokens) if token in eos), tokens)


def _sample_with_shared_prefill(
    model: Any, id_lists: Sequence[Sequence[int]], samples: int, pad_id: int, **generate_kwargs: Any
) -> tuple[torch.Tensor, int]:
    """Left-pad the prompts, prefill each once, and sample ``samples`` continuations of each (rows grouped by
    prompt). Returns ``generate``'s output and the padded prompt width (where the completions start)."""
    width = max(len(ids) for ids in id_lists)
    input_ids = torch.full((len(id_lists), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(id_lists), width), dtype=torch.long)
    for row, ids in enumerate(id_lists):
        input_ids[row, width - len(ids) :] = torch.tensor(list(ids))
        attention[row, width - len(ids) :] = 1
    device = next(model.parameters()).device
    input_ids, attention = input_ids.to(device), attention.to(device)
    cache = _shared_prefill(model, input_ids, attention, samples)
    output = model.generate(
        input_ids=input_ids.repeat_interleave(samples, dim=0),
        attention_mask=attention.repeat_interleave(samples, dim=0),
        cache=cache,
        pad_token_id=pad_id,
        use_cache=True,
        **generate_kwargs,
    )
    return output, width


def _shared_prefill(model: Any, input_ids: torch.Tensor, attention: torch.Tensor, samples: int) -> DynamicCache:
    """Run every prompt but its last token once, and copy the cache to each of its ``samples`` rows.

    ``generate`` then only feeds the last prompt token, so a prompt is encoded once whatever ``samples`` is.
    Positions follow the left padding exactly as ``generate`` computes them, so outputs do not change.
    """
    cache = DynamicCache(config=model.config)
    if input_ids.shape[1] > 1:
        head, head_mask = input_ids[:, :-1], attention[:, :-1]
        positions = (head_mask.cumsum(-1) - 1).clamp(min=0)
        model(
            input_ids=head,
            attention_mask=head_mask,
            position_ids=positions,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
    if samples > 1:
        cache.batch_repeat_interleave(samples)
    return cache
