"""A LoRA policy for inference as a plain model whose adapted layers keep the adapter apart from the weight
(``LowRankLinear``: ``base(x) + lora_b(lora_a(x)) · scale``), built from PEFT's layer internals (``base_layer``,
``lora_A``/``lora_B``, ``scaling``, ``use_dora``, ``fan_in_fan_out``).

Why apart: a LoRA delta is small beside the weight it adapts (the demo's SFT adapter: 0.16 % of the weights' norm),
below bf16's resolution (2⁻⁸ of a weight). Folded into the weight and rounded to bf16, it turns into rounding
noise about as large as itself, and the model scored is not the model trained (the trainer, PEFT under bf16
autocast, and vLLM's LoRA kernels keep it apart). Kept apart, every product is PEFT's under autocast: the same
model the trainer scores, without PEFT's per-call wrapper overhead, and its plain ``nn.Linear`` parts are what
``packing`` packs. The public path is PEFT's own unmerged model (``plain_unmerged`` returns None where a layer
is not plain LoRA).
Must not import: Prefect, MLflow, the stages.
"""

from __future__ import annotations

from typing import Any

import torch


class LowRankLinear(torch.nn.Module):
    """``base(x) + lora_b(lora_a(x)) · scale``: a linear layer with its LoRA adapter kept apart, as PEFT computes
    an unmerged LoRA layer (dropout is off at inference).

    >>> a, b = torch.nn.Linear(4, 2, bias=False), torch.nn.Linear(2, 3, bias=False)
    >>> layer = LowRankLinear(torch.nn.Linear(4, 3), a, b, 2.0)
    >>> x = torch.ones(1, 4)
    >>> torch.allclose(layer(x), layer.base(x) + 2.0 * layer.lora_b(layer.lora_a(x)))
    True
    """

    def __init__(self, base: torch.nn.Module, lora_a: torch.nn.Module, lora_b: torch.nn.Module, scale: float) -> None:
        super().__init__()
        self.base, self.lora_a, self.lora_b, self.scale = base, lora_a, lora_b, scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base(x)
        return (result + self.lora_b(self.lora_a(x)) * self.scale).to(result.dtype)


def plain_lora(module: Any) -> str | None:
    """The one active adapter of a PEFT LoRA layer when it is plain LoRA (a linear base, no DoRA, no
    fan-in-fan-out), else None."""
    adapters = [a for a in getattr(module, "active_adapters", []) if a in getattr(module, "lora_A", {})]
    if len(adapters) != 1 or not isinstance(module.base_layer, torch.nn.Linear):
        return None
    adapter = adapters[0]
    if getattr(module, "fan_in_fan_out", False) or module.use_dora.get(adapter, False):
        return None
    return adapter


def plain_unmerged(policy: Any) -> Any | None:
    """The base model of a PEFT LoRA ``policy`` with every LoRA layer replaced by a ``LowRankLinear`` (the same
    weights, shared, not copied), in eval mode; None, and ``policy`` untouched, when some layer is not plain
    LoRA (the caller keeps PEFT's own model)."""
    from peft.tuners.lora import LoraLayer

    base = policy.get_base_model()
    layers = [(name, module) for name, module in base.named_modules() if isinstance(module, LoraLayer)]
    adapters = [plain_lora(module) for _, module in layers]
    if not layers or None in adapters:
        return None
    for (name, module), adapter in zip(layers, adapters, strict=True):
        parent_name, _, attribute = name.rpartition(".")
        parent = base.get_submodule(parent_name) if parent_name else base
        low_rank = LowRankLinear(
            module.base_layer, module.lora_A[adapter], module.lora_B[adapter], float(module.scaling[adapter])
        )
        setattr(parent, attribute, low_rank)
    return base.eval()
