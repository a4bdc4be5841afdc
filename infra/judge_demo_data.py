"""Writes configs/data/summaries.jsonl: the judged demo's task, one-sentence summaries of short made-up passages.

Each passage tells who did what, where and why, padded with details a summary should leave out; the reference
summary (``ground_truth``, and ``completion``: what SFT learns) is the one sentence that keeps who, what, where and
why. No program can check a summary, so the demo's reward is an LLM judge reading the reference
(configs/judge-demo.yaml). Seeded: the file is the same on every run. ``python infra/judge_demo_data.py [ROWS]``.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

PEOPLE = ["Mia", "Tom", "Ana", "Raj", "Lena", "Omar", "Zoe", "Ivan", "Nora", "Kofi", "Yuki", "Sam"]
PLACES = ["the library", "the harbour", "the school", "the market", "the park", "the museum", "the bakery", "the lab"]
ACTIONS = [
    ("repaired", "the old clock", "it had stopped before the town fair"),
    ("painted", "the front door", "the wood had started to crack"),
    ("organised", "a book swap", "neighbours wanted cheaper books"),
    ("planted", "twenty trees", "the street needed shade in summer"),
    ("cooked", "soup for forty people", "the shelter had run out of food"),
    ("built", "a small boat", "the ferry had been cancelled"),
    ("found", "a lost dog", "its owner had posted a note"),
    ("taught", "a chess class", "the children had asked for one"),
    ("cleaned", "the river bank", "plastic was harming the birds"),
    ("fixed", "the broken lights", "the path was dark at night"),
]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
DETAILS = [
    "It was raining a little that morning.",
    "A radio was playing old songs nearby.",
    "Someone had left a blue umbrella by the gate.",
    "The coffee in the flask had gone cold.",
    "Two cats watched from a wall.",
    "The bus was ten minutes late.",
]


def row(rng: random.Random, index: int) -> dict[str, str]:
    person, place, day = rng.choice(PEOPLE), rng.choice(PLACES), rng.choice(DAYS)
    verb, thing, reason = rng.choice(ACTIONS)
    details = rng.sample(DETAILS, 2)
    passage = (
        f"On {day}, {person} went to {place}. {details[0]} {person} {verb} {thing} there, because {reason}. "
        f"{details[1]} By the evening the work was done."
    )
    return {
        "id": f"summary-{index:04d}",
        "prompt": f"Summarize this passage in one short sentence.\n\n{passage}",
        "ground_truth": f"{person} {verb} {thing} at {place} because {reason}.",
        # SFT's target (without it SFT would teach the exact kind's \\boxed{} form): the reference itself
        "completion": f"{person} {verb} {thing} at {place} because {reason}.",
    }


def main(rows: int = 400) -> Path:
    rng = random.Random(0)
    target = Path(__file__).resolve().parents[1] / "configs" / "data" / "summaries.jsonl"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("".join(json.dumps(row(rng, i)) + "\n" for i in range(rows)))
    return target


if __name__ == "__main__":
    print(main(int(sys.argv[1]) if len(sys.argv) > 1 else 400))
