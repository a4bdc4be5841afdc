"""vLLM's CPU worker and torch's thread count, in one process (colocate).

vLLM's CPU worker replaces ``torch.set_num_threads`` with a no-op that logs a warning (its threads are bound to
cores in a serving process); in colocate that process is the trainer's, whose thread count grpoflow sets.
Must not import: anything of grpoflow's (the engine module imports this one).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

logger = logging.getLogger(__name__)

_SET_NUM_THREADS = torch.set_num_threads  # torch's own, before vLLM's CPU worker replaces it


@contextlib.contextmanager
def keep_thread_control(threads: int) -> Iterator[None]:
    """Build a vLLM engine in this process without losing the thread count: vLLM's CPU worker replaces
    ``torch.set_num_threads`` with a no-op (in colocate, the trainer's own), and its serving set-up may lower the
    count. Afterwards torch's function is back and the count is ``threads`` again (checked)."""
    try:
        yield
    finally:
        torch.set_num_threads = _SET_NUM_THREADS
        torch.set_num_threads(threads)
        if torch.get_num_threads() != threads:
            logger.warning(
                "torch threads are %d after the vLLM engine started, not %d", torch.get_num_threads(), threads
            )
