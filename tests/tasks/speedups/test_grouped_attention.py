"""Grouped attention while decoding: the same completions to the bit as eager attention and the stock cache, on a
grouped-query model, in bf16 and fp32; the model attends as before afterwards; models it does not fit, and a
disagreement at the first-use check, keep the stock path."""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import tasks.models.generation as generation
from tasks.speedups import grouped_attention as grouped
from tasks.speedups.grouped_attention import GROUPED, CastLayer, fits, grouped_decoding


def _grouped_model(attention: str = "eager") -> LlamaForCausalLM:
    """A 2-layer Llama with 4 query heads sharing 2 key/value heads (as SmolLM2 and Qwen2 share theirs)."""
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=2,
        pad_token_id=0,
        attn_implementation=attention,
    )
    torch.manual_seed(3)
    return LlamaForCausalLM(config).eval()


class _Tokenizer:
    """Text ↔ ids one character per token, enough for ``generate_completions``."""

    pad_token_id, eos_token_id = 0, 2

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": [3 + ord(c) % 90 for c in text]}

    def batch_decode(self, rows: torch.Tensor, skip_special_tokens: bool = True) -> list[str]:
        return [" ".join(str(int(t)) for t in row) for row in rows]


def _sample(model: LlamaForCausalLM, precision: str) -> list[list[str]]:
    prompts = ["12+7=", "a longer prompt, padded less", "x", "3*3 is"]
    return generation.generate_completions(
        model,
        _Tokenizer(),
        prompts,
        n=3,
        max_new_tokens=9,
        batch_size=6,
        seed=5,
        precision=precision,
        greedy_first=True,
    )


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_completions_are_those_of_the_stock_cache_to_the_bit(monkeypatch, precision) -> None:
    model = _grouped_model()
    used = []
    original = generation.grouped_decoding

    @contextlib.contextmanager
    def watched(*args, **kwargs):
        with original(*args, **kwargs) as new_cache:
            used.append(new_cache is not None)
            yield new_cache

    monkeypatch.setattr(generation, "grouped_decoding", watched)
    fast = _sample(model, precision)
    assert used and all(used), "grouped attention was not used on a model it fits"

    @contextlib.contextmanager
    def stock(*args, **kwargs):
        yield None

    monkeypatch.setattr(generation, "grouped_decoding", stock)
    assert _sample(model, precision) == fast
    assert model.config._attn_implementation == "eager"


def test_the_model_attends_as_before_after_an_error() -> None:
    model = _grouped_model()
    with pytest.raises(RuntimeError), grouped_decoding(model) as new_cache:
        assert new_cache is not None and isinstance(new_cache().layers[0], CastLayer)
        assert model.config._attn_implementation == GROUPED
        raise RuntimeError("decoding failed")
    assert model.config._attn_implementation == "eager"


def test_a_model_it_does_not_fit_keeps_the_stock_path() -> None:
    model = _grouped_model("sdpa")
    assert not fits(model)
    with grouped_decoding(model) as new_cache:
        assert new_cache is None
    assert model.config._attn_implementation == "sdpa"


def test_a_disagreement_keeps_the_stock_path(monkeypatch) -> None:
    from transformers import AttentionInterface

    model = _grouped_model()
    monkeypatch.setattr(grouped, "_checked", {})
    grouped._register()

    def off_by_a_little(module, query, *args, **kwargs):
        return grouped.grouped_attention(module, query * 1.001, *args, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, GROUPED, off_by_a_little)
    with grouped_decoding(model) as new_cache:
        assert new_cache is None
    assert model.config._attn_implementation == "eager"


@pytest.mark.parametrize("length", [1, 5])
def test_grouped_products_are_those_of_repeated_heads_to_the_bit(length) -> None:
    from transformers.models.llama.modeling_llama import eager_attention_forward

    torch.manual_seed(1)
    module = _grouped_model().model.layers[0].self_attn
    query, key, value = torch.randn(6, 4, length, 16), torch.randn(6, 2, 9, 16), torch.randn(6, 2, 9, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        stock, _ = eager_attention_forward(module, query, key, value, None, scaling=0.25)
        fast, _ = grouped.grouped_attention(module, query, key.bfloat16(), value.bfloat16(), None, scaling=0.25)
    assert torch.equal(stock, fast)
