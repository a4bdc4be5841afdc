"""glibc's allocator told to keep the memory a run frees (``mallopt``; the same settings in the environment for the
processes it starts).

Training and decoding free and allocate the same large activations at every step. With glibc's defaults the top of
the heap goes back to the system once 64 MB of it is free, and blocks above a threshold that moves are mapped
afresh, so each step touched new pages again: the demo's SFT took 1.2–1.4 million page faults and 3.8–4.0 s of
system time in 8 steps, 0.6 million and 1.9–2.2 s with these settings, and its 8 steps 6–18 % less time
(docs/measurements/performance.md). The cost: a process keeps up to about 1.3 GB it has freed, for its next allocations.

Numbers do not change (where memory comes from, not what is computed). A user's own ``MALLOC_*`` settings win;
elsewhere than glibc nothing is done.
Must not import: torch, transformers, Prefect, MLflow (it runs when ``tasks`` is imported).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, MutableMapping

MiB = 1 << 20
# glibc's environment names (read when a process starts) and their mallopt parameters (for this process).
FREED_MEMORY_KEPT = {
    "MALLOC_MMAP_THRESHOLD_": (-3, 32 * MiB),  # M_MMAP_THRESHOLD: fixed at glibc's largest (no longer moving)
    "MALLOC_TRIM_THRESHOLD_": (-1, 1024 * MiB),  # M_TRIM_THRESHOLD: give back only beyond 1 GiB free at the top
    "MALLOC_TOP_PAD_": (-2, 256 * MiB),  # M_TOP_PAD: grow the heap in large steps
}


def keep_freed_memory(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Apply ``FREED_MEMORY_KEPT`` to this process (``mallopt``) and, through ``environ``, to the processes it
    starts; nothing where the user set any ``MALLOC_*`` of them. True when this process's allocator was changed.

    >>> keep_freed_memory({"MALLOC_TRIM_THRESHOLD_": "0"})
    False
    """
    if any(name in environ for name in FREED_MEMORY_KEPT):
        return False
    mallopt = _glibc_mallopt()
    if mallopt is None:
        return False
    for name, (_, value) in FREED_MEMORY_KEPT.items():
        environ[name] = str(value)
    return all(mallopt(parameter, value) == 1 for parameter, value in FREED_MEMORY_KEPT.values())


def _glibc_mallopt() -> Callable[[int, int], int] | None:
    """glibc's ``mallopt``, or None (another C library: musl takes none of these settings, macOS has no mallopt)."""
    if os.name != "posix" or os.uname().sysname != "Linux":
        return None
    try:
        libc = ctypes.CDLL(None)  # the C library this interpreter runs on
        if not hasattr(libc, "gnu_get_libc_version"):
            return None
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt
