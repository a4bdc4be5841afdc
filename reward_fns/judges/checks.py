"""Checks of a judge before it trains anything: canary pairs it must order right, and its biases measured.

A canary pair holds a better and a worse answer to one prompt: the data's reference answer against a wrong one
(another row's reference) and against an off-task one, or pairs a user writes (``canaries.judge_file``). A judge
that does not score the better one strictly higher on enough pairs stops the run in validate, with the numbers.
The bias probes run on the probe's own samples: length (the same answer padded with words that add nothing),
position (a pairwise judge's verdicts that changed with the order), and agreement with a verifiable reward the
data also has.
Must not import: ``tasks``, ``flows``, Prefect, MLflow.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from reward_fns.text import question_of

OFF_TASK = "I would rather not answer that. Let us talk about the weather instead: it is sunny today."
PADDING = (
    " To restate the answer above clearly and completely: the answer is as given above. I have checked it again "
    "carefully and I am confident that it is correct, complete and well reasoned."
)


@dataclass
class CanaryPair:
    """One prompt with a better and a worse answer, and the data columns the judge reads (its reference)."""

    prompt: Any
    better: str
    worse: str
    kind: str
    columns: dict[str, Any] = field(default_factory=dict)


def pairs_from_rows(rows: Sequence[Mapping[str, Any]], count: int, seed: int = 0) -> list[CanaryPair]:
    """Up to ``count`` canary pairs from rows that have a reference answer (``ground_truth``, or a
    ``reference_completion``): half against another row's answer, half against an off-task answer.

    >>> rows = [{"prompt": "2+2?", "ground_truth": "4"}, {"prompt": "3+3?", "ground_truth": "6"}]
    >>> [(p.better, p.worse == OFF_TASK and "off-task" or p.worse, p.kind) for p in pairs_from_rows(rows, 2)]
    [('The answer is 4.', 'The answer is 6.', 'wrong'), ('The answer is 6.', 'off-task', 'off_task')]
    """

    def answer(row: Mapping[str, Any]) -> str | None:
        if row.get("reference_completion"):
            return str(row["reference_completion"])
        return f"The answer is {row['ground_truth']}." if row.get("ground_truth") not in (None, "") else None

    usable = [row for row in rows if answer(row) is not None]
    chosen = random.Random(seed).sample(usable, min(count, len(usable))) if len(usable) > count else list(usable)
    pairs = []
    for index, row in enumerate(chosen):
        better = answer(row)
        others = [answer(r) for r in usable if answer(r) != better]
        columns = {k: v for k, v in row.items() if k not in ("prompt", "id")}
        if index % 2 == 0 and others:
            pairs.append(CanaryPair(row["prompt"], better, others[index % len(others)], "wrong", columns))
        else:
            pairs.append(CanaryPair(row["prompt"], better, OFF_TASK, "off_task", columns))
    return pairs


def pairs_from_file(path: Path) -> list[CanaryPair]:
    """Canary pairs a user wrote: JSONL lines ``{"prompt", "better", "worse"}`` plus any data columns the judge
    reads (``ground_truth``, ``reference_completion``); a bad line is an error naming the file and line."""
    pairs = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            pair = CanaryPair(item.pop("prompt"), str(item.pop("better")), str(item.pop("worse")), "file", item)
        except (ValueError, KeyError, AttributeError) as exc:
            raise ValueError(f"{path}, line {number}: a judge canary needs prompt, better and worse ({exc})") from None
        pairs.append(pair)
    return pairs


def _columns(pairs: Sequence[CanaryPair], repeat: int) -> dict[str, list[Any]]:
    names = list(dict.fromkeys(name for pair in pairs for name in pair.columns))
    return {name: [pair.columns.get(name) for pair in pairs] * repeat for name in names}


@dataclass
class CanaryReport:
    """How a judge ordered its canary pairs: ``ordered`` strictly right, ``ties``, ``reversed``, ``unjudged``
    (a None verdict), and the first pairs it got wrong."""

    judge: str
    pairs: int
    ordered: int
    ties: int
    reversed: int
    unjudged: int
    threshold: float
    failures: list[dict[str, Any]] = field(default_factory=list)
    last_error: str | None = None  # why verdicts were None (a judge that is down, slow or unreadable)

    @property
    def ordered_share(self) -> float:
        return self.ordered / self.pairs if self.pairs else 1.0

    @property
    def passed(self) -> bool:
        return self.ordered_share >= self.threshold

    def describe(self) -> str:
        return (
            f"judge {self.judge} ordered {self.ordered}/{self.pairs} canary pairs right ({self.ordered_share:.0%}; "
            f"threshold {self.threshold:.0%}): {self.ties} tied, {self.reversed} reversed, {self.unjudged} unjudged"
        )

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "ordered_share": self.ordered_share, "passed": self.passed}


def check_judge(
    name: str, reward: Callable[..., list[float | None]], pairs: Sequence[CanaryPair], threshold: float
) -> CanaryReport:
    """Score every pair's better and worse answer with ``reward`` (the wrapped judge, so its verdicts are cached
    and counted like training's) and count the pairs it orders strictly right."""
    prompts = [pair.prompt for pair in pairs]
    verdicts = reward(
        completions=[p.better for p in pairs] + [p.worse for p in pairs],
        prompts=prompts + prompts,
        **_columns(pairs, 2),
    )
    better, worse = verdicts[: len(pairs)], verdicts[len(pairs) :]
    report = CanaryReport(name, len(pairs), 0, 0, 0, 0, threshold)
    if None in verdicts:
        report.last_error = getattr(getattr(reward, "stats", None), "last_error", None)
    for pair, high, low in zip(pairs, better, worse, strict=True):
        if high is None or low is None:
            report.unjudged += 1
        elif high > low:
            report.ordered += 1
            continue
        elif high == low:
            report.ties += 1
        else:
            report.reversed += 1
        if len(report.failures) < 5:
            report.failures.append(
                {"kind": pair.kind, "prompt": question_of(pair.prompt)[:200], "better": high, "worse": low}
            )
    return report


def padded(completion: Any) -> Any:
    """``completion`` with ``PADDING`` appended to what the model said last: a text gets it at its end; a
    conversation (a tool rollout: a list of messages) gets it at the end of its last assistant message, the
    messages before it left as they were.

    >>> padded("4.").endswith(PADDING)
    True
    >>> turns = [{"role": "assistant", "content": "", "tool_calls": []}, {"role": "tool", "content": "4"},
    ...          {"role": "assistant", "content": "It is 4."}]
    >>> [m["content"].endswith(PADDING) for m in padded(turns)]
    [False, False, True]
    """
    if isinstance(completion, str):
        return completion + PADDING
    messages = [dict(message) for message in completion]
    for message in reversed(messages):
        if message.get("role") == "assistant":
            content = message.get("content")
            if isinstance(content, list):  # content parts
                message["content"] = [*content, {"type": "text", "text": PADDING}]
            else:
                message["content"] = (content or "") + PADDING
            return messages
    return [*messages, {"role": "assistant", "content": PADDING.strip()}]


def length_bias(
    reward: Callable[..., list[float | None]], prompts: Sequence[Any], completions: Sequence[Any], **columns: Any
) -> dict[str, float]:
    """The same answers padded with words that add nothing (texts, or conversations: ``padded``): the mean
    verdict gain and the share of answers the padding raised (a judge without length bias: about 0 and about 0).

    >>> judge = lambda completions, **kw: [min(1.0, len(c) / 400) for c in completions]  # pays for length
    >>> length_bias(judge, ["q"], ["The answer is 4."])["padded_higher_share"]
    1.0
    """
    plain = reward(completions=list(completions), prompts=list(prompts), **columns)
    longer = reward(completions=[padded(c) for c in completions], prompts=list(prompts), **columns)
    both = [(p, q) for p, q in zip(plain, longer, strict=True) if p is not None and q is not None]
    if not both:
        return {"length_gain": math.nan, "padded_higher_share": math.nan, "length_pairs": 0}
    return {
        "length_gain": sum(q - p for p, q in both) / len(both),
        "padded_higher_share": sum(q > p for p, q in both) / len(both),
        "length_pairs": len(both),
    }


def agreement(judged: Sequence[float | None], verifiable: Sequence[float | None]) -> dict[str, float]:
    """How a judge's verdicts follow a verifiable reward on the same completions: their correlation, and the
    judge's mean on correct and on incorrect ones.

    >>> agreement([0.9, 0.8, 0.1, 0.2], [1.0, 1.0, 0.0, 0.0])["correlation"] > 0.9
    True
    """
    both = [(j, v) for j, v in zip(judged, verifiable, strict=True) if j is not None and v is not None]
    right = [j for j, v in both if v >= 0.5]
    wrong = [j for j, v in both if v < 0.5]
    result = {
        "judged_on_correct": sum(right) / len(right) if right else math.nan,
        "judged_on_incorrect": sum(wrong) / len(wrong) if wrong else math.nan,
        "correlation": math.nan,
    }
    with contextlib.suppress(statistics.StatisticsError):  # fewer than two pairs, or one side constant
        result["correlation"] = statistics.correlation([j for j, _ in both], [v for _, v in both])
    return result
