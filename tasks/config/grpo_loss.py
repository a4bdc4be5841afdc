"""GRPO's loss and stability settings: TRL 1.16's own ``GRPOConfig`` fields under their TRL names (passed through
unchanged, ``grpo_loss_args``), and the rules that refuse a combination TRL would fail on at trainer start, ignore,
or only warn about (``loss_setting_problems``). Which loss to pick: docs/losses.md.
Must not import: torch, transformers, TRL, Prefect, MLflow (loading a config is static)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from tasks.config.base import Strict

LossType = Literal["grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"]
CLIPPED_LOSSES = frozenset({"grpo", "dr_grpo", "dapo", "bnpo", "luspo"})  # PPO's clip with epsilon / epsilon_high
TOKEN_SUM_LOSSES = frozenset({"dapo", "bnpo", "dr_grpo", "cispo"})  # sum per-token terms: long sequences weigh more
CISPO_EPSILON_HIGH = 5.0  # TRL's (and ScaleRL's) recommended cap on CISPO's importance weights
IS_SETTINGS = (
    "vllm_importance_sampling_correction",
    "vllm_importance_sampling_mode",
    "vllm_importance_sampling_clip_min",
    "vllm_importance_sampling_clip_max",
)
# settings one loss reads and the others ignore: a value away from its default under another loss is refused
LOSS_ONLY = {
    "delta": CLIPPED_LOSSES,
    "sapo_temperature_pos": frozenset({"sapo"}),
    "sapo_temperature_neg": frozenset({"sapo"}),
    "vespo_k_pos": frozenset({"vespo"}),
    "vespo_lambda_pos": frozenset({"vespo"}),
    "vespo_k_neg": frozenset({"vespo"}),
    "vespo_lambda_neg": frozenset({"vespo"}),
}


class GRPOLossSettings(Strict):
    """The part of ``grpo`` that shapes the loss; every field is ``GRPOConfig``'s of the same name and default
    (except ``epsilon_high`` under ``cispo``: 5.0 when not given)."""

    beta: float = Field(0.0, ge=0, description="KL coefficient against the reference model (0: no reference).")
    loss_type: LossType = Field(
        "dapo",
        description="dapo (token-level, no length bias), grpo (per-sequence mean; GSPO with importance_sampling_level "
        "sequence), dr_grpo, bnpo, cispo (clipped IS weights; MiniMax-M1), sapo (soft gate), luspo (length-unbiased "
        "GSPO; needs importance_sampling_level sequence), vespo (smooth sequence-level weights). docs/losses.md.",
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group",
        description="Advantages divided by the group's std (group), the batch's (batch), or not (none: Dr. GRPO).",
    )
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = Field(
        "sum_then_normalize",
        description="Several rewards: sum the weighted rewards then normalize (TRL's default), or normalize each "
        "reward within its group first and then sum (GDPO).",
    )
    epsilon: float = Field(0.2, gt=0, description="The lower clip of the importance ratio (1 - epsilon).")
    epsilon_high: float | None = Field(
        None,
        gt=0,
        description="The upper clip (1 + epsilon_high; DAPO's clip-higher: 0.28). None: epsilon. With cispo: the cap "
        f"on the importance weights themselves, {CISPO_EPSILON_HIGH:g} when not given.",
    )
    delta: float | None = Field(
        None, gt=1, description="Two-sided clipping (INTELLECT-2): the ratio's cap; above 1 + epsilon_high."
    )
    importance_sampling_level: Literal["token", "sequence"] = Field(
        "token", description="token: one ratio per token; sequence: one per completion (GSPO with loss_type grpo)."
    )
    num_iterations: int = Field(
        1,
        ge=1,
        description="Optimizer passes over each generated batch (μ). Above 1 the old log-probs need one more "
        "forward pass over the batch per generation (docs/losses.md).",
    )
    mask_truncated_completions: bool = Field(
        False, description="Leave completions cut at max_completion_length out of the loss (DAPO)."
    )
    off_policy_mask_threshold: float | None = Field(
        None,
        gt=0,
        description="Mask negative-advantage sequences whose KL from the sampler exceeds this (DeepSeek-V3.2).",
    )
    top_entropy_quantile: float = Field(
        1.0, ge=0, le=1, description="Train only on this top share of tokens by entropy (0.2 in '80/20'); 1: all."
    )
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus coefficient (the initial one when adaptive).")
    use_adaptive_entropy: bool = Field(False, description="Skywork-OR1's adaptive entropy control.")
    entropy_target: float = Field(0.2, ge=0, description="Adaptive: the bonus applies at or below this entropy.")
    entropy_coef_min: float = Field(0.0, ge=0, description="Adaptive entropy: the coefficient's floor.")
    entropy_coef_max: float = Field(1.0, ge=0, description="Adaptive entropy: the coefficient's ceiling.")
    entropy_coef_delta: float = Field(0.005, ge=0, description="Adaptive entropy: the coefficient's step per update.")
    sapo_temperature_pos: float = Field(1.0, gt=0, description="sapo: the gate's temperature, positive advantages.")
    sapo_temperature_neg: float = Field(1.05, gt=0, description="sapo: the gate's temperature, other advantages.")
    vespo_k_pos: float = Field(2.0, gt=0, description="vespo: the weight's shape, positive advantages.")
    vespo_lambda_pos: float = Field(3.0, gt=0, description="vespo: the weight's scale, positive advantages.")
    vespo_k_neg: float = Field(3.0, gt=0, description="vespo: the weight's shape, other advantages.")
    vespo_lambda_neg: float = Field(2.0, gt=0, description="vespo: the weight's scale, other advantages.")
    vllm_importance_sampling_correction: bool = Field(
        True, description="vLLM only: correct for vLLM's and the trainer's log-prob mismatch (TRL's default)."
    )
    vllm_importance_sampling_mode: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = (
        Field(
            "sequence_mask", description="vLLM only: truncate or mask ratios outside the bounds, per token or sequence."
        )
    )
    vllm_importance_sampling_clip_min: float | None = Field(None, ge=0, description="vLLM only: C_min.")
    vllm_importance_sampling_clip_max: float | None = Field(3.0, gt=0, description="vLLM only: C_max.")

    @model_validator(mode="before")
    @classmethod
    def _cispo_caps_at_five(cls, data: Any) -> Any:
        """CISPO reads ``epsilon_high`` as its weight cap; TRL's fallback to ``epsilon`` (0.2) would clamp every
        importance weight below 1."""
        if isinstance(data, dict) and data.get("loss_type") == "cispo" and data.get("epsilon_high") is None:
            return {**data, "epsilon_high": CISPO_EPSILON_HIGH}
        return data


def grpo_loss_args(settings: GRPOLossSettings) -> dict[str, Any]:
    """The ``GRPOConfig`` arguments of these settings: every field, under its own name.

    >>> grpo_loss_args(GRPOLossSettings(loss_type="grpo", importance_sampling_level="sequence"))["loss_type"]
    'grpo'
    >>> grpo_loss_args(GRPOLossSettings(loss_type="cispo"))["epsilon_high"]
    5.0
    """
    return {name: getattr(settings, name) for name in GRPOLossSettings.model_fields}


def changed_settings(settings: GRPOLossSettings) -> dict[str, Any]:
    """The loss settings away from their defaults (for the model card and the run's log).

    >>> changed_settings(GRPOLossSettings(epsilon_high=0.28))
    {'epsilon_high': 0.28}
    """
    default = GRPOLossSettings(loss_type=settings.loss_type)  # cispo's own epsilon_high is its default
    return {
        name: getattr(settings, name)
        for name in GRPOLossSettings.model_fields
        if name != "loss_type" and getattr(settings, name) != getattr(default, name)
    }


def loss_setting_problems(settings: GRPOLossSettings, may_use_vllm: bool) -> list[str]:
    """Why these settings would fail at trainer start, be ignored, or train something other than they say; empty
    when none. ``may_use_vllm``: the generation backend is not pinned to transformers.

    >>> loss_setting_problems(GRPOLossSettings(loss_type="luspo"), may_use_vllm=False)[0][:58]
    'loss_type luspo is sequence-level: it needs importance_sam'
    >>> loss_setting_problems(GRPOLossSettings(loss_type="grpo", importance_sampling_level="sequence"), False)
    []
    """
    problems = []
    loss, level = settings.loss_type, settings.importance_sampling_level
    if loss == "luspo" and level != "sequence":
        problems.append(
            "loss_type luspo is sequence-level: it needs importance_sampling_level: sequence (TRL only warns; its "
            "paper's objective is not what token-level ratios train)"
        )
    if level == "sequence" and loss in TOKEN_SUM_LOSSES:
        problems.append(
            f"importance_sampling_level sequence with loss_type {loss} weights each completion by its length, which is "
            "not GSPO (TRL only warns): GSPO is loss_type: grpo with importance_sampling_level: sequence"
        )
    if loss == "vespo" and level != "token":
        problems.append(
            "loss_type vespo computes its own sequence-level weights: keep importance_sampling_level: token"
        )
    if loss == "cispo" and settings.epsilon_high is not None and settings.epsilon_high <= 1:
        problems.append(
            f"loss_type cispo reads epsilon_high as the cap on its importance weights (ε_max, {CISPO_EPSILON_HIGH:g} "
            f"recommended); {settings.epsilon_high:g} would cap every weight below 1"
        )
    upper = 1 + (settings.epsilon_high if settings.epsilon_high is not None else settings.epsilon)
    if settings.delta is not None and loss in CLIPPED_LOSSES and settings.delta <= upper:
        problems.append(f"delta ({settings.delta:g}) must exceed 1 + epsilon_high ({upper:g}), or it cuts the clip")
    defaults = GRPOLossSettings()
    for name, losses in LOSS_ONLY.items():
        if loss not in losses and getattr(settings, name) != getattr(defaults, name):
            problems.append(f"{name} applies to loss_type {'/'.join(sorted(losses))} only, not {loss}: remove it")
    problems += _importance_sampling_problems(settings, may_use_vllm)
    if settings.use_adaptive_entropy and settings.entropy_coef_min > settings.entropy_coef_max:
        problems.append(
            f"entropy_coef_min ({settings.entropy_coef_min:g}) exceeds entropy_coef_max ({settings.entropy_coef_max:g})"
        )
    return problems


def _importance_sampling_problems(settings: GRPOLossSettings, may_use_vllm: bool) -> list[str]:
    """The vLLM importance-sampling correction's rules: set away from its defaults without vLLM it is ignored;
    TRL refuses bounds in the wrong order, a truncation without bounds, and vespo with a sequence-level mode."""
    defaults = GRPOLossSettings()
    changed = [name for name in IS_SETTINGS if getattr(settings, name) != getattr(defaults, name)]
    if not may_use_vllm:
        ignored = "the vLLM correction applies only when vLLM generates (generation.backend is transformers)"
        return [f"{', '.join(changed)}: {ignored}"] if changed else []
    if not settings.vllm_importance_sampling_correction:
        return []
    low, high = settings.vllm_importance_sampling_clip_min, settings.vllm_importance_sampling_clip_max
    mode = settings.vllm_importance_sampling_mode
    problems = []
    if low is not None and high is not None and low >= high:
        problems.append(
            f"vllm_importance_sampling_clip_min ({low:g}) must be below vllm_importance_sampling_clip_max ({high:g})"
        )
    if mode.endswith("_truncate") and low is None and high is None:
        problems.append(f"vllm_importance_sampling_mode {mode} needs vllm_importance_sampling_clip_min or _clip_max")
    if settings.loss_type == "vespo" and not mode.startswith("token_"):
        problems.append(
            f"loss_type vespo with vLLM needs a token-level vllm_importance_sampling_mode (token_truncate or "
            f"token_mask; TRL fails at trainer start on {mode}), or vllm_importance_sampling_correction: false"
        )
    return problems
