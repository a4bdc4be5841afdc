"""Validate-stage throughput: load nothing, validate and normalize N in-memory rows (row checks, ground-truth
normalization, duplicate and conflict detection, the Great Expectations suite, the split) and report rows/s,
separately for plain-number answers and for LaTeX answers.

Run: .venv/bin/python bench/bench_validate.py [--sizes 10000,100000,1000000]
Target (issue 3): 1M plain-number rows in 60 s or less, cost linear in rows.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import time

from reward_fns.math import parse_gold
from tasks.config import DataSettings
from tasks.inputs import holdout_side
from tasks.validate import validate_rows


def latex_answer(rng: random.Random) -> str:
    """A LaTeX answer from a few thousand distinct ones (fractions, roots, multiples of pi), as math sets have."""
    a, b = rng.randint(1, 60), rng.randint(2, 60)
    return rng.choice([f"\\frac{{{a}}}{{{b}}}", f"{a}\\sqrt{{{b}}}", f"\\frac{{{a}\\pi}}{{{b}}}"])


def make_rows(count: int, latex: bool, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        if latex:
            answer = f"\\boxed{{{latex_answer(rng)}}}"
        else:
            answer = rng.choice(
                [str(rng.randint(0, 10**6)), f"#### {rng.randint(0, 9999):,}", f"${rng.randint(1, 999)}"]
            )
        rows.append(
            {
                "id": f"r{index}",
                "prompt": f"Question {index}: what is the value of item {index}?",
                "ground_truth": answer,
            }
        )
    return rows


def measure(count: int, latex: bool) -> dict:
    parse_gold.cache_clear()  # each size pays for its own distinct answers
    rows = make_rows(count, latex)
    started = time.perf_counter()
    kept, quarantined, _ = validate_rows(rows, DataSettings(kind="math"))
    sum(holdout_side(row["prompt"], 0.2) for row in kept)
    seconds = time.perf_counter() - started
    assert len(kept) + len(quarantined) == count
    return {
        "rows": count,
        "answers": "latex" if latex else "plain",
        "seconds": round(seconds, 2),
        "rows_per_s": round(count / seconds),
        "kept": len(kept),
        "distinct_answers": len({row["ground_truth"] for row in rows}),
    }


def main() -> None:
    logging.getLogger("great_expectations").setLevel(logging.ERROR)
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="10000,100000,1000000")
    sizes = [int(size) for size in parser.parse_args().sizes.split(",")]
    measure(1000, False)  # warm-up: imports and Great Expectations' first context are not per-row costs
    results = [measure(size, latex) for latex in (False, True) for size in sizes]
    print(json.dumps({"bench": "validate", "results": results}))
    print(f"{'answers':>8}{'rows':>10}{'distinct':>10}{'seconds':>10}{'rows/s':>10}")
    for r in results:
        print(f"{r['answers']:>8}{r['rows']:>10}{r['distinct_answers']:>10}{r['seconds']:>10}{r['rows_per_s']:>10}")


if __name__ == "__main__":
    main()
