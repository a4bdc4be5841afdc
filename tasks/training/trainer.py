"""What SFT and GRPO share: trainer arguments common to both, LoRA settings, checkpoints, and the callbacks that
record the trainers' metrics (in the stage result, and in the stage's MLflow run).
Must not import: Prefect, the stages."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import ProgressCallback

from tasks.config import PipelineConfig
from tasks.models import resolve_dtype
from tasks.tracking.progress import SHOWN_ON_THE_BAR, console_is_quiet

logger = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """What a training stage hands on: the adapter folder, and what it logged."""

    adapter_dir: Path
    steps: int
    seconds: float
    history: list[dict[str, float]] = field(default_factory=list)
    stop: dict[str, Any] | None = None  # GRPO's early-stop verdict (tasks.training.learning_signal.StopVerdict), if any
    generated_by: str | None = None  # GRPO: what generated its samples (GenerationRecord.describe)
    selection: dict[str, Any] | None = None  # GRPO: which step's adapter went on, and why (holdout.Selection)
    holdout_seconds: float = 0.0  # GRPO: time spent in the in-training hold-out evaluation

    def last(self, key: str) -> float | None:
        """The last logged value of ``key``, if any."""
        for entry in reversed(self.history):
            if key in entry:
                return entry[key]
        return None


class MetricsHistory(TrainerCallback):
    """Keeps every ``on_log`` payload with its step, so the stage result carries the trainer's own metrics."""

    def __init__(self) -> None:
        self.history: list[dict[str, float]] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        numbers = {k: float(v) for k, v in (logs or {}).items() if isinstance(v, int | float)}
        self.history.append({"step": float(state.global_step), **numbers})


class MlflowTrainerCallback(TrainerCallback):
    """Logs every number a TRL trainer logs, at its global step, to the stage's MLflow run."""

    def __init__(self, stage: Any) -> None:
        self.stage = stage  # a tasks.tracking.runs.StageRun

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        numbers = {k.replace("/", "_") if k.startswith("train_") else k: v for k, v in (logs or {}).items()}
        self.stage.log_metrics(
            {k: float(v) for k, v in numbers.items() if isinstance(v, int | float)}, step=state.global_step
        )
        shown = [f"{key} {numbers[key]:.4g}" for key in PROGRESS_KEYS if isinstance(numbers.get(key), int | float)]
        if shown:  # the run log (Prefect UI) shows training as it goes
            total = getattr(state, "max_steps", 0)  # a replayed history's state carries the step only
            logger.info(
                "%s step %d/%d: %s",
                self.stage.stage,
                state.global_step,
                total,
                ", ".join(shown),
                extra={SHOWN_ON_THE_BAR: True},
            )


# What a person watching the run log wants of each logged step (the rest is in MLflow).
PROGRESS_KEYS = (
    "loss",
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "entropy",
    "mean_token_accuracy",
    "train_loss",
    "eval_holdout_pass_at_1",
    "eval_holdout_greedy_accuracy",
    "eval_holdout_reward",
)


def lora_config(config: PipelineConfig) -> Any:
    from peft import LoraConfig

    return LoraConfig(
        r=config.lora.r,
        lora_alpha=config.lora.alpha,
        lora_dropout=config.lora.dropout,
        target_modules=config.lora.target_modules,
        task_type="CAUSAL_LM",
    )


def common_trainer_args(config: PipelineConfig, output_dir: Path, checkpoint_steps: int = 0) -> dict[str, Any]:
    """Arguments both TRL configs take. Weights carry the precision (bf16 weights are where the speed is),
        so the trainers' autocast stays off; gradient checkpointing is off (it costs more than it saves on small
    models: docs/measurements/performance.md)."""
    on_gpu = torch.cuda.is_available()
    return {
        "output_dir": str(output_dir),
        "use_cpu": not on_gpu,
        "bf16": resolve_dtype(config.model.precision) == torch.bfloat16,
        "fp16": False,
        "gradient_checkpointing": False,
        "report_to": "none",
        "save_strategy": "steps" if checkpoint_steps else "no",
        "save_steps": checkpoint_steps or 500,
        "save_total_limit": config.orchestration.keep_checkpoints,  # the mirror keeps as many (remote_checkpoints)
        "seed": config.seed,
        "data_seed": config.seed,
        "disable_tqdm": False,
        "dataloader_num_workers": 0,
        "ddp_find_unused_parameters": False,  # on N processes: every LoRA weight takes part in every step
        # A peer whose link is gone leaves the others in a collective until this; the stage bounds it too
        **({"ddp_timeout": round(timeout)} if (timeout := config.orchestration.collective_timeout_s) else {}),
    }


class CorruptCheckpoint(ValueError):
    """A checkpoint folder that cannot be resumed from."""


def check_checkpoint(path: Path) -> None:
    """Raise CorruptCheckpoint unless ``path`` holds a readable trainer state, weights and optimizer state."""
    import json

    from safetensors import safe_open

    try:
        state = json.loads((path / "trainer_state.json").read_text())
        if not isinstance(state.get("global_step"), int):
            raise CorruptCheckpoint("trainer_state.json has no global_step")
        weights = next(iter(sorted(path.glob("*.safetensors"))), None)
        if weights is None:
            raise CorruptCheckpoint("no weights (*.safetensors)")
        with safe_open(str(weights), framework="pt") as handle:
            list(handle.keys())
        if not (path / "optimizer.pt").is_file() or (path / "optimizer.pt").stat().st_size == 0:
            raise CorruptCheckpoint("no optimizer state")
    except CorruptCheckpoint:
        raise
    except Exception as exc:
        raise CorruptCheckpoint(f"{type(exc).__name__}: {exc}") from exc


def resumable_checkpoint(checkpoints_dir: Path) -> Path | None:
    """The newest checkpoint under ``checkpoints_dir`` that can be resumed from. A corrupt one is set aside in
    ``checkpoints/corrupt/`` (kept as evidence; the trainer's rotation deletes only ``checkpoint-*`` beside it) and
    the one before it is tried; when none is left, training starts from scratch, and the log says which."""
    import logging

    logger = logging.getLogger(__name__)
    found = sorted(
        (p for p in checkpoints_dir.glob("checkpoint-*") if p.is_dir() and p.name.split("-")[-1].isdigit()),
        key=lambda p: int(p.name.split("-")[-1]),
        reverse=True,
    )
    for index, path in enumerate(found):
        try:
            check_checkpoint(path)
        except CorruptCheckpoint as exc:
            aside = checkpoints_dir / "corrupt" / path.name
            aside.parent.mkdir(exist_ok=True)
            if aside.exists():
                aside = aside.with_name(f"{path.name}-{time.strftime('%Y%m%d-%H%M%S')}")
            path.rename(aside)
            then = f"trying {found[index + 1].name}" if index + 1 < len(found) else "starting from scratch"
            logger.warning("checkpoint %s is corrupt (%s); set aside as %s; %s", path.name, exc, aside, then)
            continue
        logger.info("resuming from %s", path)
        return path
    return None


def checkpoint_history(checkpoint: Path) -> list[dict[str, float]]:
    """What the trainer logged up to ``checkpoint`` (its ``trainer_state.json``), one entry per logged step."""
    import json

    state = json.loads((checkpoint / "trainer_state.json").read_text())
    return [
        {k: float(v) for k, v in entry.items() if isinstance(v, int | float)}
        for entry in state.get("log_history", [])
        if "step" in entry
    ]


def replay_history(checkpoint: Path | None, callbacks: Sequence[Any]) -> None:
    """Hand the metrics logged before ``checkpoint`` to the callbacks (the stage result's history, the stage's
    MLflow run), so a resumed stage shows its whole loss curve, also when no step was left to train."""
    if checkpoint is None:
        return
    for callback in callbacks:
        if isinstance(callback, MlflowTrainerCallback):
            callback.stage.log_metrics({"resumed_from_step": checkpoint_step(checkpoint)})
    for entry in checkpoint_history(checkpoint):
        state = SimpleNamespace(global_step=int(entry["step"]))
        logs = {k: v for k, v in entry.items() if k != "step"}
        for callback in callbacks:
            if isinstance(callback, MetricsHistory | MlflowTrainerCallback) or getattr(callback, "replays_history", 0):
                callback.on_log(None, state, None, logs=logs)


def checkpoint_step(checkpoint: Path) -> int:
    return int(checkpoint.name.split("-")[-1])


class StepProgress(ProgressCallback):
    """transformers' training bar (steps, rate, time left) with the loss and the reward on it, instead of a raw
    dict of every metric printed at each step (those go to MLflow and the Prefect log)."""

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if state.is_world_process_zero and self.training_bar is not None and logs:
            shown = {k: f"{logs[k]:.3g}" for k in ("loss", "reward") if isinstance(logs.get(k), int | float)}
            if shown:
                self.training_bar.set_postfix(shown, refresh=False)


def train_and_save(trainer: Any, resume_from: Path | None, max_steps: int, adapter_dir: Path) -> int:
    """Train what is left from ``resume_from`` and save the adapter; returns the steps trained in all. A
    checkpoint at ``max_steps`` (a kill after the last step) is the result itself: its adapter is taken as is
    (resuming from it would train a step past ``max_steps``). The adapter folder is replaced whole or not at all."""
    import shutil

    from tasks.layout import publish_dir
    from tasks.tracking import bar_safe_console

    # One readable bar (PrinterCallback: no bar, kept); none under `grpoflow --quiet`.
    if trainer.pop_callback(ProgressCallback) is not None and not console_is_quiet():
        trainer.add_callback(StepProgress())
    staging = adapter_dir.with_name(f".{adapter_dir.name}.staging")
    writes = trainer.is_world_process_zero()  # on N processes, rank 0 alone writes the adapter
    if writes:
        shutil.rmtree(staging, ignore_errors=True)
    if resume_from is not None and checkpoint_step(resume_from) >= max_steps:
        if writes:
            staging.mkdir(parents=True)
            for name in ("adapter_config.json", "adapter_model.safetensors"):
                shutil.copy2(resume_from / name, staging / name)
        steps = checkpoint_step(resume_from)
    else:
        if resume_from is not None:
            from tasks.speedups.cpu_resume import plain_cpu_device

            plain_cpu_device(trainer.args)  # several CPU processes: the optimizer loads onto "cpu", not "cpu:0"
        with bar_safe_console():  # log lines above the training bar, not through it
            trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
        trainer.save_model(str(staging))  # every rank calls it (ZeRO-3 gathers the weights); rank 0 writes
        steps = trainer.state.global_step
    if writes:
        publish_dir(staging, adapter_dir)
    return steps
