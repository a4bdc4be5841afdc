"""How many torch threads each training rank this host starts gets. Must not import: the stages, Prefect, MLflow."""

from __future__ import annotations


def rank_threads(ranks: int, threads: int | None = None) -> int:
    """An equal share of this process's torch threads (``OMP_NUM_THREADS`` at its start, else the cores) for each of
    ``ranks`` ranks on this host, at least one. Named in every rank's environment rather than inherited: an
    in-process vLLM engine sets ``OMP_NUM_THREADS`` for itself, and ranks that inherited it after one had run
    computed with another thread count than a fresh process's, so their adapters differed in the last bits.

    >>> rank_threads(2, threads=2), rank_threads(4, threads=2), rank_threads(1, threads=8)
    (1, 1, 8)
    """
    if threads is None:
        import torch

        threads = torch.get_num_threads()
    return max(1, threads // max(1, ranks))
