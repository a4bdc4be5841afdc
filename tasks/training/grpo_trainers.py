"""How the GRPO stage's trainer is composed: TRL's ``GRPOConfig`` from the pipeline config (the run's length,
batches, sampling, engine and loss settings), the trainer class (TRL's or grpoflow's shared-prefill trainer under the
mixins every run carries: the hold-out, the difficulty filter, the rollout ledger, the vLLM sync, the sampler
agreement check), and how GRPO reaches vLLM.
Must not import: Prefect, MLflow, a stage.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

from tasks.config import GenerationSettings, PipelineConfig, changed_settings, grpo_loss_args
from tasks.layout import CHECKPOINTS
from tasks.models import pipeline_engine_spec
from tasks.speedups import speedups_on
from tasks.training.holdout import holdout_trainer_args
from tasks.training.trainer import common_trainer_args

logger = logging.getLogger(__name__)


def generation_args(settings: GenerationSettings, backend: str) -> dict[str, Any]:
    """TRL GRPOConfig arguments for the backend (``use_vllm`` and its mode, server URL, memory share).

    >>> generation_args(GenerationSettings(), "vllm")["vllm_mode"]
    'colocate'
    >>> generation_args(GenerationSettings(), "transformers")
    {'use_vllm': False}
    """
    if backend != "vllm":
        return {"use_vllm": False}
    args: dict[str, Any] = {
        "use_vllm": True,
        "vllm_mode": settings.vllm_mode,
        "vllm_gpu_memory_utilization": settings.vllm_gpu_memory_utilization,
        "vllm_tensor_parallel_size": settings.vllm_tensor_parallel_size,
    }
    if settings.vllm_mode == "server":
        args["vllm_server_base_url"] = settings.vllm_server_base_url
    return args


def vllm_setup(config: PipelineConfig, base_model_dir: Path, backend: str) -> Any:
    """How this pipeline's GRPO reaches vLLM (``tasks.speedups.vllm_colocate.VllmSetup``), or None."""
    if backend != "vllm":
        return None
    from tasks.speedups.vllm_colocate import VllmSetup

    generation = config.grpo.generation
    if generation.vllm_mode == "server":
        return VllmSetup(
            "server",
            server_url=generation.vllm_server_base_url,
            server_timeout_s=generation.vllm_server_timeout_s,
            sync_root=generation.vllm_adapter_dir,
        )
    return VllmSetup(
        "colocate", engine=pipeline_engine_spec(config, base_model_dir), sync_root=generation.vllm_adapter_dir
    )


def grpo_training_args(config: PipelineConfig, stage_dir: Path, backend: str, reward_weights: list[float]) -> Any:
    """The ``GRPOConfig`` of this pipeline's GRPO stage: the run's length, batches and sampling, the engine, and
    every loss and stability setting under its TRL name (``grpo_loss_args``); logs the loss settings it changes."""
    from trl import GRPOConfig

    settings = config.grpo
    checkpoint_steps = settings.checkpoint_steps
    if settings.select == "best" and not checkpoint_steps:  # saves at the evaluations only (transformers keeps
        checkpoint_steps = settings.max_steps + 1  # the best checkpoint with a "steps" save strategy alone)
    loss_changes = changed_settings(settings)
    logger.info(
        "GRPO loss: %s%s",
        settings.loss_type,
        "".join(f", {name} {value}" for name, value in loss_changes.items()),
    )
    if backend != "vllm" and any(name.startswith("vllm_importance") for name in loss_changes):
        logger.info("GRPO: the vLLM importance-sampling settings are not used: %s generates", backend)
    return GRPOConfig(
        **generation_args(settings.generation, backend),
        **common_trainer_args(config, stage_dir / CHECKPOINTS, checkpoint_steps),
        max_steps=settings.max_steps,
        learning_rate=settings.learning_rate,
        per_device_train_batch_size=settings.batch_size,
        num_generations=settings.num_generations,
        max_completion_length=settings.max_completion_length,
        temperature=settings.temperature,
        steps_per_generation=settings.steps_per_generation,
        **grpo_loss_args(settings),
        **holdout_trainer_args(config),
        **({"max_tool_calling_iterations": config.tools.max_turns} if config.tools.enabled else {}),
        reward_weights=reward_weights,
        logging_steps=settings.logging_steps,
        lr_scheduler_type="constant",
    )


def tool_generation(trainer_class: type, backend: str) -> str:
    """What samples a tool-using rollout's turns (TRL's tool loop calls the trainer's ``_generate_single_turn`` for
    each): vLLM, grpoflow's shared-prefill loop, or TRL's transformers generation.

    >>> tool_generation(grpo_trainer_class("off"), "transformers"), tool_generation(object, "vllm")
    ('TRL transformers generate', 'vLLM')
    """
    if backend == "vllm":
        return "vLLM"
    shared = any(cls.__name__ == "SharedPrefillGRPOTrainer" for cls in trainer_class.__mro__)
    return "grpoflow's shared-prefill loop" if shared else "TRL transformers generate"


@functools.cache
def grpo_trainer_class(speedups: str) -> type:
    """The trainer GRPO runs: TRL's ``GRPOTrainer`` with the online difficulty filter (a feature: on with either
    setting), over grpoflow's shared-prefill trainer with ``auto`` (where ``speedups_on`` allows), over TRL's own
    with ``off``.

    Either one generates through vLLM when it is given a ``vllm_setup`` (``VllmAdapterSync``: adapter-only sync).

    Every one runs a round's tool calls side by side across the batch (``ConcurrentToolCallsMixin``), keeps the
    rollout ledger (``RolloutLedgerMixin``) when it is given one, scores the hold-out slice while it trains
    (``HoldoutEvaluationMixin``) when it is given one, and compares the sampler's log-probabilities
    with its own every step (``SamplerAgreementMixin``) when it is given a tally.

    >>> [cls.__name__ for cls in grpo_trainer_class("off").__mro__[1:8]]  # doctest: +NORMALIZE_WHITESPACE
    ['HoldoutEvaluationMixin', 'SamplerAgreementMixin', 'DynamicSamplingMixin', 'RolloutLedgerMixin',
     'ConcurrentToolCallsMixin', 'VllmAdapterSync', 'GRPOTrainer']
    """
    from trl import GRPOTrainer

    from tasks.speedups.concurrent_tools import ConcurrentToolCallsMixin
    from tasks.speedups.dynamic_sampling import DynamicSamplingMixin
    from tasks.speedups.rollout_ledger import RolloutLedgerMixin
    from tasks.speedups.sampler_agreement import SamplerAgreementMixin
    from tasks.speedups.vllm_colocate import VllmAdapterSync
    from tasks.training.holdout import HoldoutEvaluationMixin

    # The agreement mixin sits above the difficulty filter: it reads the batch the loss trains on.
    mixins = (
        HoldoutEvaluationMixin,
        SamplerAgreementMixin,
        DynamicSamplingMixin,
        RolloutLedgerMixin,
        ConcurrentToolCallsMixin,
        VllmAdapterSync,
    )
    if not speedups_on(speedups):
        return type("StockGRPOTrainer", (*mixins, GRPOTrainer), {})
    from tasks.speedups.grpo_trainer import SharedPrefillGRPOTrainer

    return type("SharedPrefillGRPOTrainerWithFilter", (*mixins, SharedPrefillGRPOTrainer), {})
