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

from tasks.config import DataSettings
from tasks.validate import holdout_side, validate_rows

LATEX_ANSWERS = ["\\frac{1}{2}", "\\sqrt{2}", "2\\pi", "x^2+1", "\\frac{3}{4}", "3\\sqrt{5}", "\\frac{\\pi}{3}"]


def make_rows(count: int, latex: bool, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        if latex:
            answer = f"\\boxed{{{rng.choice(LATEX_ANSWERS)}}}"
        else:
            answer = rng.choice(
                [str(rng.randint(0, 10**6)), f"#### {rng.randint(0, 9999):,}", f"${rng.randint(1, 999)}"]
            )
        rows.append({"id": f"r{index}", "prompt": f"Question {index}: what is the value of item {index}?",
                     "ground_truth": answer})  # fmt: skip
    return rows


def measure(count: int, latex: bool) -> dict:
    rows = make_rows(count, latex)
    started = time.perf_counter()
    kept, quarantined, _ = validate_rows(rows, DataSettings(kind="math"))
    sum(holdout_side(row["prompt"], 0.2) for row in kept)
    seconds = time.perf_counter() - started
    assert len(kept) + len(quarantined) == count
    return {"rows": count, "answers": "latex" if latex else "plain", "seconds": round(seconds, 2),
            "rows_per_s": round(count / seconds), "kept": len(kept)}  # fmt: skip


def main() -> None:
    logging.getLogger("great_expectations").setLevel(logging.ERROR)
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="10000,100000,1000000")
    sizes = [int(size) for size in parser.parse_args().sizes.split(",")]
    results = [measure(size, latex) for latex in (False, True) for size in sizes]
    print(json.dumps({"bench": "validate", "results": results}))
    print(f"{'answers':>8}{'rows':>10}{'seconds':>10}{'rows/s':>10}")
    for r in results:
        print(f"{r['answers']:>8}{r['rows']:>10}{r['seconds']:>10}{r['rows_per_s']:>10}")


if __name__ == "__main__":
    main()
