"""Frozen base weights of LoRA layers stored in the compute dtype (PEFT's ``base_layer`` internal).
Must not import: Prefect, MLflow, the stages."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from tasks.models import resolve_dtype


def _frozen_weights(model: Any) -> Iterator[Any]:
    from peft.tuners.lora import LoraLayer

    for module in model.modules():
        if isinstance(module, LoraLayer) and not module.base_layer.weight.requires_grad:
            yield module.base_layer.weight


def store_frozen_in(model: Any, precision: str) -> int:
    """Store the frozen weights of ``model``'s LoRA base layers in the compute dtype when it is bf16; returns
    how many. Under autocast every matrix product casts its weight to bf16 on each call; stored in bf16 the cast
    is gone and the products are bit-identical. Embeddings, norms and the adapters keep fp32.
    """
    dtype = resolve_dtype(precision)
    if dtype == torch.float32:
        return 0
    count = 0
    for weight in _frozen_weights(model):
        if weight.dtype != dtype:
            weight.data = weight.data.to(dtype)
            count += 1
    return count


@contextmanager
def frozen_in_fp32(model: Any) -> Iterator[None]:
    """The frozen LoRA base weights in fp32 for the duration, then in their stored dtype again. A bf16 value is
    exact in fp32, so nothing changes but the precision of what runs inside (a check against the stock path)."""
    upcast = [(weight, weight.dtype) for weight in _frozen_weights(model) if weight.dtype != torch.float32]
    for weight, _ in upcast:
        weight.data = weight.data.float()
    try:
        yield
    finally:
        for weight, dtype in upcast:
            weight.data = weight.data.to(dtype)
