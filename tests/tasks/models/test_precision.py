"""Precision: explicit settings are honoured; ``auto`` follows the hardware; autocast only where bf16 is chosen."""

import torch

from tasks.models.precision import attention_implementation, bf16_supported, compute_autocast, resolve_dtype


def test_explicit_precisions_and_auto() -> None:
    assert resolve_dtype("fp32") == torch.float32 and resolve_dtype("bf16") == torch.bfloat16
    assert resolve_dtype("auto") == (torch.bfloat16 if bf16_supported() else torch.float32)


def test_autocast_is_on_for_bf16_only() -> None:
    layer = torch.nn.Linear(4, 4)
    with compute_autocast("bf16"):
        assert layer(torch.ones(1, 4)).dtype == torch.bfloat16
    with compute_autocast("fp32"):
        assert layer(torch.ones(1, 4)).dtype == torch.float32
    assert attention_implementation() == "eager"  # no CUDA here
