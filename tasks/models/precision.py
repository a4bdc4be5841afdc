"""Compute precision and device: which dtype the matrix products run in, where, and with which attention.

Must not import: Prefect, MLflow, PEFT, TRL.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)


def bf16_supported() -> bool:
    """Whether this machine multiplies bf16 natively (CUDA bf16, or a CPU with AVX-512 BF16 or AMX)."""
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    from tasks.speedups import cpu_has_native_bf16

    return cpu_has_native_bf16()


def resolve_dtype(precision: str) -> torch.dtype:
    """The compute dtype for a config precision; ``auto`` picks bf16 where the hardware multiplies it natively.

    The trained weights (LoRA adapters) stay fp32, the master copy the optimizer updates; bf16 means bf16
    autocast for the matrix products, with the frozen base weights stored in bf16 (``speedups.frozen``), which
    autocast would cast to bf16 on every product anyway.

    >>> resolve_dtype("fp32")
    torch.float32
    """
    if precision == "fp32":
        return torch.float32
    if precision == "bf16":
        return torch.bfloat16
    return _auto_dtype()


@functools.cache
def _auto_dtype() -> torch.dtype:
    """``auto``'s choice, made (and said) once per process: it is asked on every generation batch."""
    chosen = torch.bfloat16 if bf16_supported() else torch.float32
    logger.info("precision auto → %s", "bf16 autocast" if chosen == torch.bfloat16 else "fp32 (no native bf16)")
    return chosen


def resolved_precision(precision: str) -> str:
    """A precision setting as it runs on this machine: ``bf16`` or ``fp32`` (``auto`` chosen here).

    >>> resolved_precision("fp32")
    'fp32'
    """
    return "bf16" if resolve_dtype(precision) == torch.bfloat16 else "fp32"


def merge_is_exact(precision: str) -> bool:
    """Whether folding a LoRA adapter into the weights keeps it, at this precision: in fp32, yes (to fp32's
    rounding); in bf16, no — the delta sits below bf16's resolution of the weight it is added to, so inference
    keeps it apart (``tasks.speedups.low_rank``), as training and vLLM do.

    >>> merge_is_exact("fp32"), merge_is_exact("bf16")
    (True, False)
    """
    return resolve_dtype(precision) == torch.float32


def compute_autocast(precision: str) -> Any:
    """A bf16 autocast context for inference when the precision resolves to bf16, else a no-op context."""
    enabled = resolve_dtype(precision) == torch.bfloat16
    return torch.autocast(device_type=device().type, dtype=torch.bfloat16, enabled=enabled)


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast casts matrix products to on ``device_type`` right now (None when it is off).

    >>> autocast_dtype("cpu") is None
    True
    """
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def attention_implementation() -> str:
    """Eager attention on CPU, transformers' default (SDPA) on GPU: on CPU, PyTorch's SDPA kernel measured
    slower than eager attention at GRPO's sizes (docs/measurements/performance.md)."""
    return "sdpa" if torch.cuda.is_available() else "eager"
