"""The online difficulty filter's hook in TRL's GRPOTrainer (a feature, not a speed-up: ``speedups: off`` keeps
it). It sits between generation and the loss: after a generation batch is sampled and scored, groups whose rewards
all agree (no advantage) are replaced by groups of other prompts sampled on top (DAPO's dynamic sampling, capped),
and prompts solved in every group for K visits leave the pool. Works with either generation backend, as it calls
TRL's own ``_generate_and_score_completions`` for every round.

Overrides two private TRL methods (``_generate_and_score_completions``, ``_calculate_rewards``) and writes TRL's
private ``_metrics``; the decisions themselves are plain functions in ``tasks.training.learning_signal``.
Must not import: Prefect, MLflow, the stages.
"""

from __future__ import annotations

import json
import logging
import random
from typing import Any

import torch

from tasks.training import RetirementPool, choose_groups, draws_needed, informative_groups, solved_groups

logger = logging.getLogger(__name__)

# Keys of TRL's generation output this hook knows how to pad and select; any other (images) skips the filter. A tool
# batch's ``tool_mask`` (0 on the tools' answers) is a completion column like the others, padded with 1 as TRL pads it.
_PROMPT_KEYS = {"prompt_ids", "prompt_mask"}
_ROW_KEYS = {"advantages"}
_COMPLETION_KEYS = {
    "completion_ids",
    "completion_mask",
    "old_per_token_logps",
    "ref_per_token_logps",
    "sampling_per_token_logps",
    "importance_sampling_ratio",
    "tool_mask",
}
_KNOWN_KEYS = _PROMPT_KEYS | _ROW_KEYS | _COMPLETION_KEYS | {"num_items_in_batch"}


def prompt_key(prompt: Any) -> str:
    """A prompt's identity in the retirement pool (text, or a conversation as JSON).

    >>> prompt_key("2+2?"), prompt_key([{"role": "user", "content": "2+2?"}])
    ('2+2?', '[{"content": "2+2?", "role": "user"}]')
    """
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)


def _pad_to(tensor: torch.Tensor, width: int, value: float, left: bool) -> torch.Tensor:
    missing = width - tensor.size(1)
    if missing <= 0:
        return tensor
    pad = torch.full((tensor.size(0), missing), value, dtype=tensor.dtype, device=tensor.device)
    return torch.cat([pad, tensor] if left else [tensor, pad], dim=1)


def concat_generation_outputs(outputs: list[dict[str, Any]], pad_id: int) -> dict[str, Any]:
    """One generation output from several rounds': prompts re-padded on the left, completions on the right.

    >>> a = {"prompt_ids": torch.tensor([[5, 6]]), "prompt_mask": torch.ones(1, 2, dtype=torch.long),
    ...      "completion_ids": torch.tensor([[7]]), "completion_mask": torch.ones(1, 1, dtype=torch.long),
    ...      "advantages": torch.tensor([0.5])}
    >>> b = {"prompt_ids": torch.tensor([[6]]), "prompt_mask": torch.ones(1, 1, dtype=torch.long),
    ...      "completion_ids": torch.tensor([[8, 9]]), "completion_mask": torch.ones(1, 2, dtype=torch.long),
    ...      "advantages": torch.tensor([-0.5])}
    >>> out = concat_generation_outputs([a, b], pad_id=0)
    >>> out["prompt_ids"].tolist(), out["completion_ids"].tolist(), out["completion_mask"].tolist()
    ([[5, 6], [0, 6]], [[7, 0], [8, 9]], [[1, 0], [1, 1]])
    """
    merged: dict[str, Any] = {}
    completion_width = max(o["completion_ids"].size(1) for o in outputs)
    prompt_width = max(o["prompt_ids"].size(1) for o in outputs)
    for key in outputs[0]:
        if key == "num_items_in_batch":
            continue
        parts = [o[key] for o in outputs]
        if key in _PROMPT_KEYS:
            value = pad_id if key == "prompt_ids" else 0
            parts = [_pad_to(p, prompt_width, value, left=True) for p in parts]
        elif parts[0].dim() == 2 and parts[0].size(1) == outputs[0]["completion_ids"].size(1):
            value = pad_id if key == "completion_ids" else 1 if key == "tool_mask" else 0
            parts = [_pad_to(p, completion_width, value, left=False) for p in parts]
        merged[key] = torch.cat(parts, dim=0)
    return merged


def loss_tokens(output: dict[str, Any]) -> torch.Tensor:
    """The tokens the loss reads, as TRL counts them: the completion's, less the tools' answers (``tool_mask``).

    >>> loss_tokens({"completion_mask": torch.tensor([[1, 1, 1, 0]]), "tool_mask": torch.tensor([[1, 0, 1, 1]])})
    tensor([[1, 0, 1, 0]])
    """
    mask = output["completion_mask"]
    return mask * output["tool_mask"] if "tool_mask" in output else mask


def select_rows(output: dict[str, Any], rows: torch.Tensor) -> dict[str, Any]:
    """The output's rows ``rows``, with columns that are padding in every kept row cut off."""
    selected = {key: value[rows] for key, value in output.items()}
    prompt_used = selected["prompt_mask"].any(dim=0).nonzero()
    completion_used = selected["completion_mask"].any(dim=0).nonzero()
    first = int(prompt_used[0]) if len(prompt_used) else 0
    last = int(completion_used[-1]) + 1 if len(completion_used) else 1
    completion_width = output["completion_ids"].size(1)
    for key, value in selected.items():
        if key in _PROMPT_KEYS:
            selected[key] = value[:, first:]
        elif value.dim() == 2 and value.size(1) == completion_width:
            selected[key] = value[:, :last]
    return selected


class DynamicSamplingMixin:
    """Put before a ``GRPOTrainer`` class in the bases. ``dynamic_sampling`` is ``grpo.dynamic_sampling`` (off:
    TRL's own path untouched); ``correctness_reward`` the reward that says solved (1.0) for retirement;
    ``retirement_pool`` the pool to continue (from a checkpoint)."""

    def __init__(
        self,
        *args: Any,
        dynamic_sampling: Any = None,
        correctness_reward: str | None = None,
        retirement_pool: RetirementPool | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.dynamic_sampling = dynamic_sampling
        names = list(self.reward_func_names)
        self.correctness_index = names.index(correctness_reward) if correctness_reward in names else None
        retire_after = dynamic_sampling.retire_after if dynamic_sampling else 0
        self.retirement_pool = retirement_pool or RetirementPool(retire_after)
        self._scored_rewards: torch.Tensor | None = None
        self._pool_keys: list[str] | None = None
        self._filter_skipped_why: str | None = None

    def _calculate_rewards(self, *args: Any, **kwargs: Any) -> torch.Tensor:  # noqa: D102
        rewards = super()._calculate_rewards(*args, **kwargs)
        self._scored_rewards = rewards  # every rank's rewards, gathered: each rank decides the same
        return rewards

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:  # noqa: D102
        settings = self.dynamic_sampling
        if settings is None or not settings.enabled or not self.model.training:
            return super()._generate_and_score_completions(inputs)
        self._filtering, self._kept_rows = True, None  # the rollout ledger waits for the rows kept
        try:
            return self._filtered_generation(list(inputs), settings)
        finally:
            self._filtering = False
            commit = getattr(self, "ledger_commit", None)
            if commit is not None:
                commit(self._kept_rows)

    # --- the rounds -------------------------------------------------------------------------------------------

    def _group_verdicts(self) -> tuple[list[bool], list[bool]]:
        """(informative, solved) for every group of the last scored round, over all ranks."""
        per_func = self._scored_rewards.float().cpu()
        weights = self.reward_weights.float().cpu()
        unjudged = torch.isnan(per_func).all(dim=1)
        weighted = (per_func * weights).nansum(dim=1)
        weighted[unjudged] = float("nan")
        informative = informative_groups(weighted.tolist(), self.num_generations)
        if self.correctness_index is not None:
            correct = per_func[:, self.correctness_index].tolist()
        else:  # without a correctness reward, solved means the best weighted reward the functions can give
            best = float(weights.clamp(min=0).sum())
            correct = [None if v != v else float(v >= best - 1e-9) for v in weighted.tolist()]
        return informative, solved_groups(correct, self.num_generations)

    def _draw(self, count: int, exclude: set[str], salt: int) -> list[dict[str, Any]]:
        """``count`` prompts from the training pool (not retired, not in the batch), each once per sample."""
        dataset = self.train_dataset
        if self._pool_keys is None:
            self._pool_keys = [prompt_key(p) for p in dataset["prompt"]]
        candidates = [
            i for i, key in enumerate(self._pool_keys) if key not in exclude and key not in self.retirement_pool.retired
        ]
        available = len(candidates)
        if self.accelerator.num_processes > 1:  # every rank draws as many as the poorest rank can
            counts = self.accelerator.gather(torch.tensor([available], device=self.accelerator.device))
            available = int(counts.min())
        rng = random.Random(hash((self.args.seed, self.accelerator.process_index, self.state.global_step, salt)))
        chosen = rng.sample(candidates, min(count, available))
        rows = []
        for index in chosen:
            row = dataset[index]
            rows.extend(dict(row) for _ in range(self.num_generations))  # TRL may write into each row
        return rows

    def _swap_retired(self, groups: list[list[dict[str, Any]]]) -> int:
        """Replace groups of retired prompts before anything is sampled for them; returns how many."""
        retired = self.retirement_pool.retired
        stale = [i for i, group in enumerate(groups) if prompt_key(group[0]["prompt"]) in retired]
        if not stale and self.accelerator.num_processes == 1:  # with ranks, every rank draws (a collective)
            return 0
        present = {prompt_key(group[0]["prompt"]) for group in groups}
        fresh = self._draw(len(stale), present, salt=-1)
        for slot, start in zip(stale, range(0, len(fresh), self.num_generations), strict=False):
            groups[slot] = fresh[start : start + self.num_generations]
        return min(len(stale), len(fresh) // self.num_generations)

    def _filtered_generation(self, inputs: list[dict[str, Any]], settings: Any) -> dict[str, Any]:
        from accelerate.utils import gather_object

        size, rank, ranks = self.num_generations, self.accelerator.process_index, self.accelerator.num_processes
        groups = [inputs[i : i + size] for i in range(0, len(inputs), size)]
        slots = len(groups)
        swapped = self._swap_retired(groups)
        keys = [prompt_key(group[0]["prompt"]) for group in groups]
        outputs, local_flags = [], []
        budget, sampled_rounds = int(settings.max_oversample * slots), 0
        before: float | None = None
        found = [0] * ranks
        sampled_groups = informative_groups_seen = 0  # over every rank: the rate each rank plans with
        seen: set[str] = set(keys)
        batch = [row for group in groups for row in group]
        while True:
            output = super()._generate_and_score_completions(batch)
            sampled_rounds += 1
            unknown = set(output) - _KNOWN_KEYS
            if unknown:  # images: leave TRL's batch as it is
                if self._filter_skipped_why is None:
                    self._filter_skipped_why = ", ".join(sorted(unknown))
                    logger.warning("dynamic sampling skipped: the batch carries %s", self._filter_skipped_why)
                return output
            informative, solved = self._group_verdicts()
            all_keys = [key for part in gather_object([keys]) for key in part] if ranks > 1 else keys
            self.retirement_pool.record(all_keys, solved)
            groups_per_rank = len(informative) // ranks
            local = informative[rank * groups_per_rank : (rank + 1) * groups_per_rank]
            outputs.append(output)
            local_flags.extend(local)
            if before is None:
                before = sum(informative) / len(informative)
            # Every rank must sample the same number of rounds and prompts (TRL gathers across ranks): the shortfall
            # that decides is the largest of any rank, computed from the gathered verdicts.
            for r in range(ranks):
                found[r] += sum(informative[r * groups_per_rank : (r + 1) * groups_per_rank])
            missing = max(slots - f for f in found)
            sampled_groups, informative_groups_seen = (
                sampled_groups + len(informative),
                informative_groups_seen + sum(informative),
            )
            rate = informative_groups_seen / sampled_groups
            draws = draws_needed(missing, rate, budget)
            if not draws:
                break
            batch = self._draw(draws, seen, salt=sampled_rounds)
            if not batch:
                break
            keys = [prompt_key(batch[i]["prompt"]) for i in range(0, len(batch), size)]
            seen.update(keys)
            budget -= draws
        merged = concat_generation_outputs(outputs, self.processing_class.pad_token_id)
        chosen = choose_groups(local_flags, slots)
        self._kept_rows = [g * size + i for g in chosen for i in range(size)]
        rows = torch.tensor(self._kept_rows, device=merged["advantages"].device)
        result = select_rows(merged, rows)
        result["num_items_in_batch"] = self.accelerator.gather(loss_tokens(result).sum()).sum()
        kept = [local_flags[g] for g in chosen]
        share = torch.tensor([sum(kept) / len(kept)], device=self.accelerator.device)
        after = float(self.accelerator.gather(share).mean())
        metrics = self._metrics["train"]
        zero_std = metrics["frac_reward_zero_std"]
        del zero_std[len(zero_std) - sampled_rounds :]  # TRL appended one per round; the batch trained on is one
        zero_std.append(1.0 - after)
        metrics["signal/informative_before"].append(before)
        metrics["signal/informative_after"].append(after)
        metrics["signal/extra_prompts"].append(float(len(local_flags) - slots + swapped))
        metrics["signal/prompts_retired"].append(float(len(self.retirement_pool.retired)))
        return result
