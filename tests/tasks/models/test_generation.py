"""The decoding loop against transformers' own: greedy tokens equal ``generate``'s, and sampled tokens follow
the distribution transformers' logits warpers define."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from tasks.models import load_base_model
from tasks.models.generation import _sample_with_shared_prefill, decodable, next_tokens, sample_groups


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir: Path):  # noqa: ANN201
    return load_base_model(tiny_model_dir).eval()


def test_greedy_decoding_matches_generate(tiny_model) -> None:  # noqa: ANN001
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]  # different lengths: left padding
    config = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=[2], pad_token_id=0)
    with torch.inference_mode():
        ours, _ = _sample_with_shared_prefill(tiny_model, prompts, 3, 0, config)
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        output = tiny_model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    theirs = output[:, width:].repeat_interleave(3, dim=0)
    assert ours.shape[0] == 9
    assert torch.equal(ours, theirs[:, : ours.shape[1]])
    assert (theirs[:, ours.shape[1] :] == 0).all()  # we stop where every row has ended; generate pads on


@pytest.mark.parametrize(
    ("settings", "warpers"),
    [
        ({"temperature": 0.7}, [TemperatureLogitsWarper(0.7)]),
        ({"top_k": 3}, [TopKLogitsWarper(3)]),
        ({"top_p": 0.7}, [TopPLogitsWarper(0.7)]),
        ({"temperature": 1.3, "min_p": 0.2}, [TemperatureLogitsWarper(1.3), MinPLogitsWarper(0.2)]),
    ],
)
def test_sampled_tokens_follow_transformers_distribution(settings: dict, warpers: list) -> None:
    logits = torch.log(torch.tensor([[0.42, 0.25, 0.15, 0.1, 0.05, 0.03]]))
    expected = logits.clone()
    for warper in warpers:
        expected = warper(None, expected)
    expected = expected.softmax(dim=-1)[0]
    torch.manual_seed(0)
    draws = next_tokens(logits.expand(40_000, -1), **settings)
    frequencies = torch.bincount(draws, minlength=6).float() / draws.numel()
    assert torch.allclose(frequencies, expected, atol=0.01), (frequencies, expected)
    assert (frequencies[expected == 0] == 0).all()  # filtered tokens are never drawn


def test_settings_the_loop_lacks_go_to_generate(tiny_model) -> None:  # noqa: ANN001
    plain = GenerationConfig(max_new_tokens=4, do_sample=True, temperature=0.9, eos_token_id=[2], pad_token_id=0)
    penalised = GenerationConfig(max_new_tokens=4, do_sample=True, repetition_penalty=1.3, pad_token_id=0)
    assert decodable(plain) and not decodable(penalised)
    with torch.inference_mode():
        completions = sample_groups(tiny_model, [[5, 6, 7]] * 2 + [[8, 9]] * 2, penalised, 0, [2])
    assert len(completions) == 4 and all(0 < len(c) <= 4 for c in completions)


def test_same_seed_same_samples(tiny_model) -> None:  # noqa: ANN001
    config = GenerationConfig(max_new_tokens=6, do_sample=True, temperature=1.0, eos_token_id=[2], pad_token_id=0)

    def draw() -> list[list[int]]:
        torch.manual_seed(7)
        with torch.inference_mode():
            return sample_groups(tiny_model, [[5, 6, 7]] * 4, config, 0, [2])

    first = draw()
    assert first == draw() and len({tuple(c) for c in first}) > 1  # reproducible, and the samples differ


def test_stock_generation_gives_the_same_greedy_answers(tiny_model, tiny_model_dir: Path) -> None:  # noqa: ANN001
    """``speedups: off`` samples with transformers' own ``generate``: the same texts when nothing is random."""
    from tasks.models import generate_completions, load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir)
    prompts = ["12+30=", "what is 7 + 8?", "a"]
    ours = generate_completions(tiny_model, tokenizer, prompts, greedy=True, max_new_tokens=8)
    stock = generate_completions(tiny_model, tokenizer, prompts, greedy=True, max_new_tokens=8, stock=True)
    assert stock == ours and all(len(texts) == 1 for texts in stock)
    sampled = generate_completions(tiny_model, tokenizer, prompts, n=3, max_new_tokens=8, stock=True, batch_size=9)
    assert [len(texts) for texts in sampled] == [3, 3, 3] and len({t for texts in sampled for t in texts}) > 3


@pytest.mark.parametrize("stock", [False, True])
def test_greedy_first_decodes_both_passes_at_once_with_the_same_answers(tiny_model, tiny_model_dir, stock) -> None:  # noqa: ANN001
    """Evaluation's greedy answer and samples from one prefill and one loop: the greedy texts are the greedy
    pass's, and the samples are the sampled pass's (same batches, same seeds, only sampled rows draw)."""
    from tasks.models import GenerationStats, generate_completions, load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir)
    prompts = ["12+30=", "what is 7 + 8?", "a", "41+1=", "9+9=", "the end"]
    common = {"max_new_tokens": 8, "batch_size": 6, "seed": 3, "stock": stock}
    greedy = generate_completions(tiny_model, tokenizer, prompts, greedy=True, **common)
    sampled = generate_completions(tiny_model, tokenizer, prompts, n=3, temperature=0.9, **common)
    stats = GenerationStats()
    both = generate_completions(
        tiny_model, tokenizer, prompts, n=3, temperature=0.9, greedy_first=True, stats=stats, **common
    )
    assert [each[:1] for each in both] == greedy
    assert [each[1:] for each in both] == sampled
    assert len({t for texts in sampled for t in texts}) > 6  # the samples do differ (not all greedy)
    assert stats.sequences == len(prompts) * 4


def test_parts_of_the_batches_add_up_to_the_whole(tiny_model, tiny_model_dir: Path) -> None:  # noqa: ANN001
    """``part=(i, n)`` samples only every n-th batch: the parts together are one call's completions."""
    from tasks.models import generate_completions, load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir)
    prompts = [f"{a} + {a * 3} =" for a in range(7)]
    common = {"n": 2, "max_new_tokens": 5, "batch_size": 4, "seed": 3}  # two prompts a batch: four batches
    whole = generate_completions(tiny_model, tokenizer, prompts, **common)
    parts = [generate_completions(tiny_model, tokenizer, prompts, part=(i, 2), **common) for i in range(2)]
    assert all(bool(a) != bool(b) for a, b in zip(*parts, strict=True))  # each prompt in exactly one part
    assert [a or b for a, b in zip(*parts, strict=True)] == whole
