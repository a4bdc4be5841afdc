"""How much of a LoRA adapter's delta survives being merged into the weights and rounded to a lower precision:
the reason grpoflow keeps adapters apart from the weights for bf16 inference (docs/vllm.md, "Do the engines
agree?").

Run: ``.venv/bin/python bench/bench_lora_rounding.py BASE_MODEL_DIR ADAPTER_DIR [ADAPTER_DIR ...]``
(e.g. ``~/.cache/grpoflow/models/smollm2-135m-instruct-v2`` and a run's ``sft/adapter``). Prints, per adapter, the
delta's norm relative to the weights it adapts, and the error of ``round(W + delta)`` against ``round(W) + delta``
relative to the delta's own norm (1.0: the merged adapter is as much noise as signal), for bf16 and fp16.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file


def rounding_loss(base_dir: Path, adapter_dir: Path, dtype: torch.dtype) -> tuple[float, float]:
    """(|delta| / |W|, |round(W + delta) − (round(W) + delta)| / |delta|) over every adapted weight."""
    base = {}
    for path in sorted(Path(base_dir).glob("*.safetensors")):
        base.update(load_file(str(path)))
    adapter = load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))
    settings = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    scale = settings["lora_alpha"] / (settings["r"] ** 0.5 if settings.get("use_rslora") else settings["r"])
    delta_sq = lost_sq = weight_sq = 0.0
    for key, lora_a in adapter.items():
        if "lora_A" not in key:
            continue
        lora_b = adapter[key.replace("lora_A", "lora_B")]
        module = key.split("base_model.model.", 1)[1].replace(".lora_A.weight", "")
        weight = base[f"{module}.weight"].float()
        delta = scale * (lora_b.float() @ lora_a.float())
        merged = (weight + delta).to(dtype).float()
        apart = weight.to(dtype).float() + delta
        delta_sq += float(delta.norm()) ** 2
        lost_sq += float((merged - apart).norm()) ** 2
        weight_sq += float(weight.norm()) ** 2
    return (delta_sq / weight_sq) ** 0.5, (lost_sq / delta_sq) ** 0.5


def main(argv: list[str]) -> None:
    base_dir, adapters = Path(argv[0]), [Path(a) for a in argv[1:]]
    print("| adapter | delta / weights | bf16: merge error / delta | fp16: merge error / delta |")
    print("|---|---|---|---|")
    for adapter in adapters:
        relative, lost_bf16 = rounding_loss(base_dir, adapter, torch.bfloat16)
        _, lost_fp16 = rounding_loss(base_dir, adapter, torch.float16)
        print(f"| {adapter} | {relative:.2%} | {lost_bf16:.2f} | {lost_fp16:.2f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
