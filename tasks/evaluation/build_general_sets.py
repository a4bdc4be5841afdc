"""Builds the general sets of the forgetting check (``tasks/evaluation/general_sets``), offline and deterministically:

- ``general_qa.jsonl``: multiple-choice questions, ``{id, category, question, choices, answers, source}``, scored by
  answer likelihood (the choice the model finds likeliest). Categories: arithmetic in words, number comparison,
  calendar and units, spelling, opposites, plurals, number sequences (generated from the templates and word lists
  below), and world facts (the 40 questions grpoflow shipped before, written for it; other facts' answers are the
  distractors).
- ``general_text.txt``: one document a line: the 15 passages grpoflow shipped before (written for it) and
  passages generated from the same facts in plain sentences.

Every item is generated here or was written for grpoflow, so the sets carry grpoflow's licence. They measure
drift on simple English and everyday facts — what a small model fine-tuned on a narrow task tends to lose — not
broad knowledge. Run ``python tasks/evaluation/build_general_sets.py`` to rebuild (the output is committed).
Must not import: anything beyond the standard library (a maintainer's script; the pipeline reads only its output).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).parent / "general_sets"
SEED = 20261201


def _pairs(text: str) -> list[tuple[str, str]]:
    """Word pairs written as ``"a b, c d"`` (a word list reads better as prose than one tuple a line).

    >>> _pairs("hot cold, big small")
    [('hot', 'cold'), ('big', 'small')]
    """
    return [tuple(pair.split()) for pair in text.split(", ")]


def _words(text: str) -> list[str]:
    """A word list written as prose: one string, words separated by spaces.

    >>> _words("zero one two")
    ['zero', 'one', 'two']
    """
    return text.split()


UNITS = _words(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen"
)
TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = _words("January February March April May June July August September October November December")
UNIT_FACTS = [
    ("How many days are in a week?", "7", "A week has seven days."),
    ("How many months are in a year?", "12", "A year has twelve months."),
    ("How many hours are in a day?", "24", "A day has twenty-four hours."),
    ("How many minutes are in an hour?", "60", "An hour has sixty minutes."),
    ("How many seconds are in a minute?", "60", "A minute has sixty seconds."),
    ("How many days are in a normal year?", "365", "A normal year has three hundred and sixty-five days."),
    ("How many centimetres are in a metre?", "100", "A metre is one hundred centimetres."),
    ("How many grams are in a kilogram?", "1000", "A kilogram is one thousand grams."),
    ("How many legs does a spider have?", "8", "A spider has eight legs."),
    ("How many legs does an insect have?", "6", "An insect has six legs."),
    ("How many sides does a triangle have?", "3", "A triangle has three sides."),
    ("How many sides does a square have?", "4", "A square has four sides."),
]
WORDS = _words(
    "garden window river pencil mountain yellow kitchen orange basket doctor island jacket ladder market needle "
    "rabbit summer tiger violin wagon zebra apple bridge candle dragon engine forest guitar hammer insect jungle "
    "kettle lemon mirror number ocean planet queen rocket silver tomato umbrella valley winter xylophone yogurt "
    "butter camera desert feather glove honey igloo jelly koala lantern meadow nest onion parrot"
)
OPPOSITES = _pairs(
    "hot cold, big small, fast slow, up down, open closed, happy sad, light dark, early late, full empty, old "
    "young, strong weak, hard soft, wet dry, high low, rich poor, thick thin, long short, loud quiet, push pull, "
    "buy sell, win lose, begin end, inside outside, left right, day night, north south, east west, true false, "
    "clean dirty, wide narrow, near far, first last, sweet sour, friend enemy, question answer, remember forget, "
    "arrive leave, accept refuse, always never, before after"
)
PLURALS = _pairs(
    "mouse mice, child children, foot feet, tooth teeth, man men, woman women, goose geese, person people, sheep "
    "sheep, leaf leaves, knife knives, wolf wolves, life lives, half halves, box boxes, bus buses, city cities, "
    "baby babies, party parties, dog dogs, book books, tree trees, car cars, house houses, glass glasses, church "
    "churches, dish dishes, potato potatoes, hero heroes, ox oxen, story stories, key keys, toy toys"
)


def words(n: int) -> str:
    """Numbers as English words, up to 99.

    >>> words(47), words(13), words(80)
    ('forty-seven', 'thirteen', 'eighty')
    """
    if n < 20:
        return UNITS[n]
    tens, units = divmod(n, 10)
    return TENS[tens] + (f"-{UNITS[units]}" if units else "")


def _item(category: str, question: str, answer: str, distractors: list[str], rng: random.Random) -> dict:
    choices = [answer, *dict.fromkeys(d for d in distractors if d != answer)][:4]
    rng.shuffle(choices)
    return {"category": category, "question": question, "choices": choices, "answers": [answer]}


def questions(rng: random.Random) -> list[dict]:
    items = []
    for _ in range(60):
        a, b = rng.randint(2, 40), rng.randint(2, 40)
        total = a + b
        items.append(
            _item(
                "arithmetic",
                f"What is {words(a)} plus {words(b)}?",
                str(total),
                [str(total + d) for d in rng.sample([-2, -1, 1, 2, 10, -10], 3)],
                rng,
            )
        )
    seen = set()
    while len(seen) < 60:
        a, b = rng.sample(range(10, 100), 2)
        if (a, b) in seen or a // 10 == a % 10:
            continue
        seen.add((a, b))
        items.append(_item("comparison", f"Which number is larger, {a} or {b}?", str(max(a, b)), [str(min(a, b))], rng))
    for cycle, asked in ((DAYS, "What day"), (MONTHS, "Which month")):  # the next and the previous of each
        for index, name in enumerate(cycle):
            for relation, answer in (("after", cycle[(index + 1) % len(cycle)]), ("before", cycle[index - 1])):
                others = rng.sample([other for other in cycle if other != answer], 3)
                items.append(_item("calendar", f"{asked} comes {relation} {name}?", answer, others, rng))
    for question, answer, _ in UNIT_FACTS:
        value = int(answer)
        items.append(_item("units", question, answer, [str(v) for v in (value * 2, value + 1, max(1, value - 2))], rng))
    for word in WORDS:
        letters = sorted(set("abcdefghijklmnopqrstuvwxyz") - {word[0]})
        items.append(
            _item("spelling", f"What is the first letter of the word '{word}'?", word[0], rng.sample(letters, 3), rng)
        )
    for word in WORDS[:30]:
        n = len(word)
        items.append(
            _item(
                "spelling",
                f"How many letters are in the word '{word}'?",
                str(n),
                [str(n - 1), str(n + 1), str(n + 2)],
                rng,
            )
        )
    for left, right in OPPOSITES:
        others = [w for pair in OPPOSITES for w in pair if w not in (left, right)]
        items.append(_item("opposites", f"What is the opposite of '{left}'?", right, rng.sample(others, 3), rng))
        items.append(_item("opposites", f"What is the opposite of '{right}'?", left, rng.sample(others, 3), rng))
    for singular, plural in PLURALS:
        wrong = [singular + "s", singular + "es", plural + "s"]
        items.append(_item("plurals", f"What is the plural of '{singular}'?", plural, wrong, rng))
    for _ in range(40):
        start, step = rng.randint(1, 20), rng.randint(2, 9)
        sequence = [start + step * i for i in range(4)]
        answer = start + step * 4
        items.append(
            _item(
                "sequences",
                f"What number comes next: {', '.join(map(str, sequence))}?",
                str(answer),
                [str(answer + 1), str(answer - 1), str(answer + step)],
                rng,
            )
        )
    facts = [json.loads(line) for line in (HERE / "general_qa_v1.jsonl").read_text().splitlines() if line.strip()]
    names = [item["answers"][0].title() for item in facts]
    for item in facts:
        answer = item["answers"][0].title()
        items.append(
            _item("world facts", item["question"], answer, rng.sample([n for n in names if n != answer], 3), rng)
        )
    unique = list({item["question"]: item for item in items}.values())  # a question asked twice counts once
    for index, item in enumerate(unique):
        item["id"] = f"g{index + 1:04d}"
        item["source"] = "grpoflow (written for it)" if item["category"] == "world facts" else "generated (templates)"
    return unique


def passages(rng: random.Random) -> list[str]:
    docs = [line for line in (HERE / "general_text_v1.txt").read_text().splitlines() if line.strip()]
    for index, day in enumerate(DAYS):
        docs.append(
            f"{day} comes after {DAYS[index - 1]} and before {DAYS[(index + 1) % 7]}. Many people plan "
            f"their week around it, and some shops keep different hours on {day}."
        )
    for index, month in enumerate(MONTHS):
        docs.append(
            f"{month} is month number {words(index + 1)} of the year. It follows {MONTHS[index - 1]}, and "
            f"when it ends, {MONTHS[(index + 1) % 12]} begins."
        )
    for _, _, sentence in UNIT_FACTS:
        docs.append(f"{sentence} Children usually learn this at school, and it is useful in everyday life.")
    for left, right in OPPOSITES:
        docs.append(
            f"The words '{left}' and '{right}' are opposites. If something is not {left}, it may well be "
            f"{right}, although many things lie somewhere in between."
        )
    for singular, plural in PLURALS[:20]:
        docs.append(
            f"We say one {singular} but two {plural}. English has many words whose plural follows its own "
            "rule, and learners remember them one by one."
        )
    for word in WORDS[:30]:
        docs.append(
            f"The word '{word}' has {words(len(word))} letters and begins with the letter {word[0]}. It is "
            "a common word that most readers know."
        )
    for _ in range(20):
        a, b = rng.randint(2, 40), rng.randint(2, 40)
        docs.append(
            f"If you have {words(a)} apples and someone gives you {words(b)} more, you have "
            f"{words(a + b)} apples in total."
        )
    return docs


def main() -> None:
    rng = random.Random(SEED)
    items = questions(rng)
    with (HERE / "general_qa.jsonl").open("w", encoding="utf-8") as handle:
        for item in items:
            handle.write(json.dumps(item, ensure_ascii=False) + "\n")
    docs = passages(rng)
    (HERE / "general_text.txt").write_text("\n".join(docs) + "\n", encoding="utf-8")
    print(f"{len(items)} questions, {len(docs)} passages")


if __name__ == "__main__":
    main()
