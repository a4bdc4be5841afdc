"""Row checks: normalize ``ground_truth`` per task kind, check prompts, ids and per-kind columns, decide a row's
side of the train / hold-out split, and fingerprint the kept rows. Every rejection is a ``RowProblem`` that
carries all of the row's reasons.

Must not import: Prefect, MLflow, torch, transformers.
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
import re
import unicodedata
from collections.abc import Callable, Sequence
from decimal import Decimal
from typing import Any

from reward_fns.label import normalize_exact
from reward_fns.math import is_prose, parse_gold, partial_parse, plain_number
from reward_fns.text import last_boxed
from tasks.config import DataSettings
from tasks.inputs.loading import _Unreadable

_UNIT_SUFFIX = re.compile(r"^([-+]?[\d.,]+)\s*(?:[a-zA-Z]+\.?|%)$")
# Digits joined by commas with no space after them, and not thousands groups (``2,5``, ``0,111``, ``1,22``): a
# decimal comma or a list, and a gold answer cannot be both.
_AMBIGUOUS_COMMAS = re.compile(r"^[-+]?\d+(,\d+)+$")


class RowProblem(ValueError):
    """Why one row cannot be used: every reason found, not only the first."""

    def __init__(self, *reasons: str) -> None:
        super().__init__("; ".join(reasons))
        self.reasons = list(reasons)


def _canonical_number(value: Decimal) -> str:
    text = format(value.normalize(), "f")
    return "0" if text in ("-0", "+0") else text


def normalize_math(raw: Any) -> str:
    """A math answer as the rewards compare it: boxed or ``####`` extracted, ``$``/units/commas stripped.

    >>> [normalize_math(x) for x in ["#### 1,234", r"\\boxed{\\frac{1}{2}}", "$5.50", "12 apples", 7, 3.0, "4, 5"]]
    ['1234', '\\\\frac{1}{2}', '5.5', '12', '7', '3', '4, 5']
    >>> normalize_math("\\\\frac{")
    Traceback (most recent call last):
    ...
    tasks.inputs.rows.RowProblem: math answer '\\\\frac{' is not parseable by math-verify
    >>> normalize_math("2,5")
    Traceback (most recent call last):
    ...
    tasks.inputs.rows.RowProblem: math answer '2,5' is ambiguous: a decimal comma or a list? (write 2.5 or 2, 5)
    """
    if isinstance(raw, bool) or not isinstance(raw, str | int | float):
        raise RowProblem(f"ground_truth has type {type(raw).__name__}, expected a string or number")
    if isinstance(raw, float):
        if not math.isfinite(raw):
            raise RowProblem(f"ground_truth is {raw}")
        return _canonical_number(Decimal(repr(raw)))
    if isinstance(raw, int):
        return str(raw)
    text = raw.strip()
    if "####" in text:
        text = text.rsplit("####", 1)[1].strip()
    boxed = last_boxed(text)
    if boxed is not None:
        text = boxed
    text = text.strip().strip("$").strip().rstrip(".").strip()
    if unit := _UNIT_SUFFIX.match(text):
        text = unit.group(1)
    if not text:
        raise RowProblem("math answer is empty after normalization")
    number = plain_number(text)
    if number is not None:
        return _canonical_number(number)
    if _AMBIGUOUS_COMMAS.match(text):
        # Not thousands groups (``plain_number`` said so): one comma may be a decimal comma, several may group
        # digits another way (12,34,567 in Indian notation); or it is a list.
        number = text.replace(",", ".") if text.count(",") == 1 else text.replace(",", "")
        raise RowProblem(
            f"math answer {text!r} is ambiguous: a decimal comma or a list? (write {number} or "
            f"{text.replace(',', ', ')})"
        )
    if is_prose(text):
        raise RowProblem(f"math answer {text!r} is words, not a mathematical answer (use data.kind exact or label)")
    if not parse_gold(text):
        if (fragment := partial_parse(text)) is not None:
            raise RowProblem(
                f"math answer {text!r} is read only in part by math-verify (as {fragment}); rewrite it "
                "so that all of it is LaTeX math-verify parses"
            )
        raise RowProblem(f"math answer {text!r} is not parseable by math-verify")
    return text


def normalize_ground_truth(kind: str, raw: Any, labels: Sequence[str] | None = None) -> str:
    """The normalized ground truth for a task kind, or RowProblem naming what is wrong.

    >>> normalize_ground_truth("label", " Positive ", ["positive", "negative"])
    'positive'
    >>> normalize_ground_truth("json", '{"b": 1, "a": [1, 2]}')
    '{"a":[1,2],"b":1}'
    """
    if kind == "math":
        return normalize_math(raw)
    if not isinstance(raw, str):
        if kind == "json" and isinstance(raw, dict | list):
            raw = json.dumps(raw)
        elif kind in ("exact", "label") and isinstance(raw, int | float) and not isinstance(raw, bool):
            if isinstance(raw, float) and not math.isfinite(raw):
                raise RowProblem(f"ground_truth is {raw}")
            raw = str(raw)
        else:
            raise RowProblem(f"ground_truth has type {type(raw).__name__}, expected a string")
    if kind == "exact":
        value = normalize_exact(raw)
        if not value:
            raise RowProblem("ground_truth is empty")
        return value
    if kind == "label":
        wanted = normalize_exact(raw).casefold()
        for label in labels or ():
            if normalize_exact(label).casefold() == wanted:
                return label
        raise RowProblem(f"label {raw!r} is not in the allowed set {list(labels or ())}")
    if kind == "json":
        try:
            return json.dumps(json.loads(raw), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        except (json.JSONDecodeError, TypeError) as exc:
            raise RowProblem(f"ground_truth is not valid JSON: {exc}") from exc
    if kind == "code":
        return raw
    raise RowProblem(f"unknown task kind {kind!r}")


def _check_text(name: str, value: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RowProblem(f"{name} holds invalid UTF-8 (lone surrogate)") from exc
    if not value.strip():
        raise RowProblem(f"{name} is empty or whitespace")
    if not any(character.isprintable() and not character.isspace() for character in value):
        raise RowProblem(f"{name} has no printable characters")


def prompt_text(prompt: Any) -> str:
    """The prompt's words (message contents joined), used for length checks, duplicates and the split."""
    if isinstance(prompt, str):
        return unicodedata.normalize("NFKC", prompt).strip()
    return "\n".join(f"{m['role']}: {unicodedata.normalize('NFKC', m['content']).strip()}" for m in prompt)


def _check_prompt(prompt: Any, settings: DataSettings) -> str:
    """Check a prompt's shape and length; returns its normalized text (see ``prompt_text``)."""
    if prompt is None or (isinstance(prompt, float) and math.isnan(prompt)):
        raise RowProblem("prompt is null")
    if isinstance(prompt, str):
        _check_text("prompt", prompt)
    elif isinstance(prompt, list):
        if not prompt:
            raise RowProblem("prompt is an empty message list")
        for position, message in enumerate(prompt):
            if not isinstance(message, dict) or set(message) - {"role", "content"} or "content" not in message:
                raise RowProblem(f"prompt message {position} is not a {{role, content}} object")
            if message.get("role") not in ("system", "user", "assistant"):
                raise RowProblem(f"prompt message {position} has role {message.get('role')!r}")
            if not isinstance(message["content"], str):
                raise RowProblem(f"prompt message {position} content is not a string")
            _check_text(f"prompt message {position} content", message["content"])
    else:
        raise RowProblem(f"prompt has type {type(prompt).__name__}, expected a string or a list of messages")
    text = prompt_text(prompt)
    if not settings.min_prompt_chars <= len(text) <= settings.max_prompt_chars:
        raise RowProblem(
            f"prompt is {len(text)} characters, outside [{settings.min_prompt_chars}, {settings.max_prompt_chars}]"
        )
    return text


def _check_extras(row: dict[str, Any], kind: str) -> None:
    if kind == "code":
        tests = row.get("tests")
        if not isinstance(tests, str) or not tests.strip():
            raise RowProblem("code row needs a non-empty 'tests' string")
        try:
            ast.parse(tests)
        except SyntaxError as exc:
            raise RowProblem(f"tests have a syntax error on line {exc.lineno}: {exc.msg}") from exc
        entry_point = row.get("entry_point")
        if entry_point is not None and not (isinstance(entry_point, str) and entry_point.isidentifier()):
            raise RowProblem(f"entry_point {entry_point!r} is not a Python name")
        if row.get("code_prefix") is not None and not isinstance(row["code_prefix"], str):
            raise RowProblem("code_prefix is not a string")
    if kind == "json" and "schema" in row:
        schema = row["schema"]
        try:
            if isinstance(schema, str):
                schema = json.loads(schema)
            import jsonschema

            jsonschema.validators.validator_for(schema).check_schema(schema)
        except Exception as exc:
            raise RowProblem(f"schema is not a valid JSON schema: {exc}") from exc
    completion = row.get("completion")
    if isinstance(completion, list) and not all(isinstance(message, dict) for message in completion):
        kinds = sorted({type(message).__name__ for message in completion if not isinstance(message, dict)})
        raise RowProblem(f"completion has type list of {', '.join(kinds)}, expected a string or a list of messages")
    if isinstance(completion, list):
        _check_trace(completion)
    elif completion is not None and not isinstance(completion, str):
        raise RowProblem(f"completion has type {type(completion).__name__}, expected a string or a list of messages")


def _check_trace(messages: list[Any]) -> None:
    """A tool trace (the row's ``completion`` as messages, what SFT learns to call tools from): assistant turns
    (text, tool calls ``{type: function, function: {name, arguments: object}}``) and tool answers, ending with an
    assistant turn that answers. Which tools it may call is the validate stage's check (``tools.use``).

    >>> _check_trace([{"role": "assistant", "content": "4"}])
    >>> _check_trace([{"role": "tool", "name": "python", "content": "4"}])
    Traceback (most recent call last):
    ...
    tasks.inputs.rows.RowProblem: completion message 0 is a tool answer with no call before it
    """
    if not messages:
        raise RowProblem("completion is an empty message list")
    calls = 0
    for position, message in enumerate(messages):
        where = f"completion message {position}"
        if not isinstance(message, dict) or message.get("role") not in ("assistant", "tool"):
            raise RowProblem(f"{where} is not an assistant or tool message")
        if not isinstance(message.get("content", ""), str):
            raise RowProblem(f"{where} content is not a string")
        if message["role"] == "tool":
            if calls <= 0:
                raise RowProblem(f"{where} is a tool answer with no call before it")
            calls -= 1
            continue
        for call in message.get("tool_calls") or []:
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise RowProblem(f"{where} has a tool call without a function name")
            if not isinstance(function.get("arguments", {}), dict | str):
                raise RowProblem(f"{where} calls {function['name']} with arguments that are not an object")
            calls += 1
    if messages[-1]["role"] != "assistant" or messages[-1].get("tool_calls"):
        raise RowProblem("completion does not end with an assistant turn that answers")


def trace_tools(completion: Any) -> set[str]:
    """The tools a row's trace calls (none for a plain completion).

    >>> sorted(trace_tools([{"role": "assistant", "tool_calls": [{"function": {"name": "python"}}]}])), trace_tools("4")
    (['python'], set())
    """
    if not isinstance(completion, list):
        return set()
    return {
        call["function"]["name"]
        for message in completion
        if isinstance(message, dict)
        for call in message.get("tool_calls") or []
    }


def _ground_truth(row: dict[str, Any], settings: DataSettings) -> str:
    raw_truth = row["ground_truth"]
    if raw_truth is None or (isinstance(raw_truth, float) and math.isnan(raw_truth)):
        raise RowProblem("ground_truth is null")
    if isinstance(raw_truth, str):
        _check_text("ground_truth", raw_truth)
    labels = row.get("labels") if isinstance(row.get("labels"), list) else settings.labels
    if settings.kind == "label" and not labels:
        raise RowProblem("no allowed label set: give data.labels or a 'labels' list on the row")
    return normalize_ground_truth(settings.kind, raw_truth, labels)


def _check_id(row: dict[str, Any]) -> None:
    """A row without an ``id`` key gets one from its position; an ``id`` that is there must be usable."""
    if "id" not in row:
        return
    row_id = row["id"]
    if row_id is None or (isinstance(row_id, float) and math.isnan(row_id)):
        raise RowProblem("id is null")
    if isinstance(row_id, bool) or not isinstance(row_id, str | int):
        raise RowProblem(f"id has type {type(row_id).__name__}, expected a string or integer")
    if isinstance(row_id, str) and not row_id.strip():
        raise RowProblem("id is empty")


def check_row(row: Any, settings: DataSettings) -> tuple[dict[str, Any], str]:
    """The usable form of one raw row (normalized ground truth beside the raw one) and its normalized prompt
    text, or RowProblem with every reason the row is unusable.

    >>> try:
    ...     check_row({"prompt": "", "ground_truth": None, "id": 1.5}, DataSettings())
    ... except RowProblem as problem:
    ...     problem.reasons
    ['prompt is empty or whitespace', 'ground_truth is null', 'id has type float, expected a string or integer']
    """
    if isinstance(row, _Unreadable):
        raise RowProblem(row.reason)
    if not isinstance(row, dict):
        raise RowProblem(f"row is a {type(row).__name__}, expected an object")
    reasons: list[str] = []

    def collect(check: Callable[[], Any]) -> Any:
        try:
            return check()
        except RowProblem as problem:
            reasons.extend(problem.reasons)
            return None

    reasons.extend(f"missing column {c!r}" for c in ("prompt", "ground_truth") if c not in row)
    text = collect(lambda: _check_prompt(row["prompt"], settings)) if "prompt" in row else None
    normalized = collect(lambda: _ground_truth(row, settings)) if "ground_truth" in row else None
    collect(lambda: _check_id(row))
    collect(lambda: _check_extras(row, settings.kind))
    if reasons:
        raise RowProblem(*reasons)
    return {**row, "ground_truth": normalized, "ground_truth_raw": row["ground_truth"]}, text


def holdout_side(prompt: Any, fraction: float) -> bool:
    """True when a prompt belongs to the hold-out side: a hash of its normalized text decides, so adding rows
    never moves old ones and equal prompts always land together.

    >>> holdout_side("What is 1+1?", 0.2) == holdout_side("What is 1+1?  ", 0.2)
    True
    """
    return text_holdout_side(prompt_text(prompt), fraction)


def text_holdout_side(text: str, fraction: float) -> bool:
    """``holdout_side`` for an already normalized prompt text."""
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def fingerprint(rows: Sequence[dict[str, Any]]) -> str:
    """A content hash of the kept, normalized rows (order-independent)."""
    lines = sorted(json.dumps(row, sort_keys=True, ensure_ascii=False, default=str) for row in rows)
    return hashlib.sha256("\n".join(lines).encode("utf-8")).hexdigest()[:16]
