"""GRPO's sampler where merging would round (bf16): a plain model over the trainer's own LoRA policy, the adapter
kept apart from the weights as the trainer computes it (PEFT layer internals: ``base_layer``, ``lora_A``/``lora_B``,
``scaling``, ``modules_to_save``).

Why not merged: a LoRA delta sits below bf16's resolution of the weight it adapts, so ``W + B·A`` rounded to bf16
is a different policy from the one the trainer scores (measured on the demo: the GRPO adapter sampled merged scored
36.0 % pass@1, shipped apart 33.2 %: docs/engines.md). Here every frozen linear layer is packed once in bf16
(``PackedLinear``: the trainer stores those weights in bf16 too, ``speedups.frozen``), and each LoRA layer is
``LowRankLinear(packed base, the trainer's own lora_A, lora_B)``: the adapter's matrices are shared, not copied, so
the view always samples the weights of the last optimizer step with nothing to refresh. Embeddings, norms and
rotary buffers are the trainer's modules too (fp32), and sampling runs under bf16 autocast, as the trainer's
forward does. Must not import: Prefect, MLflow, the stages.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from tasks.speedups.low_rank import LowRankLinear, plain_lora
from tasks.speedups.packing import PackedLinear, packing_available

logger = logging.getLogger(__name__)


class UnmergedView:
    """A plain model (no PEFT wrappers) whose modules are the trainer's own, with each LoRA layer as
    ``LowRankLinear`` over a packed base; built once, never refreshed (the adapter is shared).

    ``refresh()`` returns the model, as ``MergedCopy.refresh`` does, so the trainer treats both alike.
    Raises ``ValueError`` when some LoRA layer is not plain LoRA (DoRA, fan-in-fan-out, several adapters): the
    caller samples from the PEFT model itself then.
    """

    def __init__(self, policy: Any, dtype: torch.dtype) -> None:
        from peft.tuners.lora import LoraLayer

        self.dtype = dtype
        base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
        trained = dict(base.named_modules())
        self.model = _meta_skeleton(base)
        pack = packing_available(dtype)
        shared: list[str] = []  # modules now the trainer's own: nothing inside them is replaced
        for name, module in list(self.model.named_modules()):
            if not name or name not in trained or any(name.startswith(f"{s}.") for s in shared):
                continue
            source = trained[name]
            if isinstance(source, LoraLayer):
                adapter = plain_lora(source)
                if adapter is None:
                    raise ValueError(f"{name} is not a plain LoRA layer")
                layer = LowRankLinear(
                    _frozen_linear(source.base_layer, dtype, pack),
                    source.lora_A[adapter],
                    source.lora_B[adapter],
                    float(source.scaling[adapter]),
                )
                _replace(self.model, name, layer)
            elif hasattr(source, "modules_to_save"):  # PEFT's ModulesToSaveWrapper: its trained copy, live
                _replace(self.model, name, source.modules_to_save[source.active_adapter])
            elif type(module) is torch.nn.Linear and not source.weight.requires_grad:
                _replace(self.model, name, _frozen_linear(source, dtype, pack))
            elif _holds_tensors(module):
                _replace(self.model, name, source)  # embeddings, norms, rotary buffers: the trainer's own
            else:
                continue
            shared.append(name)
        leftover = [n for n, t in [*self.model.named_parameters(), *self.model.named_buffers()] if t.is_meta]
        if leftover:
            raise ValueError(f"no trained tensor for {leftover[0]}")
        self.model.generation_config = base.generation_config
        self.model.eval()

    def refresh(self) -> Any:
        """The model: it shares the adapter's live matrices, so there is nothing to copy."""
        return self.model


def _meta_skeleton(base: Any) -> Any:
    """A plain model of ``base``'s config on the meta device (no memory): every tensor-holding module is replaced
    by the trainer's own or a packed layer before use."""
    from transformers import AutoModelForCausalLM

    from tasks.models import attention_implementation

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(
            base.config, dtype=torch.float32, attn_implementation=attention_implementation()
        )


def _frozen_linear(linear: torch.nn.Linear, dtype: torch.dtype, pack: bool) -> torch.nn.Module:
    """A frozen linear layer for sampling: packed once in ``dtype`` where packing works, else the layer itself
    (autocast casts its weight at each product, as in the trainer)."""
    return PackedLinear(linear.weight, linear.bias, dtype) if pack else linear


def _holds_tensors(module: torch.nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False))


def _replace(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent_name, _, attribute = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attribute, module)
