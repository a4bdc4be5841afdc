"""Temporary changes to private TRL symbols, each undone on exit and a no-op where TRL lacks the symbol.
Must not import: Prefect, MLflow, the stages."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def score_only_labelled_positions() -> Iterator[None]:
    """Let TRL's fused LM head score only the positions that have a label, on CPU too.

    TRL does so on Triton devices; elsewhere it scores every position so that tile shapes stay fixed for
    compilers (Neuron). Nothing is compiled on CPU, and with a completion-only SFT loss about one position in
    five has a label, so most of the head's work was wasted. The values are the same (a test checks the loss
    and gradients). Where TRL lacks the hook this changes nothing.
    """
    import trl.trainer.utils as trl_utils

    original = getattr(trl_utils, "_use_triton", None)
    if original is None:
        yield
        return
    trl_utils._use_triton = lambda device: device.type == "cpu" or original(device)
    try:
        yield
    finally:
        trl_utils._use_triton = original
