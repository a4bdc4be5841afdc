"""Batched sampling shared by probe and evaluation (transformers backend).

Prompts are tokenized once, sorted by length so each batch pads little, and left-padded. Each prompt is
prefilled once: its KV cache is then copied to its ``n`` samples, so the prompt is not recomputed per sample.
Decoding uses the KV cache and a batch stops as soon as every sequence has hit EOS. With ``precision="bf16"``
the matrix products run under bf16 autocast, and the linear layers' weights are packed for oneDNN once per
call (``packed_for_inference``) rather than prepared on every product.

The decoding loop is this module's own (``_decode``) for the settings GRPO and evaluation use (temperature,
top-k, top-p, min-p, greedy): ``generate`` samples with ``torch.multinomial``, which draws a random number per
vocabulary entry (so does the exponential race, ``argmax(p / E)``), a large share of a decoding step on CPU
(docs/measurements/performance.md). Here a token is drawn by inverting the cumulative distribution with one
uniform number per row. Any other generation setting
(repetition penalty, suppressed tokens, ...) goes to ``generate``.
Must not import: Prefect, MLflow, the stages (probe, evaluation and GRPO's sampler call it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache, GenerationConfig

from tasks.models import compaction
from tasks.models.cache_keyword import with_cache
from tasks.models.decoding import decodable, draw_uniform, next_tokens, until_eos
from tasks.models.precision import compute_autocast
from tasks.speedups.grouped_attention import grouped_decoding
from tasks.speedups.packing import packed_for_inference

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
    stock: bool = False,
    greedy_first: bool = False,
    part: tuple[int, int] = (0, 1),
) -> list[list[str]]:
    """``n`` completions for each rendered prompt, in prompt order. Same seed and batch size → same output.

    ``batch_size`` counts sequences (prompts × n); ``greedy`` ignores ``temperature`` and ``n`` > 1 repeats.
    ``stock`` (``speedups: off``): transformers' own ``generate``, no packed layers, no shared prefill.
    ``greedy_first``: each prompt's greedy completion first, then its ``n`` samples, decoded together from one
    prefill (evaluation's two passes in one); the samples are drawn as without it (same batches, same seeds).
    ``part`` ``(i, n)``: only the batches whose number is ``i`` modulo ``n`` (other prompts get no completions;
    ``progress`` counts this part's prompts). Each batch draws from its own seed, so ``n`` processes sampling one
    part each give together what one process gives.
    """
    if not prompts:
        return []
    if greedy_first and (greedy or stock):  # transformers' generate decodes one way per call: two passes
        common = {
            "max_new_tokens": max_new_tokens,
            "batch_size": batch_size,
            "seed": seed,
            "progress": progress,
            "stats": stats,
            "precision": precision,
            "stock": stock,
            "part": part,
        }
        first = generate_completions(model, tokenizer, prompts, greedy=True, **common)
        rest = [] if greedy else generate_completions(model, tokenizer, prompts, n=n, temperature=temperature, **common)
        return [g + r for g, r in zip(first, rest or [[] for _ in prompts], strict=True)]
    encoded = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in prompts]
    settings = {"n": n, "temperature": temperature, "max_new_tokens": max_new_tokens, "batch_size": batch_size}
    settings |= {"seed": seed, "greedy": greedy, "progress": progress, "stats": stats, "precision": precision}
    settings |= {"stock": stock, "greedy_first": greedy_first, "part": part}
    return _generate(model, tokenizer, encoded, as_ids=False, **settings)


def generate_completion_ids(
    model: Any,
    tokenizer: Any,
    prompt_ids: Sequence[Sequence[int]],
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
    stock: bool = False,
) -> list[list[list[int]]]:
    """``generate_completions`` on token ids: ``n`` completions of each prompt (ids in), each its token ids up to
    and including its first EOS (all ``max_new_tokens`` when it never ended), as TRL's generation hands them on.
    The same draws as ``generate_completions`` gives the same prompts as text."""
    if not prompt_ids:
        return []
    settings = {"n": n, "temperature": temperature, "max_new_tokens": max_new_tokens, "batch_size": batch_size}
    settings |= {"seed": seed, "greedy": greedy, "progress": progress, "stats": stats, "precision": precision}
    return _generate(model, tokenizer, [list(ids) for ids in prompt_ids], as_ids=True, stock=stock, **settings)


def _generate(
    model: Any,
    tokenizer: Any,
    encoded: list[list[int]],
    *,
    as_ids: bool,
    n: int,
    temperature: float,
    max_new_tokens: int,
    batch_size: int,
    seed: int,
    greedy: bool,
    progress: Callable[[int, int], None] | None,
    stats: GenerationStats | None,
    precision: str,
    stock: bool,
    greedy_first: bool = False,
    part: tuple[int, int] = (0, 1),
) -> list[list[Any]]:
    """The loop behind both: batches of prompts sorted by length, each from its own seed; each prompt's
    completions decoded (``as_ids`` False) or as token ids up to their first EOS."""
    started = time.perf_counter()
    samples = 1 if greedy else n
    rows_per_prompt = samples + greedy_first
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]), reverse=True)
    prompts_per_batch = max(1, batch_size // samples)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos_ids = model.generation_config.eos_token_id or tokenizer.eos_token_id
    results: list[list[Any]] = [[] for _ in encoded]
    eos = set(_as_list(eos_ids))
    generation_config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_ids,
        pad_token_id=pad_id,
        **({"do_sample": False} if greedy else {"do_sample": True, "temperature": temperature, "top_k": 0}),
    )
    was_training = model.training
    model.eval()
    new_tokens = 0
    batches = enumerate(range(0, len(order), prompts_per_batch))
    starts = [(number, start) for number, start in batches if number % part[1] == part[0]]  # this part's batches
    ours, done = sum(len(order[start : start + prompts_per_batch]) for _, start in starts), 0
    try:
        with nullcontext() if stock else packed_for_inference(model, precision):
            for batch_number, start in starts:
                indices = order[start : start + prompts_per_batch]
                torch.manual_seed(seed + batch_number)
                with torch.inference_mode(), compute_autocast(precision):
                    ids = [encoded[i] for i in indices]
                    if stock:
                        generated = _sample_with_generate(model, ids, samples, pad_id, generation_config)
                    else:
                        generated, _ = _sample_with_shared_prefill(
                            model, ids, samples, pad_id, generation_config, greedy_first
                        )
                new_tokens += int((generated != pad_id).sum())
                if as_ids:
                    texts = [until_eos(row, eos) for row in generated.tolist()]
                else:
                    texts = tokenizer.batch_decode(generated, skip_special_tokens=True)
                for offset, index in enumerate(indices):
                    results[index] = texts[offset * rows_per_prompt : (offset + 1) * rows_per_prompt]
                done += len(indices)
                logger.debug("generated %d/%d prompts", done, ours)
                if progress:
                    progress(done, ours)
    finally:
        model.train(was_training)
    if stats is not None:
        stats.sequences += ours * rows_per_prompt
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
    with_logps: bool = False,
) -> Any:
    """Completion token ids for TRL's generation batch, in which each prompt appears once per sample, in a row:
    each run of equal prompts is prefilled once (``shared_prefill``) and its samples decoded together. Every
    completion ends at its first EOS (kept), as TRL expects; the order is the input's.

    ``with_logps``: returns ``(ids, logps)``, ``logps`` each sampled token's log-probability under the sampler's own
    logits at the sampling temperature (``token_logps``: what TRL's loss computes from the trainer's logits), so
    the trainer can check that it trains the policy that sampled (None where transformers' ``generate`` ran)."""
    groups: list[tuple[list[int], int]] = []
    for ids in prompt_ids:
        if groups and groups[-1][0] == list(ids):
            groups[-1] = (groups[-1][0], groups[-1][1] + 1)
        else:
            groups.append((list(ids), 1))
    eos = set(eos_ids)
    results: dict[int, list[list[int]]] = {}
    logps: dict[int, list[list[float]]] | None = {} if with_logps else None
    with torch.inference_mode(), compute_autocast(precision):
        for samples in sorted({count for _, count in groups}):  # one batch per group size (usually one size)
            indices = [i for i, (_, count) in enumerate(groups) if count == samples]
            drawn, drawn_logps = _sample_with_shared_prefill(
                model, [groups[i][0] for i in indices], samples, pad_id, generation_config, with_logps=with_logps
            )
            rows = drawn.tolist()
            row_logps = drawn_logps.tolist() if drawn_logps is not None else None
            for k, i in enumerate(indices):
                results[i] = [until_eos(tokens, eos) for tokens in rows[k * samples : (k + 1) * samples]]
                if logps is not None and row_logps is not None:
                    kept = row_logps[k * samples : (k + 1) * samples]
                    logps[i] = [values[: len(ids)] for values, ids in zip(kept, results[i], strict=True)]
                elif logps is not None:
                    logps = None  # one batch without them: none at all
    ids = [tokens for i in range(len(groups)) for tokens in results[i]]
    if not with_logps:
        return ids
    return ids, None if logps is None else [values for i in range(len(groups)) for values in logps[i]]


def _left_padded(id_lists: Sequence[Sequence[int]], pad_id: int, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(ids) for ids in id_lists)
    input_ids = torch.full((len(id_lists), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(id_lists), width), dtype=torch.long)
    for row, ids in enumerate(id_lists):
        input_ids[row, width - len(ids) :] = torch.tensor(list(ids))
        attention[row, width - len(ids) :] = 1
    return input_ids.to(device), attention.to(device)


def _sample_with_generate(
    model: Any, id_lists: Sequence[Sequence[int]], samples: int, pad_id: int, generation_config: Any
) -> torch.Tensor:
    """The stock path: transformers' ``generate`` with ``samples`` sequences per prompt (rows grouped by prompt).
    Returns the completion tokens (rows × new tokens), ``pad_id`` after a row's EOS."""
    input_ids, attention = _left_padded(id_lists, pad_id, next(model.parameters()).device)
    output = model.generate(
        input_ids=input_ids,
        attention_mask=attention,
        generation_config=generation_config,
        num_return_sequences=samples,
    )
    return output[:, input_ids.size(1) :]


def _sample_with_shared_prefill(
    model: Any,
    id_lists: Sequence[Sequence[int]],
    samples: int,
    pad_id: int,
    generation_config: Any,
    greedy_first: bool = False,
    with_logps: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Left-pad the prompts, prefill each once, and sample ``samples`` continuations of each (rows grouped by
    prompt; with ``greedy_first``, each group starts with its greedy row). Returns the completion tokens (rows ×
    new tokens), ``pad_id`` after a row's EOS, and with ``with_logps`` their log-probabilities (``token_logps``;
    None where transformers' ``generate`` samples)."""
    input_ids, attention = _left_padded(id_lists, pad_id, next(model.parameters()).device)
    width = input_ids.size(1)
    if greedy_first or decodable(generation_config):
        return _decode(model, input_ids, attention, samples, pad_id, generation_config, greedy_first, with_logps)
    cache, _ = shared_prefill(model, input_ids[:, :-1], attention[:, :-1], samples)
    output = model.generate(
        input_ids=input_ids.repeat_interleave(samples, dim=0),
        attention_mask=attention.repeat_interleave(samples, dim=0),
        **with_cache(cache),
        generation_config=generation_config,
    )
    return output[:, width:], None


def _decode(
    model: Any,
    input_ids: torch.Tensor,
    attention: torch.Tensor,
    samples: int,
    pad_id: int,
    config: Any,
    greedy_first: bool = False,
    with_logps: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Prefill each prompt once (all its tokens), copy its cache and last logits to its ``samples`` rows (one
    more, decoded greedily, first in each group with ``greedy_first``), then decode one token per step until
    every row has hit EOS or ``max_new_tokens``. Positions count real tokens, as ``generate`` counts them under
    left padding. Only the sampled rows draw random numbers, so they draw what they would alone. Finished rows
    leave the batch (``compaction``): the logits of those still in it are computed, the draws stay as they were.
    Returns the tokens and, with ``with_logps``, each token's ``token_logps`` from the logits it was drawn from."""
    eos = torch.tensor(sorted(_as_list(config.eos_token_id)), device=input_ids.device)
    choose = {
        "greedy": not config.do_sample,
        "temperature": config.temperature or 1.0,
        "top_k": config.top_k,
        "top_p": config.top_p,
        "min_p": config.min_p,
    }
    rows_per_prompt = samples + greedy_first
    # Grouped-query attention without repeating and casting the whole cache at every step
    # (speedups.grouped_attention): the same numbers, a fraction of the copies.
    with grouped_decoding(model, input_ids.device.type) as new_cache:
        cache, logits = shared_prefill(model, input_ids, attention, rows_per_prompt, new_cache and new_cache())
        shrink = compaction.check_once(model, new_cache, input_ids.device.type)
        attention = attention.repeat_interleave(rows_per_prompt, dim=0)
        positions = attention.sum(dim=-1, keepdim=True)
        done = torch.zeros(attention.size(0), dtype=torch.bool, device=attention.device)
        present = torch.arange(attention.size(0), device=attention.device)  # the rows still in the batch
        greedy_rows = present % rows_per_prompt == 0 if greedy_first else torch.zeros_like(done)
        steps: list[torch.Tensor] = []
        step_logps: list[torch.Tensor] = []
        for _ in range(config.max_new_tokens):
            token = _choose_tokens(logits, done, greedy_rows, pad_id, choose)
            steps.append(token)
            if with_logps:
                step_logps.append(token_logps(logits, token, choose["temperature"]))
            done |= torch.isin(token, eos)
            if bool(done.all()) or len(steps) == config.max_new_tokens:
                break
            keep = compaction.rows_to_keep(done[present]) if shrink else None
            if keep is not None:
                cache.batch_select_indices(keep)
                attention, positions, present = attention[keep], positions[keep], present[keep]
            attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)
            step_logits = model(
                input_ids=token[present, None],
                attention_mask=attention,
                position_ids=positions,
                use_cache=True,
                **with_cache(cache),
            ).logits[:, -1]
            if present.numel() == logits.size(0):
                logits = step_logits
            else:  # rows that left keep their last logits: their tokens are padding from now on
                logits[present] = step_logits
            positions = positions + 1
    return torch.stack(steps, dim=1), torch.stack(step_logps, dim=1) if with_logps else None


def token_logps(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Each row's log-probability of its token under ``logits`` at ``temperature``, in fp32 over the whole
    vocabulary: what TRL's loss computes from the trainer's logits (``selective_log_softmax``), not the filtered
    distribution that top-k or top-p draws from.

    >>> [round(p, 3) for p in token_logps(torch.tensor([[0.0, 0.0], [2.0, 0.0]]), torch.tensor([1, 0])).exp().tolist()]
    [0.5, 0.881]
    """
    scaled = logits.float() / temperature if temperature != 1.0 else logits.float()
    return scaled.gather(-1, tokens[:, None]).squeeze(-1) - scaled.logsumexp(dim=-1)


def _choose_tokens(
    logits: torch.Tensor, done: torch.Tensor, greedy_rows: torch.Tensor, pad_id: int, choose: dict[str, Any]
) -> torch.Tensor:
    """The next token of every row: ``pad_id`` for finished rows, the argmax for ``greedy_rows`` (and for all rows
    when ``choose`` is greedy), else a draw. Every sampled row draws its number, finished or not, so each row's
    draws are those it would get alone; only unfinished rows spend the work of choosing."""
    token = torch.full((logits.size(0),), pad_id, dtype=torch.long, device=logits.device)
    argmax_rows = ~done if choose["greedy"] else greedy_rows & ~done
    if bool(argmax_rows.any()):
        token[argmax_rows] = logits[argmax_rows].argmax(dim=-1)
    if not choose["greedy"]:
        sampled = ~greedy_rows
        uniform = draw_uniform(int(sampled.sum()), logits.device)
        drawing = sampled & ~done
        if bool(drawing.any()):
            token[drawing] = next_tokens(logits[drawing], **choose, uniform=uniform[~done[sampled]])
    return token


def _as_list(value: int | Sequence[int] | None) -> list[int]:
    return [] if value is None else [value] if isinstance(value, int) else list(value)


def shared_prefill(
    model: Any, input_ids: torch.Tensor, attention: torch.Tensor, samples: int, cache: DynamicCache | None = None
) -> tuple[DynamicCache, torch.Tensor | None]:
    """Run the prompts once and copy the cache to each of their ``samples`` rows; returns it with the last
    position's logits, one row per sample (``None`` for empty prompts). ``cache``: an empty cache to fill (a
    stock ``DynamicCache`` when None).

    Positions follow the left padding exactly as ``generate`` computes them, so outputs do not change.
    """
    cache = DynamicCache(config=model.config) if cache is None else cache
    last_logits = None
    if input_ids.shape[1] > 0:
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        output = model(
            input_ids=input_ids,
            attention_mask=attention,
            position_ids=positions,
            **with_cache(cache),
            use_cache=True,
            logits_to_keep=1,
        )
        last_logits = output.logits[:, -1].repeat_interleave(samples, dim=0)
    if samples > 1:
        cache.batch_repeat_interleave(samples)
    return cache, last_logits
