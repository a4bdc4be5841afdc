"""The repeated KV cache: the same completions to the bit as the stock cache, on a grouped-query model, in bf16
and fp32; the attention modules are given back as they were; models it does not fit keep the stock cache."""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import repeat_kv

import tasks.models.generation as generation
from tasks.speedups import repeated_cache
from tasks.speedups.repeated_cache import RepeatedLayer, _repeated, fits, repeated_kv


def _grouped_model(attention: str = "eager") -> LlamaForCausalLM:
    """A 2-layer Llama with 4 query heads sharing 2 key/value heads (as SmolLM2 and Qwen2 share theirs)."""
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         eos_token_id=2, pad_token_id=0, attn_implementation=attention)  # fmt: skip
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
    return generation.generate_completions(model, _Tokenizer(), prompts, n=3, max_new_tokens=9, batch_size=6,
                                           seed=5, precision=precision, greedy_first=True)  # fmt: skip


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_completions_are_those_of_the_stock_cache_to_the_bit(monkeypatch, precision) -> None:
    model = _grouped_model()
    used = []
    original = generation.repeated_kv

    @contextlib.contextmanager
    def watched(*args, **kwargs):
        with original(*args, **kwargs) as new_cache:
            used.append(new_cache is not None)
            yield new_cache

    monkeypatch.setattr(generation, "repeated_kv", watched)
    fast = _sample(model, precision)
    assert used and all(used), "the repeated cache was not used on a model it fits"

    @contextlib.contextmanager
    def stock(*args, **kwargs):
        yield None

    monkeypatch.setattr(generation, "repeated_kv", stock)
    assert _sample(model, precision) == fast
    assert [m.num_key_value_groups for m in model.model.layers[0].modules() if hasattr(m, "layer_idx")] == [2]


def test_the_attention_modules_get_their_groups_back_after_an_error() -> None:
    model = _grouped_model()
    with pytest.raises(RuntimeError), repeated_kv(model) as new_cache:
        assert new_cache is not None and isinstance(new_cache().layers[0], RepeatedLayer)
        assert model.model.layers[1].self_attn.num_key_value_groups == 1
        raise RuntimeError("decoding failed")
    assert all(layer.self_attn.num_key_value_groups == 2 for layer in model.model.layers)


def test_a_model_it_does_not_fit_keeps_the_stock_cache() -> None:
    model = _grouped_model("sdpa")
    assert not fits(model)
    with repeated_kv(model) as new_cache:
        assert new_cache is None
    assert model.model.layers[0].self_attn.num_key_value_groups == 2


def test_a_disagreement_keeps_the_stock_cache(monkeypatch) -> None:
    model = _grouped_model()
    monkeypatch.setattr(repeated_cache, "_checked", {})
    monkeypatch.setattr(RepeatedLayer, "update", lambda self, k, v, *a, **kw: super(RepeatedLayer, self).update(
        _repeated(k, self.groups, self.cast_to) * 1.001, _repeated(v, self.groups, self.cast_to)))  # fmt: skip
    with repeated_kv(model) as new_cache:
        assert new_cache is None


def test_repeated_states_are_laid_out_as_repeat_kv_lays_them() -> None:
    states = torch.randn(3, 2, 5, 8)
    assert torch.equal(_repeated(states, 3, None), repeat_kv(states, 3))
    assert torch.equal(_repeated(states, 3, torch.bfloat16), repeat_kv(states, 3).to(torch.bfloat16))
