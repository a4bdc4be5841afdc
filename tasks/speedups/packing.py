"""Linear layers packed once in oneDNN's blocked layout, for inference on CPU (private ``torch.ops.mkldnn``
ops, checked once against ``linear`` with plain layers as the fallback).
Must not import: Prefect, MLflow, the stages."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from typing import Any

import torch

from tasks.models import resolve_dtype

logger = logging.getLogger(__name__)


class PackedLinear(torch.nn.Module):
    """An inference-only ``nn.Linear`` whose weight is stored in oneDNN's blocked layout, in ``dtype``.

    A plain bf16 ``linear`` on CPU prepares its weight for oneDNN on every call; packed once, decoding reads
    the weights faster and the results are bit-identical in bf16 (measured: docs/measurements/performance.md).
    The input is cast to ``dtype`` (what autocast does) and so is the output.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features, self.dtype = weight.shape[1], weight.shape[0], dtype
        self.bias = None if bias is None else bias.detach().to(dtype)
        self.repack(weight)

    def repack(self, weight: torch.Tensor) -> None:
        """Take a new weight (e.g. after an optimizer step merged into it)."""
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(self.dtype), 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.to(self.dtype), self.packed, self.bias, "none", [], "")


@functools.cache
def packing_available(dtype: torch.dtype) -> bool:
    """Whether ``PackedLinear`` works here (a CPU build of torch with oneDNN, which computes what ``linear``
    computes); checked once per dtype, on CPU only."""
    if torch.cuda.is_available() or not torch.backends.mkldnn.is_available():
        return False
    try:
        generator = torch.Generator().manual_seed(0)
        weight, x = torch.randn(24, 40, generator=generator), torch.randn(3, 5, 40, generator=generator)
        packed = PackedLinear(weight, None, dtype)(x)
        plain = torch.nn.functional.linear(x.to(dtype), weight.to(dtype))
        return packed.shape == plain.shape and torch.allclose(packed.float(), plain.float(), atol=1e-3, rtol=1e-2)
    except (RuntimeError, AttributeError) as exc:
        logger.info("packed linear layers unavailable (%s): plain ones are used", exc)
        return False


def pack_linears(model: Any, dtype: torch.dtype) -> dict[str, tuple[Any, str, torch.nn.Module]]:
    """Replace every plain ``nn.Linear`` of ``model`` by a ``PackedLinear`` in ``dtype`` (inference only); returns
    ``{name: (parent, attribute, original)}`` so ``unpack_linears`` can put the originals back. A no-op where
    packing is unavailable."""
    swapped: dict[str, tuple[Any, str, torch.nn.Module]] = {}
    if not packing_available(dtype):
        return swapped
    for parent_name, parent in list(model.named_modules()):
        for attribute, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, attribute, PackedLinear(child.weight, child.bias, dtype))
                swapped[f"{parent_name}.{attribute}".lstrip(".")] = (parent, attribute, child)
    return swapped


def unpack_linears(swapped: dict[str, tuple[Any, str, torch.nn.Module]]) -> None:
    for parent, attribute, original in swapped.values():
        setattr(parent, attribute, original)


@contextlib.contextmanager
def packed_for_inference(model: Any, precision: str) -> Iterator[Any]:
    """``model`` with packed linear layers in the compute dtype for the duration (generation in probe and
    evaluation); the original layers are back afterwards, so the model can still be saved or trained."""
    swapped = pack_linears(model, resolve_dtype(precision))
    try:
        yield model
    finally:
        unpack_linears(swapped)
