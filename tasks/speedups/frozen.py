"""Frozen base weights of LoRA layers stored in the compute dtype (PEFT's ``base_layer`` internal).
Must not import: Prefect, MLflow, the stages."""

from __future__ import annotations

from typing import Any

import torch

from tasks.precision import resolve_dtype


def store_frozen_in(model: Any, precision: str) -> int:
    """Store the frozen weights of ``model``'s LoRA base layers in the compute dtype when it is bf16; returns
    how many. Under autocast every matrix product casts its weight to bf16 on each call; stored in bf16 the cast
    is gone and the products are bit-identical. Embeddings, norms and the adapters keep fp32.
    """
    from peft.tuners.lora import LoraLayer

    dtype = resolve_dtype(precision)
    if dtype == torch.float32:
        return 0
    count = 0
    for module in model.modules():
        if isinstance(module, LoraLayer):
            weight = module.base_layer.weight
            if not weight.requires_grad and weight.dtype != dtype:
                weight.data = weight.data.to(dtype)
                count += 1
    return count
