"""A plain copy of a LoRA policy with the deltas folded in, for GRPO's sampling on CPU (PEFT layer internals:
``base_layer``, ``lora_A``/``lora_B``, ``scaling``; PEFT's own ``get_delta_weight`` for the general case).
Must not import: Prefect, MLflow, the stages."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from tasks.models import attention_implementation
from tasks.speedups.packing import PackedLinear, pack_linears


class MergedCopy:
    """A plain model (no PEFT wrappers) holding a LoRA policy's current weights with the deltas folded in, in
    ``dtype``, for generation: it runs without the per-layer adapter overhead, and the trainer's own weights
    are not touched (merging into them and back would drift). Its linear layers are packed (``PackedLinear``).

    ``refresh()`` after each optimizer step rewrites only what training can change: each LoRA layer's weight as
    one fused ``W + scale · B @ A`` in ``dtype`` (B and A rounded to ``dtype`` first: their rounding is far below
    that of the sum), and any trainable non-LoRA parameter (``modules_to_save``). Frozen weights are copied once.
    """

    def __init__(self, policy: Any, dtype: torch.dtype) -> None:
        from peft.tuners.lora import LoraLayer

        self.dtype = dtype
        base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
        # Every weight is overwritten below: the copy is built without its random initialisation (2.1 s of the demo's
        # first GRPO step), unless some weight would be left unwritten.
        self.model = _empty_copy(base, dtype, initialise=False)
        if not _covers(self.model.state_dict(), base):
            self.model = _empty_copy(base, dtype, initialise=True)
        self.model.generation_config = base.generation_config
        self.model.eval()
        target = self.model.state_dict()
        lora_layers = {f"{name}.weight": m for name, m in base.named_modules() if isinstance(m, LoraLayer)}
        self._lora: list[tuple[str, torch.Tensor, Any]] = []
        self._trainable: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        with torch.no_grad():
            for key, value in _source_weights(base):
                if key not in target:
                    continue
                if key in lora_layers:
                    self._lora.append((key, target[key], lora_layers[key]))
                elif value.requires_grad:
                    self._trainable.append((key, target[key], value))
                else:
                    target[key].copy_(value)
        self._packed: dict[str, PackedLinear] = {}
        self.refresh()
        swapped = pack_linears(self.model, dtype)  # packed from the merged weights, which stay as the source
        self._packed = {f"{name}.weight": getattr(parent, attr) for name, (parent, attr, _) in swapped.items()}

    def refresh(self) -> Any:
        """Fold the policy's current adapter weights into the copy, in place; returns the copy."""
        with torch.no_grad():
            for key, weight, module in self._lora:
                _merge_into(weight, module, self.dtype)
                if key in self._packed:
                    self._packed[key].repack(weight)
            for key, weight, value in self._trainable:
                weight.copy_(value)
                if key in self._packed:
                    self._packed[key].repack(weight)
        return self.model


def _source_weights(base: Any) -> Any:
    """The policy's weights under the plain model's names (LoRA's own matrices left out)."""
    for key, value in base.state_dict(keep_vars=True).items():
        if "lora_" not in key:
            yield key.replace(".base_layer.", "."), value


def _covers(target: dict[str, torch.Tensor], base: Any) -> bool:
    """Whether the policy's weights write every tensor of the plain model's state (tied weights count once)."""
    written = {target[key].data_ptr() for key, _ in _source_weights(base) if key in target}
    return all(tensor.data_ptr() in written for tensor in target.values())


def _empty_copy(base: Any, dtype: torch.dtype, initialise: bool) -> Any:
    """A plain model of ``base``'s config in ``dtype``; ``initialise=False``: its weights left uninitialised
    (transformers' ``no_init_weights``, where that exists), for a caller that writes all of them."""
    from transformers import AutoModelForCausalLM

    skip: Any = contextlib.nullcontext()
    if not initialise:
        try:
            from transformers.initialization import no_init_weights

            skip = no_init_weights()
        except ImportError:
            pass
    # A random initialisation must not draw from the global generator: the trainer samples from it, and a resumed
    # run builds this copy right before its first sample (the same adapter on --resume).
    with torch.random.fork_rng(devices=[]), skip:
        model = AutoModelForCausalLM.from_config(
            base.config, dtype=dtype, attn_implementation=attention_implementation()
        )
    return model.to(next(base.parameters()).device)


def _merge_into(target: torch.Tensor, module: Any, dtype: torch.dtype) -> None:
    """``target`` ← the LoRA layer's base weight plus its active adapters' deltas."""
    weight = module.base_layer.weight
    adapters = [a for a in module.active_adapters if a in module.lora_A]
    simple = len(adapters) == 1 and not module.fan_in_fan_out and not module.use_dora.get(adapters[0], False)
    if simple and weight.dtype == target.dtype:
        adapter = adapters[0]
        lora_b, lora_a = module.lora_B[adapter].weight.to(dtype), module.lora_A[adapter].weight.to(dtype)
        torch.addmm(weight, lora_b, lora_a, alpha=module.scaling[adapter], out=target)
        return
    for adapter in adapters:  # PEFT's general delta (DoRA, fan-in-fan-out, several adapters)
        weight = weight + module.get_delta_weight(adapter)
    target.copy_(weight)
