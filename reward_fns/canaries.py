"""Reward canaries: frozen, labelled completions with the reward each function must give them. Each task kind
ships a set (``reward_fns/canaries/<kind>.jsonl``): correct answers in accepted forms, wrong answers, and known
hacks (hedged boxes, an echoed prompt, an empty box, answer-stuffing, code that exits before its tests, an
always-equal object, JSON that breaks its schema, a label not in the set). The validate stage scores the
configured rewards on them before any model loads, so a parser or dependency change that makes a reward silently
wrong stops the run instead of training on it.

One case per line::

    {"case": "hedged: two boxed answers", "completion": "\\\\boxed{41} or \\\\boxed{42}",
     "columns": {"ground_truth": "42"}, "expect": {"math_accuracy": 0.0, "boxed_format": 0.0}}

``completion`` is text or a chat message list; ``columns`` are the dataset columns the functions receive;
``expect`` maps a reward's name to its reward: a number, ``null`` (cannot judge), or the name of one of the
function's arguments (its configured value, else its default: partial credit such as ``parse_credit``). Rewards a
case does not name are not checked on it.

Must not import: Prefect, MLflow, torch, ``tasks``.

>>> cases = load_canaries(CANARY_DIR / "math.jsonl")
>>> funcs, _ = __import__("reward_fns.registry").registry.build_reward_functions([{"name": "math_accuracy"}])
>>> check_canaries(funcs, [{"name": "math_accuracy"}], cases)
[]
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CANARY_DIR = Path(__file__).parent / "canaries"


class CanaryFileError(ValueError):
    """A canaries file that cannot be read; names the file and line."""


@dataclass
class Disagreement:
    """A reward that judged a canary otherwise than expected."""

    function: str
    case: str
    source: str  # file:line
    expected: float | None
    got: float | None | str

    def describe(self) -> str:
        return f"{self.function} on {self.case!r} ({self.source}): expected {self.expected}, got {self.got}"


def load_canaries(path: Path) -> list[dict[str, Any]]:
    """The cases of one canaries file, each with its ``source`` (file:line); raises CanaryFileError naming the
    line of a malformed case."""
    cases = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{Path(path).name}:{number}"
        try:
            case = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CanaryFileError(f"{path}:{number}: not JSON: {exc}") from exc
        missing = [key for key in ("case", "completion", "expect") if key not in case]
        if missing or not isinstance(case.get("expect"), dict) or not isinstance(case.get("columns", {}), dict):
            raise CanaryFileError(
                f"{path}:{number}: a canary needs 'case', 'completion', 'expect' (a mapping) and optional "
                f"'columns' (a mapping); missing: {', '.join(missing) or 'none'}"
            )
        cases.append({**case, "columns": case.get("columns", {}), "source": where})
    return cases


def kind_canaries(kind: str) -> list[dict[str, Any]]:
    """The canaries shipped for a task kind (none for a kind without a file)."""
    path = CANARY_DIR / f"{kind}.jsonl"
    return load_canaries(path) if path.is_file() else []


def _expected(value: Any, function: Any, args: Mapping[str, Any]) -> float | None:
    """A case's expected reward: a number, None, or an argument's configured value (else its default)."""
    if value is None or isinstance(value, int | float):
        return None if value is None else float(value)
    if value in args:
        return float(args[value])
    parameter = inspect.signature(function).parameters.get(value)
    if parameter is None or parameter.default is inspect.Parameter.empty:
        raise CanaryFileError(f"expectation {value!r} names no argument of {getattr(function, '__name__', function)}")
    return float(parameter.default)


def check_canaries(
    rewards: Sequence[Any], specs: Sequence[Any], cases: Sequence[Mapping[str, Any]]
) -> list[Disagreement]:
    """Score each reward (as ``build_reward_functions`` wraps it: args bound, errors caught) on the cases that
    name it, one call per set of columns; returns every disagreement."""
    found: list[Disagreement] = []
    for reward, spec in zip(rewards, specs, strict=True):
        item = spec if isinstance(spec, Mapping) else spec.model_dump()
        name = reward.__name__
        mine = [case for case in cases if name in case["expect"]]
        by_columns: dict[tuple[str, ...], list[Mapping[str, Any]]] = {}
        for case in mine:
            by_columns.setdefault(tuple(sorted(case["columns"])), []).append(case)
        for columns, group in by_columns.items():
            kwargs = {column: [case["columns"][column] for case in group] for column in columns}
            got = reward(completions=[case["completion"] for case in group], **kwargs)
            error = getattr(getattr(reward, "stats", None), "last_error", None)
            for case, value in zip(group, got, strict=True):
                expected = _expected(case["expect"][name], reward.function, item.get("args") or {})
                same = (value is None and expected is None) or (
                    value is not None and expected is not None and abs(value - expected) <= 1e-6
                )
                if not same:
                    shown = f"None (error: {error})" if value is None and error else value
                    found.append(Disagreement(name, case["case"], case["source"], expected, shown))
    return found
