"""Loading models: the tokenizer, the base model on its device, a base with a LoRA adapter, a merged export.

Sources live in ``tasks/models/sources.py``, precision and device in ``tasks/models/precision.py``, anything on private
torch/PEFT internals in ``tasks/speedups/``. Must not import: Prefect, MLflow.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from tasks.models.precision import attention_implementation, device, merge_is_exact
from tasks.models.sources import resolve_model_source


def load_tokenizer(model_dir: Path | str) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_base_model(model_dir: Path | str) -> Any:
    """The base model with fp32 weights on the best device (precision is applied as autocast at compute time)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=attention_implementation()
    )
    return model.to(device())


def load_policy(
    model_dir: Path | str, adapter_dir: Path | str | None, trainable: bool = False, precision: str = "fp32"
) -> Any:
    """The base model, with the LoRA adapter in ``adapter_dir`` on top when one is given.

    For training the adapter stays a trainable PEFT adapter. For inference at ``precision``: in fp32 it is merged
    into the weights (the same function, faster generation); in bf16 it is kept apart from them, as the trainer
    and vLLM keep it (``merge_is_exact``: merged and rounded to bf16, the adapter's delta becomes rounding noise
    as large as itself). The adapter's own ``base_model_name_or_path`` is ignored: the caller names the base (it
    is an absolute path on the machine that trained it, so not portable).
    """
    model = load_base_model(model_dir)
    if adapter_dir is None:
        return model
    from peft import PeftModel

    policy = PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=trainable)
    return policy if trainable else inference_policy(policy, precision)


def inference_policy(policy: Any, precision: str) -> Any:
    """A PEFT ``policy`` made ready to sample at ``precision``: merged where merging is exact, else kept apart
    (as a plain model of low-rank layers where the speedups' path applies, else PEFT's own)."""
    if merge_is_exact(precision):
        return policy.merge_and_unload()
    from tasks.speedups import speedups_on

    if speedups_on("auto"):
        from tasks.speedups.low_rank import plain_unmerged

        plain = plain_unmerged(policy)  # the same products, without PEFT's wrappers; None: not plain LoRA
        if plain is not None:
            return plain
    return policy.eval()


class KeptBase:
    """A base model loaded once, on which adapter after adapter is put and taken off again, exactly: the
    in-training hold-out samples each evaluation's adapter without reading and building the base again."""

    def __init__(self, model_dir: Path | str) -> None:
        self.model_dir = model_dir
        self.model = load_base_model(model_dir)

    @contextlib.contextmanager
    def policy(self, adapter_dir: Path | str, precision: str = "fp32") -> Iterator[Any]:
        """The policy of ``adapter_dir`` on the kept base (as ``load_policy`` gives it); on exit every adapted
        layer is the base's own again, with its own weights (copied back where the adapter was merged in)."""
        from peft import PeftModel
        from peft.tuners.lora import LoraLayer

        policy = PeftModel.from_pretrained(self.model, str(adapter_dir))
        layers = [
            (name, module.base_layer) for name, module in self.model.named_modules() if isinstance(module, LoraLayer)
        ]
        weights = [layer.weight.detach().clone() for _, layer in layers] if merge_is_exact(precision) else []
        try:
            yield inference_policy(policy, precision)
        finally:
            with torch.no_grad():
                for index, (name, layer) in enumerate(layers):
                    parent_name, _, attribute = name.rpartition(".")
                    setattr(self.model.get_submodule(parent_name) if parent_name else self.model, attribute, layer)
                    if weights:
                        layer.weight.copy_(weights[index])
            for leftover in ("peft_config", "_hf_peft_config_loaded"):
                if leftover in vars(self.model):
                    delattr(self.model, leftover)


def export_merged(base_source: str, adapter_dir: Path, destination: Path) -> Path:
    """Fold a LoRA adapter into its base model and save a plain model folder (weights, config, tokenizer)."""
    base_dir = resolve_model_source(base_source)
    merged = load_policy(base_dir, adapter_dir)
    destination.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(destination)
    load_tokenizer(base_dir).save_pretrained(destination)
    return destination
