"""GRPO's transformers sampler samples the policy the trainer scores: in bf16 the adapter is kept apart from the
weights (never merged into them and rounded), and the log-probabilities it samples with are the trainer's own."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from trl.trainer.utils import selective_log_softmax

from tasks.models import compute_autocast, load_policy
from tasks.speedups.frozen import store_frozen_in
from tasks.speedups.grpo_trainer import sampler_model
from tasks.speedups.merged_copy import MergedCopy
from tasks.speedups.unmerged_view import UnmergedView

# Measured: 0 on the tiny model and on SmolLM2 (the view computes the trainer's products); a bf16 merge of the same
# adapters: 4e-3 here at the widest token, 0.39 nats on SmolLM2 (mean 0.07).
BOUND = 1e-3


def _policy(tiny_model_dir: Path, tiny_adapter: Path) -> torch.nn.Module:
    """The trainer's policy in bf16: a trainable adapter, its frozen base weights stored in bf16."""
    policy = load_policy(tiny_model_dir, tiny_adapter, trainable=True)
    store_frozen_in(policy, "bf16")
    return policy


def _token_logps(model: torch.nn.Module, ids: torch.Tensor, precision: str) -> torch.Tensor:
    with torch.no_grad(), compute_autocast(precision):
        logits = model(input_ids=ids).logits.float()
    return selective_log_softmax(logits[:, :-1], ids[:, 1:])


def test_the_bf16_sampler_keeps_the_adapter_apart_and_scores_what_the_trainer_scores(
    tiny_model_dir: Path, tiny_adapter: Path
) -> None:
    policy = _policy(tiny_model_dir, tiny_adapter)
    ids = torch.randint(3, 40, (3, 17), generator=torch.Generator().manual_seed(0))
    trainer = _token_logps(policy, ids, "bf16")
    sampler = sampler_model(policy, "bf16")
    assert isinstance(sampler.copy, UnmergedView)
    with sampler.sampling() as model:
        ours = _token_logps(model, ids, sampler.precision)
    assert (ours - trainer).abs().max().item() <= BOUND
    merged = MergedCopy(policy, torch.bfloat16)  # what GRPO sampled before: the bound tells a merge apart
    assert (_token_logps(merged.model, ids, "fp32") - trainer).abs().max().item() > BOUND


def test_the_bf16_view_samples_the_adapter_of_the_last_step_without_a_copy(
    tiny_model_dir: Path, tiny_adapter: Path
) -> None:
    policy = _policy(tiny_model_dir, tiny_adapter)
    view = UnmergedView(policy, torch.bfloat16)
    ids = torch.randint(3, 40, (2, 11), generator=torch.Generator().manual_seed(1))
    before = _token_logps(view.model, ids, "bf16")
    with torch.no_grad():  # an optimizer step, as far as the adapter is concerned
        for name, parameter in policy.named_parameters():
            if "lora_B" in name:
                parameter.add_(0.3)
    after = _token_logps(view.refresh(), ids, "bf16")
    assert (after - before).abs().max().item() > 0.05
    assert torch.equal(after, _token_logps(policy, ids, "bf16"))
    adapter = {p.data_ptr() for name, p in policy.named_parameters() if "lora_" in name}
    shared = {p.data_ptr() for p in view.model.parameters()} & adapter
    assert shared == adapter  # every adapter matrix is the trainer's own tensor, not a copy


def test_the_fp32_sampler_is_a_merged_copy_where_merging_is_exact(tiny_model_dir: Path, tiny_adapter: Path) -> None:
    policy = load_policy(tiny_model_dir, tiny_adapter, trainable=True)
    sampler = sampler_model(policy, "fp32")
    assert isinstance(sampler.copy, MergedCopy)
    ids = torch.randint(3, 40, (2, 13), generator=torch.Generator().manual_seed(2))
    with sampler.sampling() as model:
        ours = _token_logps(model, ids, "fp32")
    assert (ours - _token_logps(policy, ids, "fp32")).abs().max().item() < 1e-4


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_decoding_hands_back_the_log_probs_of_the_tokens_it_drew(
    tiny_model_dir: Path, tiny_adapter: Path, precision: str
) -> None:
    """``sample_groups``' log-probabilities are those a full forward pass gives the same tokens (at the sampling
    temperature, over the whole vocabulary), within the rounding of decoding one token at a time."""
    from transformers import GenerationConfig

    from tasks.models import sample_groups

    model = load_policy(tiny_model_dir, tiny_adapter, precision=precision)
    config = GenerationConfig(max_new_tokens=10, do_sample=True, temperature=0.7, top_k=0, eos_token_id=[2])
    prompts = [[5, 6, 7, 8], [5, 6, 7, 8], [9, 10, 11, 12], [9, 10, 11, 12]]  # two groups, as TRL batches them
    torch.manual_seed(0)
    ids, logps = sample_groups(model, prompts, config, pad_id=0, eos_ids=[2], precision=precision, with_logps=True)
    assert [len(row) for row in logps] == [len(row) for row in ids]
    tolerance = 1e-4 if precision == "fp32" else 0.05
    for prompt, completion, sampled in zip(prompts, ids, logps, strict=True):
        full = torch.tensor([prompt + completion])
        with torch.no_grad(), compute_autocast(precision):
            logits = model(input_ids=full).logits.float()[:, len(prompt) - 1 : -1]
        expected = selective_log_softmax(logits, full[:, len(prompt) :], 0.7)[0]
        assert torch.allclose(torch.tensor(sampled), expected, atol=tolerance), (sampled, expected.tolist())
