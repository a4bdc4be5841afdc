"""The GRPO trainer's side of the rollout ledger (``tasks.training.ledger``): every generation round's samples,
with TRL's own rewards and advantages, committed once the batch trained on is known.

Overrides TRL 1.16's private ``_calculate_rewards`` (its gathered rewards per function) and
``_generate_and_score_completions`` (one round: its output carries the completion ids and the advantages); the
online difficulty filter (``DynamicSamplingMixin``, before this class in the bases) runs several rounds per batch
and names the rows it keeps (``ledger_commit``). Several ranks: rank 0 gathers and keeps the rows.
Must not import: Prefect, MLflow, the stages.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from tasks.training.ledger import REWARD_PREFIX, LedgerRecorder

_REQUIRED = ("completion_ids", "completion_mask", "prompt_mask", "advantages")


class RolloutLedgerMixin:
    """Records each round's samples (``ledger``: a ``LedgerRecorder``; None records nothing)."""

    def __init__(
        self, *args: Any, ledger: LedgerRecorder | None = None, backend: str = "transformers", **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.ledger = ledger
        self.ledger_backend = backend
        self._ledger_rewards: torch.Tensor | None = None
        self._ledger_pending: list[dict[str, Any]] = []
        self._ledger_batches = 0
        self._filtering = False

    def _calculate_rewards(self, *args: Any, **kwargs: Any) -> torch.Tensor:  # noqa: D102
        rewards = super()._calculate_rewards(*args, **kwargs)
        self._ledger_rewards = rewards
        return rewards

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:  # noqa: D102
        output = super()._generate_and_score_completions(inputs)
        if self.ledger is None or not self.model.training or any(k not in output for k in _REQUIRED):
            return output
        self._ledger_pending.extend(self._round_rows(inputs, output, len(self._ledger_pending)))
        if not self._filtering:  # without the filter, a round is the batch
            self.ledger_commit(None)
        return output

    def _round_rows(self, inputs: list[dict[str, Any]], output: dict[str, Any], before: int) -> list[dict[str, Any]]:
        """This rank's rows of one round (not yet stamped with a step or a trained flag); ``before`` rows of the
        batch came in earlier rounds (groups are numbered across the batch's rounds)."""
        count = len(inputs)
        start = self.accelerator.process_index * count
        rewards = self._ledger_rewards[start : start + count].float().cpu()  # TRL gathers every rank's rewards
        weights = self.reward_weights.float().cpu()
        ids, mask = output["completion_ids"].cpu(), output["completion_mask"].cpu().bool()
        texts = self.processing_class.batch_decode(
            [row[m].tolist() for row, m in zip(ids, mask, strict=True)], skip_special_tokens=True
        )
        lengths = mask.sum(dim=1).tolist()
        eos = set(self.eos_token_ids) if getattr(self, "eos_token_ids", None) else set()
        advantages = output["advantages"].float().cpu().tolist()
        prompt_tokens = output["prompt_mask"].sum(dim=1).tolist()
        rows = []
        for i, item in enumerate(inputs):
            values = rewards[i].tolist()
            judged = [v for v in values if v == v]
            total = float((rewards[i].nan_to_num(0.0) * weights).sum()) if judged else None
            last = int(ids[i][mask[i]][-1]) if lengths[i] else None
            columns = {k: v for k, v in item.items() if k not in ("prompt", "id")}
            rows.append(
                {
                    "role": "grpo",
                    "prompt_id": str(item.get("id", "")),
                    "group": (before + i) // self.num_generations,
                    "prompt": item["prompt"] if isinstance(item["prompt"], str) else json.dumps(item["prompt"]),
                    "completion": texts[i],
                    "prompt_tokens": int(prompt_tokens[i]),
                    "completion_tokens": int(lengths[i]),
                    "clipped": bool(lengths[i] >= self.max_completion_length and last not in eos),
                    **{
                        f"{REWARD_PREFIX}{name}": (None if v != v else float(v))
                        for name, v in zip(self.reward_func_names, values, strict=True)
                    },
                    "reward_total": total,
                    "advantage": float(advantages[i]),
                    "backend": self.ledger_backend,
                    "columns": json.dumps(columns, default=str),
                }
            )
        return rows

    def ledger_commit(self, kept_rows: list[int] | None) -> None:
        """The pending rounds are one generation batch: ``kept_rows`` (indices into them, this rank's) trained,
        the rest were drawn and set aside (None: all trained). Rank 0 gathers every rank's rows."""
        if self.ledger is None:
            return
        pending, self._ledger_pending = self._ledger_pending, []
        self._ledger_batches += 1
        kept = set(range(len(pending))) if kept_rows is None else set(kept_rows)
        for index, row in enumerate(pending):
            row.update(
                step=self.state.global_step + 1,
                generation_batch=self._ledger_batches,
                trained=index in kept,
                rank=self.accelerator.process_index,
            )
        if self.accelerator.num_processes > 1:
            from accelerate.utils import gather_object

            pending = gather_object(pending)
        if self.accelerator.is_main_process:
            self.ledger.add(pending)
