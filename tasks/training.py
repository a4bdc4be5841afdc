"""What SFT and GRPO share: trainer arguments common to both, LoRA settings, and a metrics recorder."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from tasks.config import PipelineConfig
from tasks.models import resolve_dtype


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
        self.started = time.perf_counter()

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        numbers = {k: float(v) for k, v in (logs or {}).items() if isinstance(v, int | float)}
        self.history.append({"step": float(state.global_step), **numbers})


def lora_config(config: PipelineConfig) -> Any:
    from peft import LoraConfig

    return LoraConfig(
        r=config.lora.r,
        lora_alpha=config.lora.alpha,
        lora_dropout=config.lora.dropout,
        target_modules=config.lora.target_modules,
        task_type="CAUSAL_LM",
    )


def common_trainer_args(config: PipelineConfig, output_dir: Path) -> dict[str, Any]:
    """Arguments both TRL configs take. Weights carry the precision (bf16 weights are where the speed is),
    so the trainers' autocast stays off; gradient checkpointing costs ~25 % on small models and is off."""
    on_gpu = torch.cuda.is_available()
    return {
        "output_dir": str(output_dir),
        "use_cpu": not on_gpu,
        "bf16": resolve_dtype(config.model.precision) == torch.bfloat16,
        "fp16": False,
        "gradient_checkpointing": False,
        "report_to": "none",
        "save_strategy": "no",
        "seed": config.seed,
        "data_seed": config.seed,
        "disable_tqdm": False,
        "dataloader_num_workers": 0,
    }
