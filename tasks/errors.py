"""The errors a user acts on, and the exit codes of the ``grpoflow`` command.

Each carries its exit code; the command prints it as at most three lines (what, where, what to do) and no
traceback unless ``--debug`` (or ``GRPOFLOW_DEBUG=1``). Anything else is a bug and shows its traceback.

| code | meaning |
|---|---|
| 0 | done |
| 1 | a bug (an unexpected error, with its traceback) |
| 2 | a user error: config, data, paths, model source, reward import, an unknown registered model |
| 3 | stopped by a gate: no learning signal, rewards that cannot judge |
| 4 | infrastructure: tracking store or registry unreachable, disk full, a lock not granted, no sandbox |

Must not import: anything outside the standard library.
"""

from __future__ import annotations

EXIT_BUG = 1


class GrpoflowError(Exception):
    """An error with a message a user can act on; ``exit_code`` says which kind."""

    exit_code = 2


class UserError(GrpoflowError):
    """The input is wrong: a config key, a data file, a path, a model source, a reward module."""

    exit_code = 2


class GateStop(GrpoflowError):
    """A gate stopped the run on purpose: nothing is wrong with grpoflow, the data or rewards need work."""

    exit_code = 3


class InfrastructureError(GrpoflowError):
    """Something the run depends on is unavailable: a store, a server, disk space, a lock, the sandbox."""

    exit_code = 4


def is_disk_full(error: BaseException) -> bool:
    """Whether ``error`` (or anything in its chain) says the disk is full, however a library wrapped it (an
    ``OSError`` with ENOSPC, SQLite's "database or disk is full", safetensors' "os error 28").

    >>> is_disk_full(RuntimeError("x")), is_disk_full(OSError(28, "No space left on device"))
    (False, True)
    """
    import errno

    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(error).lower()
        if "no space left on device" in text or "database or disk is full" in text or "os error 28" in text:
            return True
        error = error.__cause__ or error.__context__
    return False
