"""Code rewards: run the completion's program against the row's unit tests in the sandbox.

A row carries ``tests`` (Python: ``assert`` lines, ``test_*`` functions, ``unittest.TestCase`` classes, or a
HumanEval ``check(candidate)`` function with the row's ``entry_point``) and optionally ``code_prefix`` (code placed
before the completion, e.g. HumanEval's signature and imports).
Must not import: Prefect, MLflow, torch, ``tasks``.
"""

from __future__ import annotations

import os
import re
import threading
from collections import OrderedDict
from typing import Any

from reward_fns.sandbox import Sandbox, SandboxJob, SandboxLimits, SandboxResult, detect_isolation
from reward_fns.text import Completion, completion_text

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_CACHE_SIZE = 4096
_results: OrderedDict[tuple[SandboxJob, SandboxLimits], SandboxResult] = OrderedDict()
_results_lock = threading.Lock()


def extract_code(text: str) -> str:
    """The program in a completion: the last fenced code block if there is one, else the whole text.

    >>> extract_code("Here:\\n```python\\ndef f():\\n    return 1\\n```\\nDone.")
    'def f():\\n    return 1\\n'
    >>> extract_code("    return x + 1")
    '    return x + 1'
    """
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else text


_sandboxes: dict[tuple[SandboxLimits, int | None, int, str], Sandbox] = {}
_sandboxes_lock = threading.Lock()


def shared_sandbox(limits: SandboxLimits, workers: int | None = None) -> Sandbox:
    """One sandbox per setting and process, reused across calls (isolation is detected once). A forked process
    (evaluation's second worker) starts its own: the workers it inherited answer the parent's pipes."""
    isolation = detect_isolation()
    key = (limits, workers, os.getpid(), isolation)
    with _sandboxes_lock:
        if key not in _sandboxes:
            _sandboxes[key] = Sandbox(limits, workers=workers, isolation=isolation)
        return _sandboxes[key]


def close_process_sandboxes() -> None:
    """Close the sandboxes this process started (not those a fork inherited): for a forked process that leaves
    with ``os._exit``, which runs no exit handler."""
    with _sandboxes_lock:
        own = [key for key in _sandboxes if key[2] == os.getpid()]
        sandboxes = [_sandboxes.pop(key) for key in own]
    for sandbox in sandboxes:
        sandbox.close()


def run_programs(jobs: list[SandboxJob], limits: SandboxLimits, workers: int | None = None) -> list[SandboxResult]:
    """Sandbox results for ``jobs``, each distinct (job, limits) run once and remembered (a reward and the
    correctness check, or the G equal completions of a group, do not run the same program twice)."""
    distinct = list(dict.fromkeys(jobs))
    with _results_lock:  # take the known results out now: another call may evict them meanwhile
        found = {job: _results[(job, limits)] for job in distinct if (job, limits) in _results}
    pending = [job for job in distinct if job not in found]
    fresh = shared_sandbox(limits, workers).run_many(pending) if pending else []
    found.update(zip(pending, fresh, strict=True))
    with _results_lock:
        for job, result in zip(pending, fresh, strict=True):
            if result.status != "infrastructure":  # a failed sandbox is worth another try next time
                _results[(job, limits)] = result
                while len(_results) > _CACHE_SIZE:
                    _results.popitem(last=False)
    return [found[job] for job in jobs]


def _jobs(
    completions: list[Completion],
    tests: list[str | None],
    entry_point: list[str | None] | None,
    code_prefix: list[str | None] | None,
) -> list[SandboxJob]:
    entry_points = entry_point or [None] * len(completions)
    prefixes = code_prefix or [None] * len(completions)
    jobs = []
    for completion, row_tests, row_entry, prefix in zip(completions, tests, entry_points, prefixes, strict=True):
        program = extract_code(completion_text(completion))
        if prefix:
            program = f"{prefix}\n{program}"
        jobs.append(SandboxJob(program=program, tests=row_tests or "", entry_point=row_entry or None))
    return jobs


def code_tests(
    completions: list[Completion],
    tests: list[str | None] | None = None,
    entry_point: list[str | None] | None = None,
    code_prefix: list[str | None] | None = None,
    partial_credit: float = 0.3,
    timeout_s: float = 10.0,
    memory_mb: int = 512,
    workers: int | None = None,
    **kwargs: Any,
) -> list[float | None]:
    """1.0 when every test passes; ``partial_credit`` only when the program ran to its tests and some failed
    (the practice guide's shaping); 0.0 for a syntax error, a crash or an exit before or during the tests, a
    timeout, exhausted memory, a resource limit reached (disk, file size) or tampering with the test framework;
    ``None`` when the row's tests are unusable or the sandbox itself failed twice (cannot judge).

    >>> tests = "assert add(2, 3) == 5"
    >>> code_tests(completions=["```python\\ndef add(a, b):\\n    return a + b\\n```",
    ...                         "def add(a, b):\\n    return a - b", "def add(a, b) return"], tests=[tests] * 3)
    [1.0, 0.3, 0.0]
    """
    if tests is None:  # no tests column: nothing can be judged
        return [None] * len(completions)
    limits = SandboxLimits(cpu_seconds=max(1, int(timeout_s)), wall_seconds=timeout_s + 2, memory_mb=memory_mb)
    results = run_programs(_jobs(completions, tests, entry_point, code_prefix), limits, workers)
    rewards: list[float | None] = []
    for result in results:
        if result.status in ("infrastructure", "invalid_tests"):
            rewards.append(None)
        elif result.status == "passed":
            rewards.append(1.0)
        elif result.status == "failed":
            rewards.append(float(partial_credit))
        else:
            rewards.append(0.0)
    return rewards


def code_passes(
    completions: list[Completion], tests: list[str | None] | None = None, **kwargs: Any
) -> list[float | None]:
    """1.0 when every test passes, else 0.0 (``None`` when the sandbox failed): the correctness check for code.

    >>> code_passes(completions=["def add(a, b):\\n    return a - b"], tests=["assert add(2, 3) == 5"])
    [0.0]
    """
    return code_tests(completions, tests, **{**kwargs, "partial_credit": 0.0})
