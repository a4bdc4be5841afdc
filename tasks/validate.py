"""Stage 1, validate: load rows, normalize ``ground_truth``, check with Great Expectations, quarantine bad rows
with reasons, and split train / hold-out by a hash of the normalized prompt.
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
import re
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

from prefect import task

from reward_fns.label import normalize_exact
from reward_fns.math import parse_gold, plain_number
from reward_fns.text import last_boxed
from tasks.caching import stage_cache_key
from tasks.config import DataSettings, PipelineConfig
from tasks.data import _Unreadable, load_rows, write_jsonl
from tasks.reporting import publish_markdown
from tasks.tracking import Tracker

_UNIT_SUFFIX = re.compile(r"^([-+]?[\d.,]+)\s*(?:[a-zA-Z]+\.?|%)$")
_THOUSANDS = re.compile(r"^[-+]?\d{1,3}(,\d{3})+(\.\d+)?$")


class RowProblem(ValueError):
    """Why one row cannot be used: every reason found, not only the first."""

    def __init__(self, *reasons: str) -> None:
        super().__init__("; ".join(reasons))
        self.reasons = list(reasons)


class QuarantineLimitExceeded(RuntimeError):
    """More rows were rejected than the config allows; the quarantine file says which and why."""


@dataclass
class ValidateResult:
    train_path: Path
    holdout_path: Path
    quarantine_path: Path
    report_path: Path
    rows_in: int
    rows_kept: int
    rows_quarantined: int
    rows_train: int
    rows_holdout: int
    fingerprint: str
    reasons: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(self).items()}


def _canonical_number(value: Decimal) -> str:
    text = format(value.normalize(), "f")
    return "0" if text in ("-0", "+0") else text


def normalize_math(raw: Any) -> str:
    """A math answer as the rewards compare it: boxed or ``####`` extracted, ``$``/units/commas stripped.

    >>> [normalize_math(x) for x in ["#### 1,234", r"\\boxed{\\frac{1}{2}}", "$5.50", "12 apples", 7, 3.0]]
    ['1234', '\\\\frac{1}{2}', '5.5', '12', '7', '3']
    >>> normalize_math("\\\\frac{")
    Traceback (most recent call last):
    ...
    tasks.validate.RowProblem: math answer '\\\\frac{' is not parseable by math-verify
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
    if _THOUSANDS.match(text):
        text = text.replace(",", "")
    if not text:
        raise RowProblem("math answer is empty after normalization")
    number = plain_number(text) if "," not in text else None
    if number is not None:
        return _canonical_number(number)
    if not parse_gold(text):
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
    if completion is not None and not isinstance(completion, str):
        raise RowProblem(f"completion has type {type(completion).__name__}, expected a string")


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
    row_id = row.get("id")
    if row_id is not None and (isinstance(row_id, bool) or not isinstance(row_id, str | int)):
        raise RowProblem(f"id has type {type(row_id).__name__}, expected a string or integer")


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


def _gx_audit(
    kept: list[dict[str, Any]], settings: DataSettings, docs_dir: Path | None = None, texts: list[str] | None = None
) -> tuple[dict[str, list[str]], dict[str, Any]]:
    """Run the Great Expectations suite over the kept rows through a checkpoint (which builds Data Docs into
    ``docs_dir`` when given); returns the failing ids with expectation names, and a summary."""
    import great_expectations as gx
    import pandas as pd

    frame = pd.DataFrame(
        {
            "id": [row["id"] for row in kept],
            "prompt_text": texts if texts is not None else [prompt_text(row["prompt"]) for row in kept],
            "ground_truth": [row["ground_truth"] for row in kept],
        }
    )
    frame["prompt_chars"] = frame["prompt_text"].str.len()
    context = gx.get_context(mode="ephemeral")
    actions = []
    if docs_dir is not None:
        context.add_data_docs_site(
            site_name="grpoflow",
            site_config={
                "class_name": "SiteBuilder",
                "store_backend": {
                    "class_name": "TupleFilesystemStoreBackend",
                    "base_directory": str(docs_dir.resolve()),  # GX wants an absolute path
                },
                "site_index_builder": {"class_name": "DefaultSiteIndexBuilder"},
            },
        )
        actions.append(gx.checkpoint.UpdateDataDocsAction(name="data-docs", site_names=["grpoflow"]))
    batch_definition = (
        context.data_sources.add_pandas("grpoflow")
        .add_dataframe_asset("rows")
        .add_batch_definition_whole_dataframe("all")
    )
    expectations = [
        *(gx.expectations.ExpectColumnToExist(column=c) for c in ("id", "prompt_text", "ground_truth")),
        gx.expectations.ExpectColumnValuesToNotBeNull(column="id"),
        gx.expectations.ExpectColumnValuesToBeUnique(column="id"),
        gx.expectations.ExpectColumnValuesToNotBeNull(column="prompt_text"),
        gx.expectations.ExpectColumnValuesToMatchRegex(column="prompt_text", regex=r"\S"),
        gx.expectations.ExpectColumnValuesToBeBetween(
            column="prompt_chars", min_value=settings.min_prompt_chars, max_value=settings.max_prompt_chars
        ),
        gx.expectations.ExpectColumnValuesToNotBeNull(column="ground_truth"),
        gx.expectations.ExpectColumnValuesToMatchRegex(column="ground_truth", regex=r"\S"),
    ]
    if settings.kind == "label" and settings.labels:  # rows may instead carry their own 'labels'
        expectations.append(
            gx.expectations.ExpectColumnValuesToBeInSet(column="ground_truth", value_set=settings.labels)
        )
    suite = context.suites.add(gx.ExpectationSuite(name="grpoflow-rows", expectations=expectations))
    definition = context.validation_definitions.add(
        gx.ValidationDefinition(name="grpoflow-rows", data=batch_definition, suite=suite)
    )
    checkpoint = context.checkpoints.add(
        gx.Checkpoint(
            name="grpoflow-validate",
            validation_definitions=[definition],
            actions=actions,
            result_format={"result_format": "COMPLETE", "unexpected_index_column_names": ["id"]},
        )
    )
    result = next(iter(checkpoint.run(batch_parameters={"dataframe": frame}).run_results.values()))
    failing: dict[str, list[str]] = {}
    for outcome in result.results:
        if outcome.success:
            continue
        name = f"{outcome.expectation_config.type}({outcome.expectation_config.kwargs.get('column')})"
        for index in outcome.result.get("unexpected_index_list") or []:
            row_id = index["id"] if isinstance(index, dict) else kept[index]["id"]
            failing.setdefault(str(row_id), []).append(f"great_expectations: {name} failed")
    summary = {"success": bool(result.success), "statistics": dict(result.statistics)}
    return failing, summary


def validate_rows(
    raw_rows: Sequence[Any], settings: DataSettings, docs_dir: Path | None = None
) -> tuple[list[dict], list[dict], dict]:
    """Split raw rows into kept (normalized) rows and quarantined records, each with every reason."""
    quarantined: list[dict[str, Any]] = []
    candidates: list[tuple[int, dict[str, Any], str]] = []
    for index, row in enumerate(raw_rows):
        try:
            checked, text = check_row(row, settings)
        except RowProblem as exc:
            original = {"line": row.line_number, "text": row.text} if isinstance(row, _Unreadable) else row
            quarantined.append({"row_index": index, "row": original, "reasons": exc.reasons})
            continue
        checked["id"] = str(checked.get("id", f"row-{index}"))
        candidates.append((index, checked, text))

    # Duplicates: same content twice → keep the first; an id reused with other content → later rows out;
    # one normalized prompt with different ground truths → every such row out.
    truths_by_prompt: dict[str, set[str]] = {}
    for _, row, key in candidates:
        truths_by_prompt.setdefault(key, set()).add(row["ground_truth"])
    seen_content: dict[str, str] = {}
    seen_ids: dict[str, str] = {}
    kept: list[dict[str, Any]] = []
    kept_texts: list[str] = []
    for index, row, key in candidates:
        content = json.dumps({k: v for k, v in row.items() if k != "id"}, sort_keys=True, default=str)
        reasons = []
        if len(truths_by_prompt[key]) > 1:
            reasons.append(f"conflicting ground truth: this prompt also has {sorted(truths_by_prompt[key])}")
        if row["id"] in seen_ids and seen_ids[row["id"]] != content:
            reasons.append(f"id {row['id']!r} reused with other content")
        elif content in seen_content:
            reasons.append(f"duplicate of row {seen_content[content]!r}")
        if reasons:
            quarantined.append({"row_index": index, "row": raw_rows[index], "reasons": reasons})
            continue
        seen_ids.setdefault(row["id"], content)
        seen_content[content] = row["id"]
        kept.append(row)
        kept_texts.append(key)

    gx_summary: dict[str, Any] = {"success": True, "statistics": {}}
    if kept:
        failing, gx_summary = _gx_audit(kept, settings, docs_dir, kept_texts)
        if failing:
            still_kept = []
            for row in kept:
                if row["id"] in failing:
                    quarantined.append({"row_index": None, "row": row, "reasons": failing[row["id"]]})
                else:
                    still_kept.append(row)
            kept = still_kept
    return kept, quarantined, gx_summary


def reason_counts(quarantined: Sequence[dict[str, Any]]) -> dict[str, int]:
    """How many rows each kind of reason rejected (the reason text up to its first colon or quote)."""
    counts: dict[str, int] = {}
    for record in quarantined:
        for reason in record["reasons"]:
            head = re.split(r"[:'\"(\d]", reason, maxsplit=1)[0].strip()
            counts[head] = counts.get(head, 0) + 1
    return counts


def run_validate(config: PipelineConfig, stage_dir: Path) -> ValidateResult:
    """Load, normalize, check, quarantine and split; writes train / holdout / quarantine JSONL and a report."""
    if config.data.kind == "code":  # fail before any compute when model-written code could not be isolated
        from reward_fns.sandbox import detect_isolation

        detect_isolation()
    raw_rows = load_rows(config.data, config.seed)
    kept, quarantined, gx_summary = validate_rows(raw_rows, config.data, stage_dir / "data_docs")
    sides = [holdout_side(row["prompt"], config.data.holdout_fraction) for row in kept]
    train = [row for row, side in zip(kept, sides, strict=True) if not side]
    holdout = [row for row, side in zip(kept, sides, strict=True) if side]
    result = ValidateResult(
        train_path=stage_dir / "train.jsonl",
        holdout_path=stage_dir / "holdout.jsonl",
        quarantine_path=stage_dir / "quarantine.jsonl",
        report_path=stage_dir / "report.json",
        rows_in=len(raw_rows),
        rows_kept=len(kept),
        rows_quarantined=len(quarantined),
        rows_train=len(train),
        rows_holdout=len(holdout),
        fingerprint=fingerprint(kept),
        reasons=reason_counts(quarantined),
    )
    write_jsonl(result.train_path, train)
    write_jsonl(result.holdout_path, holdout)
    write_jsonl(result.quarantine_path, quarantined)
    result.report_path.write_text(json.dumps({**result.to_json(), "great_expectations": gx_summary}, indent=2))
    return result


def enforce_limits(result: ValidateResult, config: PipelineConfig) -> None:
    """Fail when too many rows were quarantined, or the split left a side empty."""
    share = result.rows_quarantined / result.rows_in if result.rows_in else 1.0
    if not result.rows_kept or share > config.data.max_quarantine_share:
        raise QuarantineLimitExceeded(
            f"{result.rows_quarantined}/{result.rows_in} rows quarantined ({share:.0%}), over the configured "
            f"maximum of {config.data.max_quarantine_share:.0%}; reasons: {result.reasons}; "
            f"see {result.quarantine_path}"
        )
    if not result.rows_train or not result.rows_holdout:
        raise QuarantineLimitExceeded(
            f"split left {result.rows_train} train and {result.rows_holdout} hold-out rows; need both non-empty "
            f"(data.holdout_fraction={config.data.holdout_fraction})"
        )


@task(name="validate", cache_key_fn=stage_cache_key, persist_result=True)
def validate_task(config: PipelineConfig, tracker: Tracker) -> ValidateResult:
    """Prefect wrapper: run the stage in its MLflow run, log counts and files, publish a summary artifact."""
    with tracker.stage("validate") as stage:
        result = run_validate(config, stage.dir)
        stage.log_metrics(
            {
                "rows_in": result.rows_in,
                "rows_kept": result.rows_kept,
                "rows_quarantined": result.rows_quarantined,
                "rows_train": result.rows_train,
                "rows_holdout": result.rows_holdout,
            }
        )
        stage.set_tags({"data_fingerprint": result.fingerprint, "data_source": config.data.source})
        for path in (result.report_path, result.quarantine_path):
            stage.log_artifact(path, "validate")
        stage.log_artifact(stage.dir / "data_docs", "validate/data_docs")
        reasons = (
            "\n".join(f"| {reason} | {count} |" for reason, count in sorted(result.reasons.items())) or "| — | 0 |"
        )
        publish_markdown(
            "validate",
            f"### validate\n{result.rows_in} rows in = {result.rows_kept} kept + {result.rows_quarantined} "
            f"quarantined; split {result.rows_train} train / {result.rows_holdout} hold-out; "
            f"fingerprint `{result.fingerprint}`\n\n| reason | rows |\n|---|---|\n{reasons}\n",
        )
        enforce_limits(result, config)
        return result
