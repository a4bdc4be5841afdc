"""A GRPOTrainer that encodes each prompt once for its whole group, in generation and in the loss, on CPU.

Overrides two private TRL methods (``_get_per_token_logps_and_entropies``, ``_generate_single_turn``) and uses
TRL's private helpers; vLLM, multimodal, CUDA and multi-process runs go to TRL's own code. Tool calls are supported:
TRL's tool loop calls ``_generate_single_turn`` for each round (every conversation once, its ids so far as the
prompt), which this loop samples like any batch; the loss reads TRL's ``tool_mask`` as TRL's own does.
Must not import: Prefect, MLflow, the stages.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from trl import GRPOTrainer
from trl.extras.profiling import profiling_context
from trl.trainer.utils import selective_log_softmax, selective_log_softmax_and_entropy

from tasks.models import merge_is_exact, resolve_dtype, sample_groups, with_cache
from tasks.speedups.merged_copy import MergedCopy
from tasks.speedups.unmerged_view import UnmergedView

logger = logging.getLogger(__name__)


def shared_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows that hold distinct prompts (same tokens and padding), and for each row which of them it holds.
    A GRPO batch has each prompt once per sample, in an order TRL shuffles.

    >>> firsts, of_row = shared_prompts(torch.tensor([[1, 2], [0, 3], [1, 2], [1, 2]]), torch.ones(4, 2))
    >>> firsts.tolist(), of_row.tolist()
    ([0, 1], [0, 1, 0, 0])
    """
    rows_with_padding = torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype)], dim=1)
    _, of_row = torch.unique(rows_with_padding, dim=0, return_inverse=True)
    rows = torch.arange(prompt_ids.size(0), device=prompt_ids.device)
    firsts = torch.full((int(of_row.max()) + 1,), prompt_ids.size(0), dtype=torch.long, device=rows.device)
    firsts = firsts.scatter_reduce(0, of_row, rows, reduce="amin")
    order = firsts.argsort()  # number the prompts in order of first appearance
    return firsts[order], order.argsort()[of_row]


def select_cache_rows(cache: Any, rows: torch.Tensor) -> None:
    """``cache.batch_select_indices(rows)``, with ``index_select``: its backward (``index_add_``) sums the gradients
    of the rows that share a prompt in a fixed order. Advanced indexing's backward (an accumulating ``index_put_``)
    sums them in whatever order the threads finish on CPU, so the same seed gave a different adapter from run to
    run (``bench/bench_reproducibility.py``). Layers that keep more than keys and values use their own method."""
    from transformers.cache_utils import DynamicLayer

    for layer in cache.layers:
        if type(layer).batch_select_indices is not DynamicLayer.batch_select_indices:
            layer.batch_select_indices(rows)
        elif layer.get_seq_length() > 0:
            layer.keys, layer.values = layer.keys.index_select(0, rows), layer.values.index_select(0, rows)


def rows_to_check(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int, per_prompt: int = 2
) -> torch.Tensor:
    """The rows the first batch's check runs on: the first ``per_prompt`` rows of each distinct prompt. Each
    prompt still has its KV cache shared by more than one row, as in training, at a fraction of the cost of
    checking every sample (two fp32 passes over the demo's 16 rows took 3.1 s).

    >>> ids = torch.tensor([[1, 2, 7], [0, 3, 8], [1, 2, 9], [1, 2, 6], [0, 3, 5]])
    >>> rows_to_check(ids, torch.ones_like(ids), 1).tolist()
    [0, 1, 2, 4]
    """
    prompt_length = input_ids.size(1) - logits_to_keep
    if prompt_length <= 0:
        return torch.arange(input_ids.size(0), device=input_ids.device)
    _, of_row = shared_prompts(input_ids[:, :prompt_length], attention_mask[:, :prompt_length])
    seen: dict[int, int] = {}
    keep = []
    for row, prompt in enumerate(of_row.tolist()):
        seen[prompt] = seen.get(prompt, 0) + 1
        if seen[prompt] <= per_prompt:
            keep.append(row)
    return torch.tensor(keep, dtype=torch.long, device=input_ids.device)


def completion_logits(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int) -> Any:
    """The logits that predict the last ``logits_to_keep`` tokens of each row (rows × tokens × vocab), the same as
    ``model(input_ids, attention_mask, logits_to_keep=logits_to_keep + 1).logits[:, :-1]`` but with each distinct
    prompt encoded once: its KV cache (and its gradient) is shared by the rows that continue it, so a group of G
    samples costs one prompt plus G completions instead of G of each. Positions are those of the single call
    (counted over the padded row), so the values agree to rounding.
    """
    from transformers import DynamicCache

    prompt_length = input_ids.size(1) - logits_to_keep
    prompts, prompt_mask = input_ids[:, :prompt_length], attention_mask[:, :prompt_length]
    firsts, of_row = shared_prompts(prompts, prompt_mask) if prompt_length > 0 else (None, None)
    if firsts is None or len(firsts) == input_ids.size(0):  # nothing shared: one plain pass
        return model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=logits_to_keep + 1).logits[
            :, :-1
        ]
    cache = DynamicCache()
    head = model(
        input_ids=prompts[firsts],
        attention_mask=prompt_mask[firsts],
        **with_cache(cache),
        use_cache=True,
        logits_to_keep=1,
    ).logits.index_select(0, of_row)
    if logits_to_keep == 1:
        return head
    select_cache_rows(cache, of_row)  # differentiable: the rows' gradients sum into their shared prompt
    tail = model(
        input_ids=input_ids[:, prompt_length:-1],  # the last token predicts nothing that is kept
        attention_mask=attention_mask[:, :-1],
        **with_cache(cache),
        use_cache=True,
    ).logits
    return torch.cat([head, tail], dim=1)


class SharedPrefillGRPOTrainer(GRPOTrainer):
    """TRL's GRPOTrainer that encodes each prompt once for its whole group, in generation and in training.

    TRL puts each prompt ``num_generations`` times in the batch and encodes every copy. Here, in generation,
    the copies share one prefill (its KV cache is copied), and sampling runs on the policy as a plain model
    (``sampler_model``): in fp32 a copy with the LoRA deltas folded in (``MergedCopy``, refreshed once per optimizer
    step); where a merge would round (bf16), a view over the trainer's own weights with the adapter kept apart
    (``UnmergedView``), the products the trainer computes. It hands TRL each sampled token's log-probability, which
    the sampler-agreement check compares with the trainer's own every step. In
    the loss, the copies share one encoding of the prompt and its gradient (``completion_logits``). vLLM,
    multimodal and multi-process runs keep TRL's own generation; on CUDA the loss is TRL's own (its fused LM-head
    kernel). A tool-using rollout's later rounds come here too, one sample per conversation (``grpo.tool_generation``
    in the stage's tags names what sampled them).
    """

    def __init__(self, *args: Any, precision: str = "fp32", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.generation_precision = precision
        self._generation_model: Any = None  # MergedCopy, UnmergedView or LivePolicy (sampler_model)
        self._generation_model_step = -1
        self._shared_prefill_agrees: bool | None = None  # checked against TRL's log-probs on the first batch

    def _agrees_with_trl(self, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, keep: int) -> bool:
        """Whether the shared-prefill log-probs match TRL's own on these rows (no gradient): a transformers or
        TRL release that changes the cache or the positions shows here, and TRL's path is used from then on.

        Both run in fp32 whatever the training precision (frozen weights upcast, which is exact; autocast off, TRL's
        own too): in bf16 any two evaluation orders of a real model differ by rounding alone by tenths of a nat
        (SmolLM2: up to 0.46 from fp32 for either path, 0.37 between them), which no tolerance tells from a bug.
        They run on the PEFT model's base model (where TRL puts its fused LM head): the prepared model's own
        forward carries accelerate's autocast, which no outer context turns off.
        """
        from accelerate.utils import AutocastKwargs

        from tasks.speedups.frozen import frozen_in_fp32

        inner = self.accelerator.unwrap_model(model)
        inner = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
        handler = self.accelerator.autocast_handler
        self.accelerator.autocast_handler = AutocastKwargs(enabled=False)  # TRL's path enters accelerator.autocast
        try:
            with torch.no_grad(), frozen_in_fp32(inner), torch.autocast(input_ids.device.type, enabled=False):
                theirs = super()._get_per_token_logps_and_entropies(inner, input_ids, attention_mask, keep)[0]
                logits = completion_logits(inner, input_ids, attention_mask, keep)
        finally:
            self.accelerator.autocast_handler = handler
        ours = selective_log_softmax(logits.float(), input_ids[:, -keep:], self.temperature)
        kept = attention_mask[:, -keep:].bool()  # TRL zeroes padded completion positions; the loss never reads them
        gap = (ours - theirs).abs()[kept].max().item() if kept.any() else 0.0
        tolerance = 1e-3
        if gap > tolerance or gap != gap:  # NaN too
            logger.warning(
                "shared prefill off: its log-probs differ from TRL's by up to %.3g (> %g, both in fp32); "
                "TRL's own loss path is used",
                gap,
                tolerance,
            )
            return False
        logger.info("shared prefill checked against TRL's log-probs (fp32): max |difference| %.2g", gap)
        return True

    def _get_per_token_logps_and_entropies(  # noqa: ANN202
        self,
        model,  # noqa: ANN001
        input_ids,  # noqa: ANN001
        attention_mask,  # noqa: ANN001
        logits_to_keep,  # noqa: ANN001
        batch_size=None,  # noqa: ANN001
        compute_entropy=False,  # noqa: ANN001
        compute_aux_loss=False,  # noqa: ANN001
        **multimodal,  # noqa: ANN003
    ):
        """Each group's prompt is encoded once (forward and backward) and its KV cache shared by the group's
        completions; then plain logits → log-softmax, as TRL's fused, tiled LM-head kernel has no CPU kernel and
        its pure-torch fallback is slower here than materializing the (small) completion logits."""
        # Several processes: DDP expects one forward per backward, and the shared prefill makes two.
        several = self.accelerator.num_processes > 1
        if compute_aux_loss or input_ids.is_cuda or several or any(v is not None for v in multimodal.values()):
            return super()._get_per_token_logps_and_entropies(
                model,
                input_ids,
                attention_mask,
                logits_to_keep,
                batch_size,
                compute_entropy,
                compute_aux_loss,
                **multimodal,
            )
        chunk = batch_size or input_ids.size(0)  # TRL's chunking bounds the (rows × tokens × vocab) logits
        if self._shared_prefill_agrees is None:
            rows = rows_to_check(input_ids[:chunk], attention_mask[:chunk], logits_to_keep)
            self._shared_prefill_agrees = self._agrees_with_trl(
                model, input_ids[rows], attention_mask[rows], logits_to_keep
            )
        if not self._shared_prefill_agrees:
            return super()._get_per_token_logps_and_entropies(
                model,
                input_ids,
                attention_mask,
                logits_to_keep,
                batch_size,
                compute_entropy,
                compute_aux_loss,
                **multimodal,
            )
        all_logps, all_entropies = [], []
        for start in range(0, input_ids.size(0), chunk):
            ids, mask = input_ids[start : start + chunk], attention_mask[start : start + chunk]
            with self.accelerator.autocast():
                logits = completion_logits(model, ids, mask, logits_to_keep)
            logits, targets = logits.float(), ids[:, -logits_to_keep:]
            if compute_entropy:  # the entropy needs a gradient only when the loss has an entropy bonus
                logps, entropy = selective_log_softmax_and_entropy(
                    logits, targets, getattr(self, "_entropy_bonus_enabled", True), self.temperature
                )
                all_entropies.append(entropy)
            else:
                logps = selective_log_softmax(logits, targets, self.temperature)
            all_logps.append(logps)
        entropies = torch.cat(all_entropies) if compute_entropy else None
        return torch.cat(all_logps), entropies, None

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):  # noqa: ANN001, ANN202
        if self.use_vllm or images is not None or multimodal_fields or self.accelerator.num_processes > 1:
            # TRL's own generation. With transformers it runs the policy itself, whose frozen weights may be stored
            # in bf16 (speedups.frozen): under the trainer's autocast, as its training forward is (vLLM samples
            # from its own copy of the weights).
            with nullcontext() if self.use_vllm else self.accelerator.autocast():
                return super()._generate_single_turn(
                    prompt_ids, images, multimodal_fields, num_generations, has_tool_images
                )
        if self._generation_model_step != self.state.global_step:  # the weights changed since the last copy
            with profiling_context(self, "merge_for_generation"):
                if self._generation_model is None:
                    policy = self.accelerator.unwrap_model(self.model)
                    self._generation_model = sampler_model(policy, self.generation_precision)
                else:
                    self._generation_model.refresh()
            self._generation_model_step = self.state.global_step
        sampler = self._generation_model
        with profiling_context(self, "transformers.generate"), sampler.sampling() as model:
            completion_ids, logps = sample_groups(
                model,
                prompt_ids,
                self.generation_config,
                pad_id=self._tokenizer.pad_token_id,
                eos_ids=self.eos_token_ids,
                precision=sampler.precision,
                with_logps=True,
            )
        return completion_ids, logps


class LivePolicy:
    """The trained PEFT model itself as GRPO's sampler (eval mode while it samples, under the compute precision's
    autocast): the public path, for adapters the plain views do not cover (DoRA, several adapters)."""

    def __init__(self, policy: Any, precision: str) -> None:
        self.model, self.precision = policy, precision

    def refresh(self) -> Any:
        return self.model

    @contextmanager
    def sampling(self) -> Iterator[Any]:
        was_training = self.model.training
        self.model.eval()
        try:
            yield self.model
        finally:
            self.model.train(was_training)


class _Plain:
    """A ``MergedCopy`` or ``UnmergedView`` as a sampler: its model, and the precision it samples under."""

    def __init__(self, copy: Any, precision: str) -> None:
        self.copy, self.precision = copy, precision

    def refresh(self) -> Any:
        return self.copy.refresh()

    @contextmanager
    def sampling(self) -> Iterator[Any]:
        yield self.copy.model


def sampler_model(policy: Any, precision: str) -> Any:
    """What GRPO's transformers loop samples from: where merging is exact (fp32), a merged copy in fp32; where it
    would round the adapter away (bf16), a view that keeps it apart (sampled under bf16 autocast, as the trainer
    computes); the PEFT model itself where the view does not apply. Logs which."""
    if merge_is_exact(precision):
        logger.info("GRPO sampler: a merged fp32 copy of the policy, refreshed each step")
        return _Plain(MergedCopy(policy, resolve_dtype(precision)), "fp32")
    try:
        view = UnmergedView(policy, resolve_dtype(precision))
    except ValueError as exc:
        logger.info("GRPO sampler: the PEFT model itself (%s)", exc)
        return LivePolicy(policy, precision)
    logger.info("GRPO sampler: the policy with its adapter kept apart from the bf16 weights (not merged)")
    return _Plain(view, precision)
