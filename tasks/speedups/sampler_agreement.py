"""GRPO's sampler–trainer agreement, measured every step on every engine (TRL's private ``_generate_and_score_
completions``, ``_compute_loss``, ``_get_per_token_logps_and_entropies`` and ``log``).

The sampler hands TRL each sampled token's log-probability (vLLM's ``processed_logprobs``; grpoflow's transformers
loop from the logits it drew from). The trainer computes its own log-probabilities of the same tokens anyway: right
after sampling where TRL needs them (``old_per_token_logps``: vLLM's importance sampling, off-policy steps), else in
the loss's forward pass, which then runs on the very weights that sampled (one generation per optimizer step, one
iteration). The mean and max |difference| over the tokens the loss reads go to ``SamplerAgreement`` (a tally the
stage's guard reads at each step's end) and into the logged metrics ``sampler/logp_difference/{mean,max}``: no
extra forward pass. Must not import: Prefect, MLflow, the stages.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from tasks.speedups.dynamic_sampling import loss_tokens
from tasks.training.agreement import SamplerAgreement

logger = logging.getLogger(__name__)


def logp_differences(trainer: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """|trainer − sampler| per token the loss reads (``mask`` 1), leaving out tokens the sampler could not score
    (NaN: vLLM returns None for a few).

    >>> logp_differences(torch.tensor([[-1.0, -2.0, -3.0]]), torch.tensor([[-1.5, float("nan"), 0.0]]),
    ...                  torch.tensor([[1, 1, 0]])).tolist()
    [0.5]
    """
    delta = (trainer.float() - sampler.float()).abs()
    return delta[mask.bool() & ~torch.isnan(delta)]


class SamplerAgreementMixin:
    """Trainer mixin: the sampler's log-probabilities against the trainer's, on every generation batch, into the
    ``sampler_agreement`` tally handed in (nothing without one)."""

    def __init__(self, *args: Any, sampler_agreement: SamplerAgreement | None = None, **kwargs: Any) -> None:
        self.sampler_agreement = sampler_agreement
        self._agreement_inputs: dict[str, Any] | None = None
        super().__init__(*args, **kwargs)

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        output = super()._generate_and_score_completions(inputs)
        if self.sampler_agreement is None or not self.model.training:
            return output
        sampled = output.get("sampling_per_token_logps")
        if sampled is None:
            self.sampler_agreement.unavailable(
                "the sampler returns no log-probabilities (TRL's own transformers generation, which samples the "
                "trained model itself, or transformers' generate for settings grpoflow's loop does not implement)"
            )
        elif "old_per_token_logps" in output:  # TRL scored the batch right after sampling, with the same weights
            self._record(output["old_per_token_logps"], sampled, loss_tokens(output))
        return output

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> Any:
        # Without old_per_token_logps, the loss's own forward pass runs on the weights that sampled the batch.
        pending = self.sampler_agreement is not None and "sampling_per_token_logps" in inputs
        self._agreement_inputs = inputs if pending and "old_per_token_logps" not in inputs else None
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._agreement_inputs = None

    def _get_per_token_logps_and_entropies(self, model: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
        result = super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        inputs, self._agreement_inputs = self._agreement_inputs, None  # the policy's pass: the loss's first
        if inputs is not None:
            self._record(result[0].detach(), inputs["sampling_per_token_logps"], loss_tokens(inputs))
        return result

    def _record(self, trainer: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor) -> None:
        """Add one batch's differences to the tally, summed over every rank (each rank records alike)."""
        assert self.sampler_agreement is not None
        delta = logp_differences(trainer, sampler, mask)
        local = torch.tensor(
            [float(delta.sum()), float(delta.numel()), float(delta.max()) if delta.numel() else 0.0],
            device=trainer.device,
        )
        gathered = self.accelerator.gather(local[None]).view(-1, 3)
        self.sampler_agreement.add(
            float(gathered[:, 0].sum()),
            int(gathered[:, 1].sum()),
            float(gathered[:, 2].max()),
            step=self.state.global_step + 1,  # the step this batch trains (1-based, as on_step_end sees it)
        )

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if self.sampler_agreement is not None and "loss" in logs:  # a training log: the steps since the last
            logs.update(self.sampler_agreement.window())
        super().log(logs, *args, **kwargs)
