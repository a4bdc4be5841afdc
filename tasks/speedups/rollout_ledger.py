"""The GRPO trainer's side of the rollout ledger (``tasks.training.ledger``): every generation round's samples,
with TRL's own rewards and advantages, committed once the batch trained on is known.

Overrides TRL 1.16's private ``_calculate_rewards`` (its gathered rewards per function) and
``_generate_and_score_completions`` (one round: its output carries the completion ids and the advantages); the
online difficulty filter (``DynamicSamplingMixin``, before this class in the bases) runs several rounds per batch
and names the rows it keeps (``ledger_commit``). Several ranks: rank 0 gathers and keeps the rows.

With tools, TRL's completions are conversations and its output carries a ``tool_mask`` (0 on the tools' answers):
each row keeps its turns, joined with the calls its rollout's environment recorded (``self.environments``, TRL's
private per-rollout instances), and counts the tokens the loss reads as ``completion_mask * tool_mask``; the round's
tool figures go to TRL's metrics (``tools/calls_per_rollout``, ``tools/error_share``, ``tools/turns_dropped``...).
Must not import: Prefect, MLflow, the stages.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from tasks.training.ledger import REWARD_PREFIX, LedgerRecorder, completion_columns

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
        self._ledger_completions: list[Any] | None = None
        self._ledger_pending: list[dict[str, Any]] = []
        self._ledger_batches = 0
        self._filtering = False

    def _calculate_rewards(self, inputs: Any, prompts: Any, completions: Any, *args: Any) -> torch.Tensor:  # noqa: D102
        rewards = super()._calculate_rewards(inputs, prompts, completions, *args)
        self._ledger_rewards = rewards
        self._ledger_completions = completions  # this rank's: text, or conversations with tool turns
        return rewards

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:  # noqa: D102
        output = super()._generate_and_score_completions(inputs)
        if self.model.training and getattr(self, "environments", None):
            self._log_tool_use(self.environments)
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
        tool_mask = output.get("tool_mask")
        trained = (mask & tool_mask.cpu().bool()).sum(dim=1).tolist() if tool_mask is not None else lengths
        environments = getattr(self, "environments", None) or [None] * count
        conversations = self._ledger_completions if tool_mask is not None else None
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
                    **(
                        self._tool_columns(conversations[i], environments[i], trained[i], lengths[i])
                        if conversations
                        else {}
                    ),
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

    @staticmethod
    def _tool_columns(completion: Any, environment: Any, trained: int, length: int) -> dict[str, Any]:
        """A tool-using rollout's conversation columns (``completion_columns``) and its token counts."""
        columns = completion_columns(completion, getattr(environment, "tool_calls", []))
        return {**columns, "trained_tokens": int(trained), "tool_tokens": int(length - trained)}

    def _log_tool_use(self, environments: list[Any]) -> None:
        """The round's tool figures, beside TRL's ``tools/call_frequency`` and ``tools/failure_frequency`` (which
        count only calls that raised): every call, failures of the program included, time, and answers dropped."""
        records = [getattr(env, "tool_calls", []) for env in environments]
        calls = [record for rollout in records for record in rollout]
        answered = [sum(1 for m in c if isinstance(m, dict) and m.get("role") == "tool") for c in self._conversations()]
        metrics = self._metrics["train"]
        metrics["tools/calls_per_rollout"].append(len(calls) / max(len(records), 1))
        metrics["tools/error_share"].append(sum(r.failed for r in calls) / len(calls) if calls else 0.0)
        metrics["tools/seconds_per_rollout"].append(sum(r.seconds for r in calls) / max(len(records), 1))
        if len(answered) == len(records):
            dropped = sum(max(len(rollout) - seen, 0) for rollout, seen in zip(records, answered, strict=True))
            metrics["tools/turns_dropped"].append(float(dropped))

    def _conversations(self) -> list[Any]:
        return [c for c in self._ledger_completions or [] if isinstance(c, list)]

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
