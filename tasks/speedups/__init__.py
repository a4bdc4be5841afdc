"""The only home of code that reaches into private torch / TRL / PEFT internals (underscore names, PEFT layer
internals such as ``base_layer``, ``scaling``, ``lora_A``): each piece is imported lazily by the code that uses
it, checks itself against the public path where it can, and falls back to the public path where the internal is
missing.

- ``packing``: linear layers packed once in oneDNN's layout for inference (CPU).
- ``low_rank``: a LoRA policy for bf16 inference as a plain model whose layers keep the adapter apart.
- ``merged_copy``: a plain copy of a LoRA policy with the deltas folded in, for GRPO's sampling (CPU).
- ``frozen``: the frozen base weights of LoRA layers stored in the compute dtype.
- ``trl_patches``: TRL's fused LM head scoring only labelled positions during SFT on CPU.
- ``grpo_trainer``: a GRPOTrainer that encodes each prompt once per group (generation and loss) on CPU.
- ``store_template``: a new local MLflow store seeded from an empty, migrated copy (no migrations per store).
- ``gguf_reading``: a GGUF file parsed once per conversion instead of once per transformers loading call.
- ``grouped_attention``: grouped-query attention without the KV cache repeated and cast at every decoding step.
- ``prefect_server``: Prefect's temporary server started while a run imports its stack (Prefect's private class).
- ``allocator``: glibc told to keep the memory a run frees (``mallopt``; applied when ``tasks`` is imported).
- ``cpu_resume``: several CPU processes resume from a checkpoint (the trainer's device ``cpu``, not ``cpu:0``).

``speedups_on(setting)`` is the one switch: ``auto`` turns them on only where the installed torch, transformers,
TRL and PEFT are versions they were checked on (``CHECKED_ON``); elsewhere the stock path runs and one log line
says why. Each piece also checks its numbers against the stock path at first use (``packing``, ``grpo_trainer``,
``grouped_attention``).

Must not import (at package import): torch, transformers, TRL, PEFT.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from importlib import metadata
from pathlib import Path

logger = logging.getLogger(__name__)

# The releases the speed-ups were run and checked on ([lowest, highest) as versions): private names they use can
# move in any other release. The lock (constraints.txt) sits inside every range.
CHECKED_ON = {
    "torch": ("2.13", "2.14"),
    "transformers": ("5.17", "5.25"),
    "trl": ("1.16", "1.17"),
    "peft": ("0.21", "0.22"),
}


def outside_checked(installed: dict[str, str], checked_on: dict[str, tuple[str, str]] = CHECKED_ON) -> list[str]:
    """The installed packages whose version lies outside the range the speed-ups were checked on.

    >>> outside_checked({"torch": "2.13.0+cpu", "transformers": "5.30.0", "trl": "1.16.0", "peft": "0.21.2"})
    ['transformers 5.30.0 (checked on >=5.17,<5.25)']
    """
    from packaging.version import Version

    found = []
    for name, (lowest, below) in checked_on.items():
        version = installed.get(name)
        if version is None or not Version(lowest) <= Version(version.split("+")[0]) < Version(below):
            found.append(f"{name} {version or 'not installed'} (checked on >={lowest},<{below})")
    return found


@functools.cache
def _installed_outside_checked() -> tuple[str, ...]:
    installed = {}
    for name in CHECKED_ON:
        with contextlib.suppress(metadata.PackageNotFoundError):
            installed[name] = metadata.version(name)
    found = tuple(outside_checked(installed))
    if found:
        logger.warning("speed-ups off, stock TRL/transformers instead: %s", "; ".join(found))
    return found


def speedups_on(setting: str) -> bool:
    """Whether a stage set to ``setting`` (``auto`` | ``off``) runs grpoflow's speed-ups: ``auto`` does where the
    installed versions are ones they were checked on (said once in the log where not).

    >>> speedups_on("off")
    False
    """
    return setting == "auto" and not _installed_outside_checked()


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
