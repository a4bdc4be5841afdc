"""Math reward throughput and agreement: grpoflow's math_accuracy against TRL's accuracy_reward.

10,000 distinct completions (1,250 prompts x 8): plain-number and LaTeX answers, right and wrong, in several
equivalent forms, with missing and unparseable boxes. Both functions score the same completions in this run;
the script prints one JSON line and a short table. Run: .venv/bin/python bench/bench_math_reward.py
"""

from __future__ import annotations

import json
import logging
import random
import sys
import time

from trl.rewards import accuracy_reward

from reward_fns.math import boxed_verdict, math_accuracy, parse_gold
from reward_fns.text import last_boxed

logging.getLogger("math_verify").setLevel(logging.ERROR)

LATEX = [
    ("\\frac{1}{2}", ["0.5", "\\frac{2}{4}", "1/2"]),
    ("\\frac{3}{4}", ["0.75", "\\frac{6}{8}"]),
    ("\\sqrt{2}", ["\\sqrt{2}", "2^{1/2}"]),
    ("2\\pi", ["2\\pi", "\\pi \\cdot 2"]),
    ("x^2+1", ["1+x^2", "x^{2}+1"]),
    ("\\frac{5}{3}", ["\\frac{10}{6}", "\\dfrac{5}{3}"]),
]


def corpus(seed: int = 0, prompts: int = 1250, per_prompt: int = 8) -> tuple[list[str], list[str]]:
    """(completions, golds): one gold per prompt, repeated for its 8 completions; completions all distinct."""
    rng = random.Random(seed)
    completions: list[str] = []
    golds: list[str] = []
    for index in range(prompts):
        if rng.random() < 0.7:
            value = rng.randint(-999, 99_999)
            gold, right_forms = str(value), [str(value), f"{value}.0", f"{value:,}"]
            wrong = str(value + rng.choice([-10, -1, 1, 7]))
        else:
            gold, right_forms = rng.choice(LATEX)
            wrong = rng.choice(["\\frac{1}{3}", "\\sqrt{3}", "x^2-1", "7"])
        for sample in range(per_prompt):
            kind = rng.random()
            lead = f"Step {index}.{sample}: we compute carefully. "
            if kind < 0.45:
                text = f"{lead}The answer is \\boxed{{{rng.choice(right_forms)}}}."
            elif kind < 0.85:
                text = f"{lead}So \\boxed{{{wrong}}}."
            elif kind < 0.95:
                text = f"{lead}The answer is {rng.choice(right_forms)}"  # no box: not an answer for either
            else:
                text = f"{lead}\\boxed{{\\frac{{}}}}"  # malformed
            completions.append(text)
            golds.append(gold)
    return completions, golds


def main() -> None:
    completions, golds = corpus()
    assert len(set(completions)) == len(completions)
    chat = [[{"role": "assistant", "content": c}] for c in completions]

    parse_gold.cache_clear()
    boxed_verdict.cache_clear()
    started = time.perf_counter()
    ours = math_accuracy(completions=completions, ground_truth=golds)
    ours_seconds = time.perf_counter() - started

    started = time.perf_counter()
    theirs = accuracy_reward(chat, [f"${g}$" for g in golds])
    trl_seconds = time.perf_counter() - started

    both = [(a, b, c) for a, b, c in zip(ours, theirs, completions, strict=True) if a is not None and b is not None]
    # grpoflow's contract: only a \boxed{} answer counts. TRL also credits an unboxed LaTeX answer after an
    # anchor ("The answer is \frac{6}{8}"): a difference of contract, counted apart from real disagreements.
    disagreements = [(c, a, b) for a, b, c in both if a != b and last_boxed(c) is not None]
    contract = [(c, a, b) for a, b, c in both if a != b and last_boxed(c) is None]
    result = {
        "bench": "math_reward",
        "completions": len(completions),
        "grpoflow_per_s": round(len(completions) / ours_seconds, 1),
        "trl_accuracy_reward_per_s": round(len(completions) / trl_seconds, 1),
        "speedup": round(trl_seconds / ours_seconds, 2),
        "both_judged": len(both),
        "disagreements_on_boxed_answers": len(disagreements),
        "unboxed_answers_credited_by_trl_only": len(contract),
        "grpoflow_correct_share": round(sum(a for a, _, _ in both) / len(both), 4),
    }
    print(json.dumps(result))
    print(f"{'':28}{'completions/s':>14}")
    print(f"{'grpoflow math_accuracy':28}{result['grpoflow_per_s']:>14}")
    print(f"{'trl accuracy_reward':28}{result['trl_accuracy_reward_per_s']:>14}")
    print(f"speedup {result['speedup']}x; of {len(both)} judged by both, verdicts differ on {len(disagreements)} boxed")
    print(f"answers; {len(contract)} unboxed answers are credited by TRL only (grpoflow counts only \\boxed{{}})")
    for text, a, b in (disagreements + contract)[:3]:
        print(f"  grpoflow={a} trl={b}: {text[-60:]!r}")
    sys.exit(1 if disagreements else 0)


if __name__ == "__main__":
    main()
