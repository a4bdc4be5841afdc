"""SFT and GRPO with the real TRL trainers on the tiny model: one adapter, trained by SFT, continued by GRPO."""

import json
import sys

import pytest
import torch
from safetensors.torch import load_file

from tasks.config import PipelineConfig
from tasks.grpo import run_grpo
from tasks.sft import run_sft


def test_sft_then_grpo_continue_one_adapter(tiny_config, tiny_split, tiny_model_dir, tmp_path) -> None:
    # A length reward gives the random model a learning signal, so GRPO's update is not zero.
    config = PipelineConfig.model_validate(
        {**tiny_config.model_dump(), "rewards": [{"name": "length_closeness", "args": {"target_chars": 4}}]}
    )
    sft = run_sft(config, tiny_split.train_path, tiny_model_dir, tmp_path / "sft")
    assert sft.steps == config.sft.max_steps
    assert sft.last("loss") is not None or sft.last("train_loss") is not None
    grpo = run_grpo(config, tiny_split.train_path, tiny_model_dir, sft.adapter_dir, tmp_path / "grpo")
    assert grpo.steps == config.grpo.max_steps
    assert grpo.last("rewards/length_closeness/mean") is not None
    assert grpo.last("frac_reward_zero_std") is not None

    sft_config = json.loads((sft.adapter_dir / "adapter_config.json").read_text())
    grpo_config = json.loads((grpo.adapter_dir / "adapter_config.json").read_text())
    assert sft_config["r"] == grpo_config["r"] == config.lora.r
    sft_weights = load_file(sft.adapter_dir / "adapter_model.safetensors")
    grpo_weights = load_file(grpo.adapter_dir / "adapter_model.safetensors")
    assert sft_weights.keys() == grpo_weights.keys()  # the same adapter, continued
    assert any(not torch.equal(sft_weights[k], grpo_weights[k]) for k in sft_weights)  # and trained further


def test_corrupt_checkpoint_falls_back_to_the_previous_one(tiny_config, tiny_split, tiny_model_dir, tmp_path) -> None:
    from tasks.training import resumable_checkpoint

    config = PipelineConfig.model_validate(
        {**tiny_config.model_dump(), "sft": {**tiny_config.sft.model_dump(), "max_steps": 2, "checkpoint_steps": 1}}
    )
    run_sft(config, tiny_split.train_path, tiny_model_dir, tmp_path / "sft")
    checkpoints = tmp_path / "sft" / "checkpoints"
    assert {p.name for p in checkpoints.glob("checkpoint-*")} == {"checkpoint-1", "checkpoint-2"}
    weights = next((checkpoints / "checkpoint-2").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])  # a crash mid-write
    assert resumable_checkpoint(checkpoints) == checkpoints / "checkpoint-1"
    assert (checkpoints / "corrupt" / "checkpoint-2").is_dir()
    # Rerunning the stage resumes from checkpoint-1, finishes the remaining step, and keeps the whole loss curve.
    resumed = run_sft(config, tiny_split.train_path, tiny_model_dir, tmp_path / "sft")
    assert resumed.steps == 2
    assert [entry["step"] for entry in resumed.history if "loss" in entry] == [1.0, 2.0]
    assert (checkpoints / "corrupt" / "checkpoint-2").is_dir()  # the evidence outlives the trainer's rotation
    # Killed after the last step: the resume trains nothing, and still reports the losses it had.
    again = run_sft(config, tiny_split.train_path, tiny_model_dir, tmp_path / "sft")
    assert again.steps == 2 and [entry["step"] for entry in again.history if "loss" in entry] == [1.0, 2.0]


def test_when_every_checkpoint_is_corrupt_training_starts_from_scratch(tmp_path, caplog) -> None:
    from tasks.training import resumable_checkpoint

    for step in (1, 2):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text("{broken")
    with caplog.at_level("WARNING"):
        assert resumable_checkpoint(tmp_path) is None
    assert "trying checkpoint-1" in caplog.text and "starting from scratch" in caplog.text
    assert sorted(p.name for p in (tmp_path / "corrupt").iterdir()) == ["checkpoint-1", "checkpoint-2"]


def test_grpo_examples_keep_object_columns_as_json(tiny_config, tiny_model_dir) -> None:
    from reward_fns.json_schema import json_schema
    from tasks.grpo import grpo_examples
    from tasks.models import load_tokenizer

    rows = [
        {"id": 1, "prompt": "p", "ground_truth": "{}", "schema": {"type": "object"}},
        {"id": "2", "prompt": "q", "ground_truth": "{}", "schema": '{"type": "array"}'},
    ]
    examples = grpo_examples(rows, load_tokenizer(tiny_model_dir), tiny_config)
    assert [e["id"] for e in examples] == ["1", "2"]
    # The reward reads the column as TRL will pass it: a dict schema must still be judged.
    assert json_schema(completions=["{}", "{}"], schema=[e["schema"] for e in examples]) == [1.0, 0.0]


def _shared_prefill_trainer(precision, tiny_config, tiny_split, tiny_model_dir, adapter, out, loss=None):  # noqa: ANN001, ANN202
    """grpoflow's GRPO trainer on the tiny policy, as the GRPO stage builds it for ``precision`` (and the loss
    settings ``loss``, a ``GRPOLossSettings`` dict)."""
    from datasets import Dataset
    from trl import GRPOConfig

    from reward_fns.registry import build_reward_functions
    from tasks.config import GRPOLossSettings, grpo_loss_args
    from tasks.grpo import grpo_examples
    from tasks.inputs import read_jsonl
    from tasks.models import load_policy, load_tokenizer
    from tasks.speedups.frozen import store_frozen_in
    from tasks.speedups.grpo_trainer import SharedPrefillGRPOTrainer
    from tasks.training import common_trainer_args

    tokenizer = load_tokenizer(tiny_model_dir)
    rows = read_jsonl(tiny_split.train_path)[:4]
    rewards, _ = build_reward_functions(tiny_config.rewards)
    config = tiny_config.model_copy(update={"model": tiny_config.model.model_copy(update={"precision": precision})})
    trainer = SharedPrefillGRPOTrainer(
        precision=precision,
        model=load_policy(tiny_model_dir, adapter, trainable=True),
        reward_funcs=rewards,
        args=GRPOConfig(
            **common_trainer_args(config, out),
            per_device_train_batch_size=8,
            num_generations=4,
            max_completion_length=6,
            max_steps=1,
            **grpo_loss_args(GRPOLossSettings.model_validate(loss or {})),
        ),
        train_dataset=Dataset.from_list(grpo_examples(rows, tokenizer, tiny_config)),
        processing_class=tokenizer,
    )
    store_frozen_in(trainer.model, precision)
    return trainer


def _loss_batch(trainer, input_ids, attention, advantages, old_logps):  # noqa: ANN001, ANN202
    """One GRPO loss batch for ``trainer`` on the shuffled batch: its prompt and completion parts, ``advantages``,
    and old log-probs ``old_logps(the policy's own)``."""
    import torch

    trainer.current_gradient_accumulation_steps = 1
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, input_ids, attention, 5)
    return {
        "prompt_ids": input_ids[:, :7],
        "prompt_mask": attention[:, :7],
        "completion_ids": input_ids[:, 7:],
        "completion_mask": attention[:, 7:],
        "advantages": advantages,
        "old_per_token_logps": old_logps(logps),
        "num_items_in_batch": attention[:, 7:].sum(),
    }


def _shuffled_batch():  # noqa: ANN202
    """A GRPO batch as TRL shuffles it: two prompts (one left-padded) of three samples each, completions
    right-padded."""
    import torch

    prompts = torch.randint(3, 40, (2, 7))[[0, 1, 0, 1, 1, 0]]
    input_ids = torch.cat([prompts, torch.randint(3, 40, (6, 5))], dim=1)
    attention = torch.ones_like(input_ids)
    attention[[0, 2, 5], :4] = 0  # left padding of the first prompt
    attention[1, -2:] = 0  # a completion that ended early
    return input_ids, attention


def test_fast_grpo_paths_match_trl(tiny_config, tiny_split, tiny_model_dir, tiny_adapter, tmp_path) -> None:
    """The trainer's two replacements agree with TRL's own: log-probs (plain log-softmax vs TRL's fused LM head)
    and generation (one prefill per group, in order, each completion cut after its first EOS)."""
    import torch

    from tasks.speedups.grpo_trainer import SharedPrefillGRPOTrainer

    # fp32, so that the comparison is exact up to summation order (bf16 autocast would round both paths).
    trainer = _shared_prefill_trainer("fp32", tiny_config, tiny_split, tiny_model_dir, tiny_adapter, tmp_path / "out")
    input_ids, attention = _shuffled_batch()
    model = trainer.model
    lora = [p for n, p in model.named_parameters() if "lora_" in n]

    def logps_and_grads(compute):  # noqa: ANN001, ANN202
        model.zero_grad()
        logps, entropy, _ = compute(model, input_ids, attention, 5, None, True)
        kept = attention[:, -5:]  # TRL zeroes padded completion positions; the loss never reads them
        (logps * kept).sum().backward()
        return (logps * kept).detach(), (entropy * kept).detach(), [p.grad.clone() for p in lora]

    ours, our_entropy, our_grads = logps_and_grads(trainer._get_per_token_logps_and_entropies)
    theirs, their_entropy, their_grads = logps_and_grads(
        super(SharedPrefillGRPOTrainer, trainer)._get_per_token_logps_and_entropies
    )
    assert torch.allclose(ours, theirs, atol=1e-4) and torch.allclose(our_entropy, their_entropy, atol=1e-4)
    # The shared prompt's gradient is the sum over its samples: the LoRA gradients agree with TRL's.
    assert all(torch.allclose(a, b, atol=1e-4, rtol=1e-3) for a, b in zip(our_grads, their_grads, strict=True))
    assert any(g.abs().sum() > 0 for g in our_grads)
    with torch.no_grad():
        chunked, _, _ = trainer._get_per_token_logps_and_entropies(model, input_ids, attention, 5, 2, False)
        unshared, _, _ = trainer._get_per_token_logps_and_entropies(model, input_ids[[0, 3]], attention[[0, 3]], 5)
    assert torch.allclose(chunked * attention[:, -5:], ours, atol=1e-5)  # TRL's batch_size chunking
    assert torch.allclose(unshared, ours[[0, 3]], atol=1e-5)  # two distinct prompts: one plain pass
    assert trainer._shared_prefill_agrees is True  # checked against TRL's on the first batch

    # A release that breaks the shared prefill's numbers (here: logits scaled) is caught on the first batch, and
    # TRL's own path runs from then on.
    import tasks.speedups.grpo_trainer as shared_prefill

    trainer._shared_prefill_agrees = None
    exact = shared_prefill.completion_logits
    shared_prefill.completion_logits = lambda *args: exact(*args) * 1.5
    try:
        with torch.no_grad():
            fallback, _, _ = trainer._get_per_token_logps_and_entropies(model, input_ids, attention, 5)
    finally:
        shared_prefill.completion_logits = exact
    assert trainer._shared_prefill_agrees is False
    assert torch.allclose(fallback * attention[:, -5:], theirs, atol=1e-5)

    prompts = [[5, 6, 7, 8]] * 4 + [[9, 10]] * 4
    completions, logprobs = trainer._generate_single_turn(prompts, None, {}, 4)
    assert len(completions) == 8  # with each token's log-probability, for the sampler-agreement check
    assert [len(values) for values in logprobs] == [len(c) for c in completions]
    assert all(value <= 0.0 for values in logprobs for value in values)
    assert all(0 < len(c) <= 6 for c in completions)
    eos = set(trainer.eos_token_ids)
    assert all(token not in eos for c in completions for token in c[:-1])  # cut after the first EOS


def test_shared_prefill_check_tells_a_bug_from_bf16_rounding(
    tiny_config, tiny_split, tiny_model_dir, tiny_adapter, tmp_path
) -> None:
    """In bf16 the two paths round differently by tenths of a nat on a real model (SmolLM2: up to 0.37 between
    them, 0.46 from fp32), past any bf16 tolerance. The first-batch check therefore runs both in fp32 (the frozen
    weights upcast and autocast off, TRL's own autocast too): rounding keeps the speed-up on, a real break still
    turns it off, and the frozen weights stay stored in bf16. The model is prepared by accelerate as in training,
    whose forward wraps its own autocast."""
    import torch
    from peft.tuners.lora import LoraLayer

    import tasks.speedups.grpo_trainer as shared_prefill
    from tasks.speedups.frozen import _frozen_weights

    trainer = _shared_prefill_trainer("bf16", tiny_config, tiny_split, tiny_model_dir, tiny_adapter, tmp_path / "out")
    model = trainer.accelerator.prepare_model(trainer.model)  # as in training: its forward carries bf16 autocast
    layer = next(module for module in model.modules() if isinstance(module, LoraLayer)).base_layer
    seen: list[tuple[bool, torch.dtype]] = []
    layer.register_forward_pre_hook(
        lambda module, _: seen.append((torch.is_autocast_enabled("cpu"), module.weight.dtype))
    )
    input_ids, attention = _shuffled_batch()

    with trainer.accelerator.autocast():  # as in a training step
        assert trainer._agrees_with_trl(model, input_ids, attention, 5) is True
    assert len(seen) >= 2 and set(seen) == {(False, torch.float32)}  # both paths, both in fp32
    assert {weight.dtype for weight in _frozen_weights(model)} == {torch.bfloat16}
    seen.clear()
    trainer._shared_prefill_agrees = True  # as after the first batch
    with torch.no_grad(), trainer.accelerator.autocast():
        trainer._get_per_token_logps_and_entropies(model, input_ids, attention, 5)
    assert set(seen) == {(True, torch.bfloat16)}  # training itself still runs in bf16

    exact = shared_prefill.completion_logits
    shared_prefill.completion_logits = lambda *args: exact(*args) * 1.5
    try:
        with trainer.accelerator.autocast():
            assert trainer._agrees_with_trl(model, input_ids, attention, 5) is False
    finally:
        shared_prefill.completion_logits = exact


def test_scoring_only_labelled_positions_keeps_the_sft_loss(tiny_config, tiny_split, tiny_model_dir, tmp_path) -> None:
    """On CPU the fused LM head scores only the completion positions; loss and gradients stay TRL's."""
    import trl.trainer.utils as trl_utils
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from tasks.inputs import read_jsonl
    from tasks.models import load_base_model, load_tokenizer
    from tasks.sft import sft_examples
    from tasks.speedups.trl_patches import score_only_labelled_positions
    from tasks.training import common_trainer_args, lora_config

    fp32 = tiny_config.model_copy(update={"model": tiny_config.model.model_copy(update={"precision": "fp32"})})
    tokenizer = load_tokenizer(tiny_model_dir)
    trainer = SFTTrainer(
        model=load_base_model(tiny_model_dir),
        args=SFTConfig(**common_trainer_args(fp32, tmp_path / "out"), max_steps=1, completion_only_loss=True),
        train_dataset=Dataset.from_list(sft_examples(read_jsonl(tiny_split.train_path)[:8], tokenizer, fp32)),
        processing_class=tokenizer,
        peft_config=lora_config(fp32),
    )
    batch = next(iter(trainer.get_train_dataloader()))
    lora = [p for n, p in trainer.model.named_parameters() if "lora_B" in n]

    def loss_and_grads() -> tuple[torch.Tensor, list[torch.Tensor]]:
        trainer.model.zero_grad()
        loss = trainer.compute_loss(trainer.model, dict(batch))
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in lora]

    every_position = loss_and_grads()
    assert not trl_utils._use_triton(torch.device("cpu"))
    with score_only_labelled_positions():
        assert trl_utils._use_triton(torch.device("cpu"))  # the compact path is taken ...
        labelled_only = loss_and_grads()
    assert not trl_utils._use_triton(torch.device("cpu"))  # ... and TRL is left as it was
    assert torch.allclose(every_position[0], labelled_only[0], atol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(every_position[1], labelled_only[1], strict=True))
    assert any(g.abs().sum() > 0 for g in labelled_only[1])


def test_rewards_get_every_column_and_a_reward_that_cannot_judge_stops_grpo(
    tiny_config, tiny_split, tiny_model_dir, tmp_path, monkeypatch
) -> None:
    """A custom reward reads the user's own columns, in training as in evaluation; one that cannot judge (it
    raises) stops GRPO before evaluation and promotion, however short the run."""
    from tasks.evaluation import score_groups
    from tasks.grpo import grpo_examples
    from tasks.models import load_tokenizer
    from tasks.training import RewardNoneLimitExceeded

    (tmp_path / "column_rewards.py").write_text(
        "def by_difficulty(completions, difficulty, **kwargs):\n    return [float(d) for d in difficulty]\n"
        "def broken(completions, **kwargs):\n    raise RuntimeError('cannot parse')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "column_rewards", raising=False)
    rows = [
        {"id": "a", "prompt": "1+1?", "ground_truth": "2", "difficulty": 3},
        {"id": "b", "prompt": "2+2?", "ground_truth": "4", "difficulty": 5},
    ]
    examples = grpo_examples(rows, load_tokenizer(tiny_model_dir), tiny_config)
    assert [e["difficulty"] for e in examples] == [3, 5]
    rewards = [{"name": "column_rewards:by_difficulty"}]
    custom = PipelineConfig.model_validate({**tiny_config.model_dump(), "rewards": rewards})
    assert score_groups(custom, rows, [["x", "y"], ["z", "w"]])["total"].tolist() == [[3.0, 3.0], [5.0, 5.0]]

    failing = PipelineConfig.model_validate(
        {
            **tiny_config.model_dump(),
            "rewards": [{"name": "column_rewards:broken"}],
            "grpo": {**tiny_config.grpo.model_dump(), "max_steps": 1},
        }
    )
    with pytest.raises(RewardNoneLimitExceeded, match="reward broken could not judge 8/8 completions"):
        run_grpo(failing, tiny_split.train_path, tiny_model_dir, None, tmp_path / "grpo")


LOSSES = {  # name: GRPOLossSettings; every loss TRL 1.16 has, and the stability settings that change its terms
    "dapo": {},
    "grpo": {"loss_type": "grpo"},
    "gspo": {"loss_type": "grpo", "importance_sampling_level": "sequence"},
    "dr_grpo": {"loss_type": "dr_grpo"},
    "bnpo": {"loss_type": "bnpo"},
    "cispo": {"loss_type": "cispo"},
    "sapo": {"loss_type": "sapo"},
    "luspo": {"loss_type": "luspo", "importance_sampling_level": "sequence"},
    "vespo": {"loss_type": "vespo"},
    "clip-higher, two-sided, masks, entropy": {
        "epsilon_high": 0.28,
        "delta": 1.5,
        "off_policy_mask_threshold": 0.05,
        "top_entropy_quantile": 0.5,
        "entropy_coef": 0.01,
    },
}


def test_every_loss_agrees_with_trl_on_the_shared_prefill_path(
    tiny_config, tiny_split, tiny_model_dir, tiny_adapter, tmp_path
) -> None:
    """The losses are TRL's own ``_compute_loss``; the shared-prefill trainer only replaces the log-probs under it.
    For each loss, the loss and the LoRA gradients agree with TRL's own log-prob path on one batch whose old
    log-probs differ from the policy's (so clipping, masking and the importance weights all act)."""
    from trl import GRPOTrainer

    input_ids, attention = _shuffled_batch()
    torch.manual_seed(1)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 1.5, -1.5])
    for name, loss in LOSSES.items():
        trainer = _shared_prefill_trainer("fp32", tiny_config, tiny_split, tiny_model_dir, tiny_adapter, tmp_path, loss)
        model = trainer.model
        off_policy = lambda old: old + 0.3 * torch.randn_like(old)  # noqa: E731 - old log-probs: ratios far from 1
        inputs = _loss_batch(trainer, input_ids, attention, advantages, off_policy)
        lora = [p for n, p in model.named_parameters() if "lora_" in n]

        def loss_and_grads(trainer=trainer, inputs=inputs, lora=lora, model=model):  # noqa: ANN001, ANN202
            model.zero_grad()
            value = trainer._compute_loss(model, inputs)
            value.backward()
            return value.detach(), [p.grad.clone() for p in lora]

        ours, our_grads = loss_and_grads()
        trl_logps = GRPOTrainer._get_per_token_logps_and_entropies.__get__(trainer)
        trainer._get_per_token_logps_and_entropies = trl_logps
        theirs, their_grads = loss_and_grads()
        assert torch.isfinite(ours) and torch.allclose(ours, theirs, atol=1e-5), name
        assert all(torch.allclose(a, b, atol=1e-4, rtol=1e-3) for a, b in zip(our_grads, their_grads, strict=True)), (
            name
        )
        assert any(g.abs().sum() > 0 for g in our_grads), name


def test_gspo_weighs_whole_sequences_and_clip_higher_lets_through_what_plain_clipping_stops(
    tiny_config, tiny_split, tiny_model_dir, tiny_adapter, tmp_path
) -> None:
    """What sets the two loss variants apart, on the trainer the stage builds: GSPO's importance weight is one per
    sequence (the mean log-ratio of its tokens), so moving the old log-probs between a sequence's tokens leaves the
    loss and its gradients as they were, where token-level GRPO's change; clip-higher (epsilon_high 0.28) keeps the
    gradient of a ratio of 1.25 on a positive advantage, which the symmetric clip at 1.2 zeroes."""
    import math

    import torch

    input_ids, attention = _shuffled_batch()
    mask = attention[:, 7:].float()

    def loss_and_grads(loss: dict, shift: torch.Tensor, advantages: torch.Tensor) -> tuple:
        trainer = _shared_prefill_trainer("fp32", tiny_config, tiny_split, tiny_model_dir, tiny_adapter, tmp_path, loss)
        model = trainer.model
        inputs = _loss_batch(trainer, input_ids, attention, advantages, lambda logps: logps - shift)
        lora = [p for n, p in model.named_parameters() if "lora_" in n]
        model.zero_grad()
        value = trainer._compute_loss(model, inputs)
        value.backward()
        return value.detach(), torch.cat([p.grad.flatten().clone() for p in lora])

    generator = torch.Generator().manual_seed(2)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 1.5, -1.5])
    shift = 0.1 * torch.randn(mask.shape, generator=generator) * mask
    moved = torch.randn(mask.shape, generator=generator) * mask
    moved = (moved - (moved.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True)) * mask) * 0.1  # sums to 0 per row
    gspo = {"loss_type": "grpo", "importance_sampling_level": "sequence"}
    gspo_loss, gspo_grads = loss_and_grads(gspo, shift, advantages)
    gspo_moved, gspo_moved_grads = loss_and_grads(gspo, shift + moved, advantages)
    assert torch.allclose(gspo_loss, gspo_moved, atol=1e-6) and torch.allclose(gspo_grads, gspo_moved_grads, atol=1e-6)
    token_loss, token_grads = loss_and_grads({"loss_type": "grpo"}, shift, advantages)
    token_moved, token_moved_grads = loss_and_grads({"loss_type": "grpo"}, shift + moved, advantages)
    assert not torch.allclose(token_grads, token_moved_grads, atol=1e-6)

    ratio = torch.full(mask.shape, math.log(1.25)) * mask  # every token's ratio 1.25, every advantage positive
    positive = torch.tensor([1.0, 0.5, 1.5, 1.0, 0.5, 1.5])
    _, clipped = loss_and_grads({}, ratio, positive)  # dapo, epsilon 0.2 on both sides
    _, clip_higher = loss_and_grads({"epsilon_high": 0.28}, ratio, positive)
    assert clipped.abs().max() == 0 and clip_higher.abs().max() > 0
