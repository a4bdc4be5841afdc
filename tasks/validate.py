"""Stage 1, validate: load rows, normalize ``ground_truth``, check with Great Expectations, quarantine bad rows
with reasons, and split train / hold-out by a hash of the normalized prompt.
Must not import: another stage's module; Prefect and MLflow appear only in its task wrapper.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tasks import restore_defaults
from tasks.config import DataSettings, PipelineConfig
from tasks.config.grpo_steering import holdout_problems
from tasks.errors import GateStop, InfrastructureError, UserError
from tasks.inputs import RowProblem, check_row, fingerprint, gx_audit, holdout_side
from tasks.inputs.loading import _Unreadable, load_rows, write_jsonl
from tasks.layout import HOLDOUT_FILE, TEST_FILE, write_atomically
from tasks.tracking import Tracker, log_splits, prefect_task, publish_markdown, tracked_stage, validated_splits

logger = logging.getLogger(__name__)


class RewardCanaryFailed(GateStop, RuntimeError):
    """A configured reward judged a labelled canary completion otherwise than expected."""


class JudgeCanaryFailed(GateStop, RuntimeError):
    """A judge did not score the better answer of enough canary pairs higher (``canaries.judge_min_ordered``)."""


class QuarantineLimitExceeded(UserError, RuntimeError):
    """More rows were rejected than the config allows; the quarantine file says which and why."""


@dataclass
class ValidateResult:
    __setstate__ = restore_defaults  # results pickled before a field was added load with its default

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
    rows_unreadable: int = 0  # lines that were not JSON or not UTF-8 (counted among the quarantined)
    # each split's content fingerprint (its MLflow dataset digest) and the kept rows' columns; empty in results
    # pickled before they existed (the class defaults answer for them)
    train_digest: str = ""
    holdout_digest: str = ""
    columns: list[str] = field(default_factory=list)
    judge_canaries: list[dict[str, Any]] = field(default_factory=list)  # one report per judge (judges only)
    tools: dict[str, Any] = field(default_factory=dict)  # with tools: the template, the canaries, the sizes
    sandbox: str = ""  # where model-written code runs (code rewards, the python tool), once checked; else empty
    test_path: Path | None = None  # data.test_source's rows, which evaluation scores (None: the hold-out)
    test: dict[str, Any] = field(default_factory=dict)  # the test source: rows in, kept, quarantined, leaks

    def to_json(self) -> dict[str, Any]:
        return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(self).items()}


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
        failing, gx_summary = gx_audit(kept, settings, docs_dir, kept_texts)
        if failing:
            still_kept = []
            for row in kept:
                if row["id"] in failing:
                    quarantined.append({"row_index": None, "row": row, "reasons": failing[row["id"]]})
                else:
                    still_kept.append(row)
            kept = still_kept
    return kept, quarantined, gx_summary


_QUOTED = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"")
_NUMBER = re.compile(r"(?<![\w.-])-?\d+(?:\.\d+)?(?![\w-])")


def reason_label(reason: str) -> str:
    """A reason without its row's particulars, so rows rejected for the same thing count together: the part
    before the first ': ' (what follows is detail), quoted values as '…', numbers as N.

    >>> reason_label("prompt is 3 characters, outside [5, 2000]"), reason_label("invalid UTF-8: 'utf-8' codec")
    ('prompt is N characters, outside [N, N]', 'invalid UTF-8')
    >>> reason_label("math answer 'see it' is words, not a mathematical answer")
    "math answer '…' is words, not a mathematical answer"
    """
    head = reason.split(": ", 1)[0]
    return _NUMBER.sub("N", _QUOTED.sub("'…'", head)).strip()


def reason_counts(quarantined: Sequence[dict[str, Any]]) -> dict[str, int]:
    """How many rows each kind of reason rejected (``reason_label``)."""
    counts: dict[str, int] = {}
    for record in quarantined:
        for reason in record["reasons"]:
            label = reason_label(reason)
            counts[label] = counts.get(label, 0) + 1
    return counts


def check_reward_canaries(config: PipelineConfig, stage_dir: Path) -> dict[str, Any]:
    """Score the configured rewards on the task kind's canaries (and ``canaries.file``'s); writes
    ``canaries.json`` and raises RewardCanaryFailed naming function, case, expected and got on any disagreement.
    Rewards no canary names are listed as unchecked."""
    from reward_fns.canaries import CanaryFileError, check_canaries, kind_canaries, load_canaries
    from reward_fns.registry import build_reward_functions
    from tasks.evaluation import verdict_cache

    report: dict[str, Any] = {"enabled": config.canaries.enabled}
    if not config.canaries.enabled:
        return report
    try:
        cases = kind_canaries(config.data.kind)
        if config.canaries.file is not None:
            cases += load_canaries(Path(config.canaries.file))
    except (CanaryFileError, OSError) as exc:
        raise UserError(f"canaries.file: {exc}") from exc
    rewards, _ = build_reward_functions(config.rewards, verdict_cache(config.rewards))
    disagreements = check_canaries(rewards, config.rewards, cases)
    checked = {r.__name__: sum(r.__name__ in case["expect"] for case in cases) for r in rewards}
    report.update(
        cases=len(cases),
        checks=checked,
        unchecked=[name for name, count in checked.items() if not count],
        disagreements=[vars(d) for d in disagreements],
    )
    stage_dir.mkdir(parents=True, exist_ok=True)
    write_atomically(stage_dir / "canaries.json", json.dumps(report, indent=2, default=str))
    if disagreements:
        more = f"; {len(disagreements) - 1} more in {stage_dir / 'canaries.json'}" if len(disagreements) > 1 else ""
        raise RewardCanaryFailed(
            f"reward canary failed: {disagreements[0].describe()}{more}\n"
            "a reward judges a known case wrongly (a parser or dependency change?): fix it before training on it"
            + ("" if config.canaries.file else ", or give a custom reward its cases in canaries.file")
        )
    return report


def run_validate(config: PipelineConfig, stage_dir: Path) -> ValidateResult:
    """Check the rewards on their canaries; load, normalize, check, quarantine and split; writes train / holdout /
    quarantine JSONL and a report."""
    sandbox = checked_sandbox() if runs_model_code(config) else ""  # before any compute
    check_reward_canaries(config, stage_dir)
    toolbox, tool_report = check_tools(config, stage_dir)
    raw_rows = load_rows(config.data, config.seed)
    kept, quarantined, gx_summary = validate_rows(raw_rows, config.data, stage_dir / "data_docs")
    kept = quarantine_unknown_tools(kept, quarantined, toolbox.names if toolbox else [])
    if toolbox is not None and kept:
        tool_report |= size_tools(config, toolbox, kept)
    test, test_report = [], {}
    if config.data.test_source:
        test, test_quarantined, test_report = load_test_source(config, stage_dir)
        kept, leaks = without_leaks(kept, test)
        quarantined += leaks
        quarantined += test_quarantined
        test_report["leaks"] = len(leaks)
    sides = [holdout_side(row["prompt"], config.data.holdout_fraction) for row in kept]
    train = [row for row, side in zip(kept, sides, strict=True) if not side]
    holdout = [row for row, side in zip(kept, sides, strict=True) if side]
    result = ValidateResult(
        train_path=stage_dir / "train.jsonl",
        holdout_path=stage_dir / HOLDOUT_FILE,
        quarantine_path=stage_dir / "quarantine.jsonl",
        report_path=stage_dir / "report.json",
        rows_in=len(raw_rows),
        rows_kept=len(kept),
        rows_quarantined=len(quarantined),
        rows_train=len(train),
        rows_holdout=len(holdout),
        fingerprint=fingerprint(kept),
        reasons=reason_counts(quarantined),
        rows_unreadable=sum(isinstance(row, _Unreadable) for row in raw_rows),
        train_digest=fingerprint(train),
        holdout_digest=fingerprint(holdout),
        columns=sorted({key for row in kept for key in row}),
        tools=tool_report,
        sandbox=sandbox,
        test_path=stage_dir / TEST_FILE if config.data.test_source else None,
        test=test_report,
    )
    lost = result.rows_in + test_report.get("rows_in", 0) - result.rows_kept - len(test) - result.rows_quarantined
    if lost:  # nothing may be lost
        raise RuntimeError(
            f"validation lost rows: {result.rows_in} in, {result.rows_kept} kept + "
            f"{result.rows_quarantined} quarantined"
        )
    # Quarantine and report first: if anything fails, the train / hold-out files of an earlier run are kept.
    write_jsonl(result.quarantine_path, quarantined)
    write_jsonl(result.train_path, train)
    write_jsonl(result.holdout_path, holdout)
    if result.test_path is not None:
        write_jsonl(result.test_path, test)
    result.judge_canaries = check_judge_canaries(config, train, stage_dir)
    report = {**result.to_json(), "great_expectations": gx_summary}
    write_atomically(result.report_path, json.dumps(report, indent=2, ensure_ascii=True))
    return result


def load_test_source(config: PipelineConfig, stage_dir: Path) -> tuple[list[dict], list[dict], dict[str, Any]]:
    """``data.test_source`` read and checked as the training data is (the same columns, kind and row checks); its
    bad rows quarantined with their reasons, each marked ``source: test``."""
    settings = config.data.model_copy(update={"source": config.data.test_source, "split": config.data.test_split})
    raw = load_rows(settings, config.seed)
    kept, quarantined, _ = validate_rows(raw, settings, None)
    for record in quarantined:
        record["source"] = "test"
    report = {"source": f"{settings.source} ({settings.split})", "rows_in": len(raw), "rows_kept": len(kept)}
    report["rows_quarantined"] = len(quarantined)
    return kept, quarantined, report


def prompt_key(prompt: Any) -> str:
    """A prompt's text as the leak check compares it: case and runs of whitespace ignored.

    >>> prompt_key("What is  2+2?\\n") == prompt_key("what is 2+2?")
    True
    """
    from tasks.inputs import prompt_text

    return " ".join(prompt_text(prompt).lower().split())


def without_leaks(kept: list[dict], test: list[dict]) -> tuple[list[dict], list[dict]]:
    """The training rows whose prompt is not in the test set, and the others as quarantine records (a leak:
    evaluation would score a prompt the model trained on).

    >>> rows, leaks = without_leaks([{"prompt": "1+1?"}, {"prompt": "2+2?"}], [{"prompt": "2+2? "}])
    >>> rows, leaks[0]["reasons"]
    ([{'prompt': '1+1?'}], ['leak: data.test_source holds this prompt'])
    """
    tested = {prompt_key(row["prompt"]) for row in test}
    clean, leaks = [], []
    for row in kept:
        if prompt_key(row["prompt"]) in tested:
            leaks.append({"row_index": None, "row": row, "reasons": ["leak: data.test_source holds this prompt"]})
        else:
            clean.append(row)
    return clean, leaks


def runs_model_code(config: PipelineConfig) -> bool:
    """Whether the run executes model-written code: a code reward, or the built-in python tool."""
    from tasks.config import PYTHON_TOOL

    python_tool = config.tools.enabled and any(spec.name == PYTHON_TOOL for spec in config.tools.use)
    return config.data.kind == "code" or python_tool


def checked_sandbox() -> str:
    """Which sandbox model-written code will run in, once it proved it sees no host file (a planted canary);
    InfrastructureError (exit 4) when none can be built, before any compute."""
    from reward_fns.sandbox import SandboxUnavailable, verified_isolation

    try:
        described = verified_isolation()
    except SandboxUnavailable as exc:
        raise InfrastructureError(str(exc)) from None
    logger.info("sandbox: %s", described)
    return described


def check_tools(config: PipelineConfig, stage_dir: Path) -> tuple[Any, dict[str, Any]]:
    """With tools: build them (ToolError names a tool TRL cannot describe) and run their canaries
    (``tool_canaries.json``; ToolCanaryFailed); (None, {}) without. ``run_validate`` checks the sandbox first."""
    if not config.tools.enabled:
        return None, {}
    from tasks.environments import Toolbox, tool_canaries

    toolbox = Toolbox(config.tools)
    stage_dir.mkdir(parents=True, exist_ok=True)
    report = tool_canaries(toolbox, stage_dir / "tool_canaries.json")
    return toolbox, {"tools": toolbox.describe(), "canaries": len(report["cases"]), "unchecked": report["unchecked"]}


def quarantine_unknown_tools(kept: list[dict[str, Any]], quarantined: list[dict[str, Any]], names: list[str]) -> list:
    """Rows whose trace calls a tool the config does not have go to the quarantine (SFT could not replay them)."""
    from tasks.environments import unknown_tool_reason

    still_kept = []
    for row in kept:
        reason = unknown_tool_reason(row.get("completion"), names)
        if reason:
            quarantined.append({"row_index": None, "row": row, "reasons": [reason]})
        else:
            still_kept.append(row)
    return still_kept


def size_tools(config: PipelineConfig, toolbox: Any, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The model's template for tool turns (ChatTemplateError without one) and the token sizes of prompts with the
    tools' schemas, traces and one tool round against the configured lengths (ToolLengthError names the row). The
    model is resolved here (once; the flow's next step finds it), since only its tokenizer can count."""
    from tasks.environments import measure_tools, prepare_tokenizer
    from tasks.models import load_tokenizer, pipeline_backend, resolve_model_source

    tokenizer = load_tokenizer(resolve_model_source(config.model.source, config.model.revision))
    template = prepare_tokenizer(tokenizer, config.tools.chat_template, config.model.source)
    sizes = measure_tools(config, tokenizer, toolbox, rows, uses_vllm=pipeline_backend(config) == "vllm")
    logger.info("tools: %s; template: %s", sizes.summary(), template.describe())
    return {"template": template.describe(), "sizes": asdict(sizes), "sizes_summary": sizes.summary()}


def check_judge_canaries(config: PipelineConfig, train: list[dict[str, Any]], stage_dir: Path) -> list[dict[str, Any]]:
    """Each configured judge scores canary pairs (the training rows' reference answers against wrong and off-task
    ones, plus ``canaries.judge_file``'s); their reports, also in ``judge_canaries.json``. ``enforce_judges``
    stops the run on them once they are logged."""
    from reward_fns.judges import JUDGES
    from reward_fns.judges.checks import check_judge, pairs_from_file, pairs_from_rows
    from reward_fns.registry import build_reward_functions
    from tasks.evaluation import verdict_cache

    judges = [spec for spec in config.rewards if spec.name in JUDGES]
    if not judges or not config.canaries.enabled:
        return []
    pairs = pairs_from_rows(train, config.canaries.judge_pairs, config.seed)
    if config.canaries.judge_file is not None:
        try:
            pairs += pairs_from_file(Path(config.canaries.judge_file))
        except (OSError, ValueError) as exc:
            raise UserError(f"canaries.judge_file: {exc}") from exc
    if not pairs:
        logger.warning("no judge canary pairs: the data has no reference answers; write some in canaries.judge_file")
        return []
    rewards, _ = build_reward_functions(judges, verdict_cache(judges))
    reports = [check_judge(r.__name__, r, pairs, config.canaries.judge_min_ordered).to_json() for r in rewards]
    write_atomically(stage_dir / "judge_canaries.json", json.dumps(reports, indent=2, default=str))
    return reports


def enforce_judges(result: ValidateResult, stage_dir: Path) -> None:
    """Stop the run, before any training, on a judge that failed its canary pairs: the numbers in the message."""
    failed = [report for report in result.judge_canaries if not report["passed"]]
    if failed:
        r = failed[0]
        raise JudgeCanaryFailed(
            f"judge {r['judge']} ordered {r['ordered']}/{r['pairs']} canary pairs right ({r['ordered_share']:.0%} < "
            f"canaries.judge_min_ordered {r['threshold']:.0%}): {r['ties']} tied, {r['reversed']} reversed, "
            f"{r['unjudged']} unjudged{' (' + r['last_error'] + ')' if r.get('last_error') else ''}; see "
            f"{stage_dir / 'judge_canaries.json'}\n"
            + (
                "it gave no verdicts: is it up at its url? (grpoflow vllm-serve --judge MODEL serves one)"
                if r["unjudged"] == r["pairs"]
                else "it cannot tell a reference answer from a wrong or off-task one: fix its prompt, rubric or model"
            )
        )


def enforce_limits(result: ValidateResult, config: PipelineConfig) -> None:
    """Fail when too many rows were quarantined, or the split left a side empty; a user error when a setting
    does not fit the split (known here, before any model is loaded or trained)."""
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
    problems = holdout_problems(config.grpo, result.rows_holdout) if config.grpo.enabled else []
    if problems:
        raise UserError(f"validate: {problems[0]}")


@prefect_task("validate", cache="stage")
def validate_task(config: PipelineConfig, tracker: Tracker) -> ValidateResult:
    """Prefect wrapper: run the stage in its MLflow run, log counts and files, publish a summary artifact."""
    with tracked_stage(tracker, "validate") as stage:
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
        log_splits(stage.client, stage.run_id, validated_splits(result, config.data.source))
        for path in (result.report_path, result.quarantine_path):
            stage.log_artifact(path, "validate")
        stage.log_artifact(stage.dir / "data_docs", "validate/data_docs")
        for name in ("canaries.json", "judge_canaries.json", "tool_canaries.json"):
            if (stage.dir / name).is_file():
                stage.log_artifact(stage.dir / name, "validate")
        for report in result.judge_canaries:
            stage.log_metrics({f"judge_canaries/{report['judge']}/ordered_share": report["ordered_share"]})
        reasons = (
            "\n".join(f"| {reason} | {count} |" for reason, count in sorted(result.reasons.items())) or "| — | 0 |"
        )
        publish_markdown(
            "validate",
            f"### validate\n{result.rows_in} rows in = {result.rows_kept} kept + {result.rows_quarantined} "
            f"quarantined ({result.rows_unreadable} of them unreadable lines); "
            f"split {result.rows_train} train / {result.rows_holdout} hold-out; "
            f"fingerprint `{result.fingerprint}`\n\n| reason | rows |\n|---|---|\n{reasons}\n"
            + (
                f"\ntools: {', '.join(result.tools['tools']['methods'])}; {result.tools['sizes_summary']}; template: "
                f"{result.tools['template']}\n"
                if result.tools.get("sizes_summary")
                else ""
            ),
        )
        enforce_limits(result, config)
        enforce_judges(result, stage.dir)
        return result
