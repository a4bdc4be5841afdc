"""The only home of code that reaches into private torch / TRL / PEFT internals (underscore names, PEFT layer
internals such as ``base_layer``, ``scaling``, ``lora_A``): each piece is imported lazily by the code that uses
it, checks itself against the public path where it can, and falls back to the public path where the internal is
missing.

- ``packing``: linear layers packed once in oneDNN's layout for inference (CPU).
- ``merged_copy``: a plain copy of a LoRA policy with the deltas folded in, for GRPO's sampling (CPU).
- ``frozen``: the frozen base weights of LoRA layers stored in the compute dtype.
- ``trl_patches``: TRL's fused LM head scoring only labelled positions during SFT on CPU.
- ``grpo_trainer``: a GRPOTrainer that encodes each prompt once per group (generation and loss) on CPU.

Must not import (at package import): torch, transformers, TRL, PEFT.
"""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX-512 BF16 or AMX), asked of torch's private probes where
    they exist, else read from ``/proc/cpuinfo``."""
    import torch

    checks = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if any(check is not None and check() for check in checks):
        return True
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags
