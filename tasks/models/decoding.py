"""How the next token is chosen, and which generation settings grpoflow's decoding loop implements
(``tasks.models.generation._decode``); anything else goes to transformers' ``generate``.
Must not import: Prefect, MLflow, the stages.
"""

from __future__ import annotations

from typing import Any

import torch


def until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    """``tokens`` up to and including the first EOS.

    >>> until_eos([5, 6, 2, 2, 2], {2})
    [5, 6, 2]
    """
    return next((tokens[: i + 1] for i, token in enumerate(tokens) if token in eos), tokens)


# Generation settings ``_decode`` implements; anything else set goes to ``generate``.
_DECODE_SETTINGS = {
    "max_new_tokens",
    "do_sample",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "cache_implementation",
    "disable_compile",
    "use_cache",
    "transformers_version",
    "repetition_penalty",
}


def decodable(generation_config: Any) -> bool:
    """Whether ``_decode`` implements every setting of ``generation_config`` (else ``generate`` runs).

    >>> from transformers import GenerationConfig
    >>> decodable(GenerationConfig(max_new_tokens=8, do_sample=True, temperature=0.7, top_p=0.9))
    True
    >>> decodable(GenerationConfig(max_new_tokens=8, repetition_penalty=1.2))
    False
    """
    settings = generation_config.to_diff_dict()
    return (
        set(settings) <= _DECODE_SETTINGS
        and settings.get("max_new_tokens") is not None
        and settings.get("repetition_penalty", 1.0) in (None, 1.0)
    )


def next_tokens(
    logits: torch.Tensor,
    *,
    greedy: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    uniform: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row of ``logits`` (rows × vocabulary): the argmax, or a draw from the tempered, filtered
    distribution. ``uniform``: the draw's number in [0, 1) for each row (float64, rows × 1); drawn here when None.

    >>> next_tokens(torch.tensor([[0.0, 3.0, 1.0]]), greedy=True).tolist()
    [1]
    >>> next_tokens(torch.tensor([[0.0, 9.0, 8.0]]), top_k=1).tolist()
    [1]
    """
    if greedy:
        return logits.argmax(dim=-1)
    if temperature != 1.0 or top_k or (top_p is not None and top_p < 1.0):  # x / 1.0 is x: skip that pass
        logits = logits.float() if temperature == 1.0 else logits.float() / temperature
    if top_k:
        threshold = logits.topk(min(top_k, logits.size(-1)), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    if top_p is not None and top_p < 1.0:
        ordered, order = logits.sort(dim=-1, descending=True)
        sorted_probabilities = ordered.softmax(dim=-1)
        mass_before = sorted_probabilities.cumsum(dim=-1) - sorted_probabilities
        drop_sorted = mass_before >= top_p  # as transformers: the smallest set that reaches top_p stays
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probabilities = logits.softmax(dim=-1, dtype=torch.float32)  # bf16 logits cast inside the pass, not copied first
    if min_p:
        probabilities = probabilities.masked_fill(
            probabilities < min_p * probabilities.max(dim=-1, keepdim=True).values, 0.0
        )
    # Inverse CDF: one uniform number per row (drawing one per vocabulary entry is what makes multinomial slow).
    # Summed in float64 as it goes (the same sums as a float64 copy's, without the copy).
    cumulative = probabilities.cumsum(dim=-1, dtype=torch.float64)
    if uniform is None:
        uniform = draw_uniform(cumulative.size(0), cumulative.device)
    tokens = torch.searchsorted(cumulative, uniform * cumulative[:, -1:], right=True)  # never a 0-chance token
    return tokens.squeeze(-1).clamp(max=probabilities.size(-1) - 1)


def draw_uniform(rows: int, device: Any = None) -> torch.Tensor:
    """The numbers ``next_tokens`` draws for ``rows`` rows (float64, rows × 1), from torch's global generator.

    >>> draw_uniform(3).shape
    torch.Size([3, 1])
    """
    return torch.rand(rows, 1, dtype=torch.float64, device=device)
