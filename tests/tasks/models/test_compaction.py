"""Finished rows leave the decoding batch: the same tokens to the bit as whole batches (greedy rows and sampled
rows, in bf16 and fp32), the batch really shrinks, and a model whose rows depend on their batch keeps whole
batches."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

import tasks.models.compaction as compaction
import tasks.models.generation as generation
from tasks.models.precision import compute_autocast


def _model() -> LlamaForCausalLM:
    """A 2-layer grouped-query Llama (4 query heads, 2 key/value heads), eager attention as grpoflow decodes."""
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=0,
        attn_implementation="eager",
    )
    torch.manual_seed(3)
    return LlamaForCausalLM(config).eval()


# A third of the vocabulary ends a row: rows of a batch finish at different steps, as evaluation's answers do.
_CONFIG = GenerationConfig(
    max_new_tokens=12, do_sample=True, temperature=1.0, top_k=0, eos_token_id=list(range(2, 34)), pad_token_id=0
)
_PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [40, 41, 42, 43], [50], [60, 61, 62, 63, 64, 65]]


def _decode(model: LlamaForCausalLM, precision: str) -> torch.Tensor:
    torch.manual_seed(11)
    with torch.inference_mode(), compute_autocast(precision):
        return generation._sample_with_shared_prefill(model, _PROMPTS, 4, 0, _CONFIG, greedy_first=True)[0]


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_rows_that_leave_change_no_token(monkeypatch, precision) -> None:
    model = _model()
    kept: list[int] = []
    choose = compaction.rows_to_keep

    def watched(done: torch.Tensor, min_rows: int = compaction.MIN_ROWS) -> torch.Tensor | None:
        keep = choose(done, min_rows)
        kept.extend([] if keep is None else [keep.numel()])
        return keep

    checks: list[bool] = []
    check = compaction.check_once
    monkeypatch.setattr(compaction, "rows_to_keep", watched)
    monkeypatch.setattr(compaction, "check_once", lambda *args: checks.append(check(*args)) or checks[-1])
    shrinking = _decode(model, precision)
    if checks[0]:  # where the first-use check passes (both precisions on this project's CI machines)
        assert kept, "no batch shrank although rows finished"
    assert all(size >= compaction.MIN_ROWS for size in kept)
    monkeypatch.setattr(compaction, "check_once", lambda *args: False)
    whole = _decode(model, precision)
    assert shrinking.shape[0] == len(_PROMPTS) * 5
    assert torch.equal(shrinking, whole)
    ended = [bool((row[:-1] == 0).any()) for row in whole]  # padding before the last step: a row ended early
    assert any(ended) and not all(ended)


def test_rows_that_depend_on_their_batch_keep_whole_batches(monkeypatch) -> None:
    """A model whose logits move with the batch size (as one-row kernels do) fails the first-use check."""
    model = _model()
    monkeypatch.setattr(compaction, "_checked", {})
    model.lm_head.register_forward_hook(lambda module, args, output: output + 1e-3 * output.shape[0])
    with torch.inference_mode(), compute_autocast("fp32"):
        assert not compaction.check_once(model, None, "cpu")
    monkeypatch.setattr(compaction, "rows_to_keep", lambda *args: pytest.fail("a batch shrank"))
    _decode(model, "fp32")


def test_the_draws_are_those_of_the_rows_alone() -> None:
    """Finished rows still draw their number: a sampled row gets the same token whichever rows have finished."""
    logits = torch.randn(6, 97)
    greedy_rows = torch.tensor([True, False, False, True, False, False])
    choose = {"greedy": False, "temperature": 1.0, "top_k": None, "top_p": None, "min_p": None}
    torch.manual_seed(5)
    none_done = generation._choose_tokens(logits, torch.zeros(6, dtype=torch.bool), greedy_rows, 0, choose)
    torch.manual_seed(5)
    done = torch.tensor([False, True, False, False, False, True])
    some_done = generation._choose_tokens(logits, done, greedy_rows, 0, choose)
    assert torch.equal(some_done[~done], none_done[~done]) and (some_done[done] == 0).all()
    assert torch.equal(none_done[greedy_rows], logits[greedy_rows].argmax(-1))
