"""JSON rewards: the completion parses as JSON, validates against the row's schema, or equals the answer.
Must not import: Prefect, MLflow, torch, ``tasks``."""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any

from reward_fns.text import Completion, completion_text

_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.DOTALL)
_MISSING = object()


def extract_json(text: str) -> Any:
    """The JSON value in a completion: the last fenced block if any, else the whole text; ``_MISSING`` if none,
    or if fenced blocks hold different values.

    >>> extract_json('Here: ```json\\n{"a": 1}\\n```'), extract_json(' [1, 2] ')
    ({'a': 1}, [1, 2])
    >>> extract_json("not json") is _MISSING, extract_json('```{"a": 1}``` or ```{"a": 2}```') is _MISSING
    (True, True)
    """
    fenced = _FENCE.findall(text)
    values = [_parse(block) for block in fenced] if fenced else [_parse(text)]
    parsed = [value for value in values if value is not _MISSING]
    if len(fenced) > 1 and any(value != parsed[-1] for value in parsed):
        return _MISSING  # blocks with different values: hedging, no answer
    return values[-1]


def _parse(candidate: str) -> Any:
    try:
        return json.loads(candidate.strip())
    except (ValueError, RecursionError):  # RecursionError: adversarially deep nesting
        return _MISSING


@lru_cache(maxsize=4096)
def _validator(schema_text: str) -> Any:
    import jsonschema

    schema = json.loads(schema_text)
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)  # an invalid schema cannot judge anything: the caller turns this into None
    return cls(schema)


def _schema_text(schema: Any) -> str | None:
    if schema is None:
        return None
    return schema if isinstance(schema, str) else json.dumps(schema, sort_keys=True)


def json_schema(
    completions: list[Completion], schema: list[Any] | None = None, parse_credit: float = 0.0, **kwargs: Any
) -> list[float | None]:
    """1.0 when the completion's JSON validates against the row's ``schema``; ``parse_credit`` when it only
    parses; 0.0 when it does not parse. None when the row's schema is missing or invalid (cannot judge).

    >>> schema = '{"type": "object", "required": ["name"]}'
    >>> json_schema(completions=['{"name": "x"}', '{"age": 3}', "{oops"], schema=[schema] * 3, parse_credit=0.2)
    [1.0, 0.2, 0.0]
    """
    schemas = schema if schema is not None else [None] * len(completions)
    rewards: list[float | None] = []
    for completion, row_schema in zip(completions, schemas, strict=True):
        text = _schema_text(row_schema)
        try:
            validator = _validator(text) if text else None
        except Exception:
            validator = None
        if validator is None:
            rewards.append(None)
            continue
        value = extract_json(completion_text(completion))
        if value is _MISSING:
            rewards.append(0.0)
        else:
            rewards.append(1.0 if validator.is_valid(value) else float(parse_credit))
    return rewards


def json_match(completions: list[Completion], ground_truth: list[str], **kwargs: Any) -> list[float | None]:
    """1.0 when the completion's JSON equals the ground truth's JSON (key order and spacing ignored).

    >>> json_match(completions=['{"b": 2, "a": 1}', '{"a": 1}'], ground_truth=['{"a":1,"b":2}'] * 2)
    [1.0, 0.0]
    """
    rewards: list[float | None] = []
    for completion, gold in zip(completions, ground_truth, strict=True):
        try:
            expected = json.loads(gold)
        except (json.JSONDecodeError, TypeError):
            rewards.append(None)
            continue
        value = extract_json(completion_text(completion))
        rewards.append(float(value is not _MISSING and value == expected))
    return rewards
