"""What SFT and GRPO share: trainer arguments common to both, LoRA settings, checkpoints, and the callbacks that
record the trainers' metrics (in the stage result, and in the stage's MLflow run).
Must not import: Prefect, the stages."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from tasks.config import PipelineConfig
from tasks.precision import resolve_dtype


@dataclass
class TrainResult:
    """What a training stage hands on: the adapter folder, and what it logged."""

    adapter_dir: Path
    steps: int
    seconds: float
    history: list[dict[str, float]] = field(default_factory=list)

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
        self.stage = stage  # a tasks.runs.StageRun

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        numbers = {k.replace("/", "_") if k.startswith("train_") else k: v for k, v in (logs or {}).items()}
        self.stage.log_metrics(
            {k: float(v) for k, v in numbers.items() if isinstance(v, int | float)}, step=state.global_step
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
models, README, Performance)."""
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
        "save_total_limit": 2,  # the latest, and the one before it in case the latest is corrupt
        "seed": config.seed,
        "data_seed": config.seed,
        "disable_tqdm": False,
        "dataloader_num_workers": 0,
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
    """The newest checkpoint under ``checkpoints_dir`` that can be resumed from. A corrupt one is renamed
    ``*.corrupt`` and the previous one is used instead, with a warning that says so."""
    import logging

    logger = logging.getLogger(__name__)
    found = sorted(
        (p for p in checkpoints_dir.glob("checkpoint-*") if p.is_dir() and p.name.split("-")[-1].isdigit()),
        key=lambda p: int(p.name.split("-")[-1]),
        reverse=True,
    )
    for path in found:
        try:
            check_checkpoint(path)
        except CorruptCheckpoint as exc:
            logger.warning("checkpoint %s is corrupt (%s); falling back to the previous one", path, exc)
            path.rename(path.with_name(path.name + ".corrupt"))
            continue
        logger.info("resuming from %s", path)
        return path
    return None
