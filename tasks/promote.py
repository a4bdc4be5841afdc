"""Stage 6, promote: register the final adapter (and the SFT backup) with lineage tags, and move ``champion``
only when the candidate beats the current champion (or the base model, when there is none).

The decision reads one input (``PromotionCase``, taken from the evaluation by role) and the registry applies it
in one call (``tasks.registry.champions.apply_promotion``), inside a lock that serialises promotions of a model
(``tasks.registry.promotion_lock``).
Must not import: another stage's logic (it reads the evaluate stage's result types, nothing else); Prefect and
MLflow appear only in its task wrapper; registry calls go through ``tasks/registry/versions.py``.
"""

from __future__ import annotations

import functools
import logging
import subprocess
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from tasks.config import PipelineConfig, PromotionSettings
from tasks.evaluate import EvalResult, ModelScores
from tasks.evaluation import forgetting_metrics, forgetting_problem
from tasks.registry import RegistryError, apply_promotion, promotion_lock, register_adapter, short_description
from tasks.registry.packaging import adapter_in
from tasks.serving.records import DIGEST_TAG, adapter_digest
from tasks.tracking import (
    StageRun,
    Tracker,
    emit_pipeline_event,
    prefect_task,
    publish_markdown,
    tracked_stage,
    validated_splits,
)

T = TypeVar("T")
logger = logging.getLogger(__name__)


@dataclass
class PromotionResult:
    registered_model: str
    version: str
    sft_version: str | None
    promoted: bool
    reason: str
    reference: str
    audit: list[dict[str, Any]] = field(default_factory=list)  # the reward audit's findings

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class PromotionCase:
    """The promotion decision's one input: the candidate, what it is compared with (the champion it was
    evaluated against, else the base model), their paired pass@1 difference, forgetting against the base
    model and against the champion, and the registry version the reference is (None when it is the base model)."""

    candidate: ModelScores
    reference: ModelScores
    difference: dict[str, float]
    forgetting: dict[str, Any] | None = None
    champion_version: str | None = None
    forgetting_vs_champion: dict[str, Any] | None = None
    audit: tuple[dict[str, Any], ...] = ()  # the reward audit's findings (tasks.evaluation.audit)
    judged: dict[str, dict[str, Any]] = field(default_factory=dict)  # per judge: the candidate's win rate

    @classmethod
    def from_evaluation(cls, evaluation: EvalResult) -> PromotionCase:
        role = "reference" if evaluation.of("reference") is not None else "base"
        reference = evaluation.of(role)
        return cls(
            candidate=evaluation.of("candidate"),
            reference=reference,
            difference=evaluation.comparison(role),
            forgetting=evaluation.forgetting,
            champion_version=reference.registered_version if role == "reference" else None,
            forgetting_vs_champion=getattr(evaluation, "forgetting_reference", None),
            judged=getattr(evaluation, "judged", {}),
        )


def decide_promotion(case: PromotionCase, settings: PromotionSettings) -> tuple[bool, str]:
    """The gate (pure): the paired interval's lower end must clear the margin, pass@k must not drop, and
    general ability must stay within its tolerances against the base model and the champion (by default a
    drop rejects when the lower end of its 95 % interval exceeds the tolerance: ``forgetting_problem``).

    >>> a = ModelScores("grpo", 4, 4, 0.5, {1: 0.5}, (0.3, 0.7), [], [])
    >>> b = ModelScores("base", 4, 4, 0.1, {1: 0.1}, (0.0, 0.2), [], [])
    >>> decide_promotion(PromotionCase(a, b, {"mean": 0.4, "low": 0.2, "high": 0.6, "n": 4}), PromotionSettings())[0]
    True
    >>> decide_promotion(PromotionCase(a, b, {"mean": 0.4, "low": -0.1, "high": 0.6, "n": 4}), PromotionSettings())[0]
    False
    """
    candidate, reference, difference, forgetting = case.candidate, case.reference, case.difference, case.forgetting
    name = reference.name
    if settings.metric == "judged_win_rate":
        judge = settings.judge or next(iter(case.judged), None)
        rate = case.judged.get(judge) if judge else None
        if rate is None or not rate.get("n"):
            return False, f"no judged win rate of {judge or 'a judge'}: every verdict was None (promotion.metric)"
        if not rate["low"] > 0.5 + settings.margin:
            return False, (
                f"judged win rate ({judge}) over {rate['against']} is {rate['mean']:.3f} with 95% CI "
                f"[{rate['low']:.3f}, {rate['high']:.3f}] (n={rate['n']} prompts); its lower end does not exceed "
                f"0.5 + margin {settings.margin:+.3f}"
            )
    elif not difference["low"] > settings.margin:
        return False, (
            f"pass@1 gain over {name} is {difference['mean']:+.3f} with paired 95% CI "
            f"[{difference['low']:+.3f}, {difference['high']:+.3f}] (n={difference['n']} prompts); "
            f"its lower end does not exceed the margin {settings.margin:+.3f}"
        )
    for k, value in candidate.pass_at_k.items():
        if value < reference.pass_at_k.get(k, 0.0) - settings.pass_at_k_tolerance:
            return False, (
                f"pass@{k} {value:.3f} is below {name}'s {reference.pass_at_k[k]:.3f} by more than "
                f"{settings.pass_at_k_tolerance:.3f}"
            )
    for against, drop in (("the base model", forgetting), ("the champion", case.forgetting_vs_champion)):
        problem = forgetting_problem(drop, settings, against)
        if problem:
            return False, problem
    if settings.block_on_audit and case.audit:
        found = "; ".join(f"{f['detector']}: {f['message']}" for f in case.audit)
        return False, f"the reward audit found signs of reward hacking (promotion.block_on_audit): {found}"
    if settings.metric == "judged_win_rate":
        rate = case.judged[settings.judge or next(iter(case.judged))]
        return True, (
            f"judged win rate over {rate['against']} {rate['mean']:.3f}, 95% CI [{rate['low']:.3f}, "
            f"{rate['high']:.3f}] (n={rate['n']} prompts); pass@1 gain over {name} {difference['mean']:+.3f}"
        )
    return True, (
        f"pass@1 gain over {name} {difference['mean']:+.3f}, paired 95% CI "
        f"[{difference['low']:+.3f}, {difference['high']:+.3f}] (n={difference['n']} prompts)"
    )


def registry_errors(function: Callable[..., T]) -> Callable[..., T]:
    """Surface any failure to reach the MLflow store or registry as one RegistryError."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        try:
            return function(*args, **kwargs)
        except RegistryError:
            raise
        except Exception as exc:
            raise RegistryError(f"promotion failed talking to MLflow; aliases left as they were: {exc}") from exc

    return wrapper


def headline_tags(scores: ModelScores) -> dict[str, str]:
    """The few numbers a version carries as tags (the model card has the rest)."""
    low, high = scores.pass1_interval
    values = {
        "pass_at_1": scores.pass_at_k.get(1),
        "pass_at_1_low": low,
        "pass_at_1_high": high,
        "greedy_accuracy": scores.greedy_accuracy,
    }
    if scores.without_tools:  # what the tools are worth to this version
        values["tool_gain_pass_at_1"] = scores.without_tools["tool_gain"]["mean"]
    return {f"metric.{k}": f"{v:.4f}" for k, v in values.items() if v is not None}


# Packs one version: (role, adapter folder, promotion decision) -> the folder to register, and its card summary.
Packager = Callable[[str, Path, str], tuple[Path, str]]


@registry_errors
def run_promote(
    stage: StageRun,
    registered_model: str,
    case: PromotionCase,
    settings: PromotionSettings,
    lineage: dict[str, Any],
    adapter_dir: Path,
    sft_adapter_dir: Path | None = None,
    sft_scores: ModelScores | None = None,
    package: Packager | None = None,
) -> PromotionResult:
    """Decide, register the adapters (each as an MLflow model with its card when ``package`` is given, else as
    the plain folder), then apply the decision to the registry. Aliases move last, only after registration
    succeeded, and only if ``champion`` still points where it did when the candidate was evaluated. Each version
    carries its own model's numbers: the SFT backup the SFT policy's."""
    candidate, reference, difference = case.candidate, case.reference, case.difference
    promote, reason = decide_promotion(case, settings)
    client = stage.client
    registered: dict[str, str | None] = {"sft": None}
    for role, folder in (("sft", sft_adapter_dir), ("candidate", adapter_dir)):
        if folder is None:
            continue
        decision = reason if role == "candidate" else "the SFT-stage backup of this run's adapter; never champion"
        packed, summary = package(role, folder, decision) if package else (folder, "")
        artifact = "model" if role == "candidate" else "sft_model"
        stage.log_artifact(packed, artifact)
        scores = candidate if role == "candidate" else sft_scores
        tags = {**lineage, **(headline_tags(scores) if scores is not None else {})}
        tags[DIGEST_TAG] = adapter_digest(adapter_in(packed))  # what `grpoflow serve` checks before serving it
        if role == "candidate":
            tags.update(
                {
                    f"metric.gain_vs_{reference.name}": f"{difference['mean']:.4f}",
                    f"metric.gain_vs_{reference.name}_low": f"{difference['low']:.4f}",
                }
            )
        name = registered_model if role == "candidate" else f"{registered_model}-sft"
        number = registered[role] = register_adapter(client, name, stage.run_id, artifact, tags)
        if summary:
            client.update_model_version(name, number, short_description(summary, name, number))
    version = registered["candidate"]
    by = f"pipeline run {lineage.get('pipeline_run_id', '?')}"
    outcome = apply_promotion(client, registered_model, version, promote, reason, case.champion_version, by)
    metrics = {
        "pass1": candidate.pass_at_k.get(1),
        "pass1_low": candidate.pass1_interval[0],
        "pass1_high": candidate.pass1_interval[1],
        "greedy_accuracy": candidate.greedy_accuracy,
        **{f"pass_at_{k}": v for k, v in candidate.pass_at_k.items()},
        f"gain_vs_{reference.name}": difference["mean"],
        f"gain_vs_{reference.name}_low": difference["low"],
        **forgetting_metrics("forgetting", case.forgetting or {}),
    }
    stage.log_metrics({k: v for k, v in metrics.items() if v is not None})
    stage.set_tags({"promoted": outcome.promoted, "promotion_reason": outcome.reason, "registered_version": version})
    stage.log_metrics({"audit_findings": len(case.audit)})
    if case.audit:
        stage.set_tags({"audit": "; ".join(f"{f['detector']}: {f['message']}" for f in case.audit)[:4000]})
    return PromotionResult(
        registered_model,
        version,
        registered["sft"],
        outcome.promoted,
        outcome.reason,
        reference.name,
        list(case.audit),
    )


def git_commit() -> str:
    """The commit of the code that trained (``unknown`` outside a git checkout)."""
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, timeout=5
        ).stdout.strip()
    except Exception:
        return "unknown"


def lineage(config: PipelineConfig, tracker: Tracker, data: Any) -> dict[str, Any]:
    """The tags that tie a registered version to what made it: runs, base model, config, data (the validated
    rows' fingerprint, and each split's digest as the MLflow datasets of its runs name it), code."""
    digests = {f"data_{split.split}_digest": split.digest for split in validated_splits(data, config.data.source)}
    return {
        "pipeline_run_id": tracker.run_id,
        "mlflow_parent_run_id": tracker.parent_run_id,
        "base_model": config.model.source,
        "config_hash": config.config_hash(),
        "data_fingerprint": data.fingerprint,
        **digests,
        "git_commit": git_commit(),
        **tracker.stage_run_ids(),
        **({"tools": ",".join(spec.label for spec in config.tools.use)} if config.tools.enabled else {}),
    }


@prefect_task("promote", cache="never")
def reward_audit(config: PipelineConfig, tracker: Tracker, evaluation: EvalResult) -> list[dict[str, Any]]:
    """The reward audit's findings on this run's rollout ledger and evaluation (none without a ledger)."""
    from reward_fns.judges.settings import DEFAULT_RUBRIC
    from reward_fns.registry import CORRECTNESS_REWARD
    from tasks.evaluation import audit_rollouts
    from tasks.training import LEDGER_DIR, read_ledger, read_selection

    stage_dir = tracker.layout.stage_dir("grpo")
    folder = stage_dir / LEDGER_DIR
    if not folder.is_dir():
        return []
    rows = read_ledger(folder)
    selection = read_selection(stage_dir)
    if selection is not None and selection.step < selection.last_step:  # the adapter is the one of that step
        rows = [row for row in rows if row.get("step") is None or row["step"] <= selection.step]
    weights = {spec.name.rsplit(":", 1)[-1]: spec.weight for spec in config.rewards}
    correctness = CORRECTNESS_REWARD.get(config.data.kind)
    role = "reference" if evaluation.of("reference") is not None else "base"
    from reward_fns.judges import JUDGES

    judges = {
        spec.name.rsplit(":", 1)[-1]: str(spec.args.get("rubric") or DEFAULT_RUBRIC) if spec.name == "llm_judge" else ""
        for spec in config.rewards
        if spec.name in JUDGES
    }
    findings = audit_rollouts(
        rows, weights, correctness if correctness in weights else None, evaluation.comparison(role), judges
    )
    for finding in findings:
        logger.warning("reward audit: %s: %s", finding.detector, finding.message)
    return [finding.to_json() for finding in findings]


def promote_task(
    config: PipelineConfig,
    tracker: Tracker,
    evaluation: EvalResult,
    adapter_dir: Path,
    sft_adapter_dir: Path | None,
    data: Any,
    probes: dict[str, Any],
) -> PromotionResult:
    """Prefect wrapper: compare with the champion the candidate was evaluated against, else with the base
    model; register each version as an MLflow model with its card; a rejected candidate emits
    ``grpoflow.run.promotion-rejected``."""
    from tasks.evaluate import holdout_rows
    from tasks.models import resolve_model_source
    from tasks.models.precision import resolved_precision
    from tasks.registry import save_version_model, version_card
    from tasks.serving import SmokeRecord, TransformersEngine, record_smoke, write_smoke_record
    from tasks.training import read_selection

    case = replace(PromotionCase.from_evaluation(evaluation), audit=tuple(reward_audit(config, tracker, evaluation)))
    name = config.tracking.registered_model_name
    settings = config.orchestration
    lock = promotion_lock(tracker.tracking_uri, name, settings.promotion_lease_s, settings.promotion_lock_timeout_s)
    with tracked_stage(tracker, "promote") as stage, lock:
        base_dir = resolve_model_source(config.model.source, config.model.revision)
        selection = read_selection(tracker.layout.stage_dir("grpo"))  # which GRPO step's adapter this is
        smoke_rows = holdout_rows(config, data.holdout_path)[: config.serving.smoke_prompts]
        smoke_engine = None

        def smoke_answers(adapter: Path) -> SmokeRecord:  # what `grpoflow serve` checks a version against
            nonlocal smoke_engine
            smoke_engine = smoke_engine or TransformersEngine(base_dir, resolved_precision(config.model.precision))
            max_tokens = config.serving.smoke_max_tokens
            return record_smoke(smoke_engine, adapter, smoke_rows, config.data.system_prompt, max_tokens)

        def package(role: str, adapter: Path, decision: str) -> tuple[Path, str]:
            if role == "candidate" and case.audit:
                decision += "\n\n**Reward audit** (before promotion):\n" + "\n".join(
                    f"- `{f['detector']}`: {f['message']}" for f in case.audit
                )
            elif role == "candidate":
                decision += "\n\n**Reward audit** (before promotion): no finding."
            card, summary = version_card(
                config=config,
                registered_model=name,
                role=role,
                data=data,
                probes=probes,
                evaluation=evaluation,
                decision=decision,
                run_id=tracker.run_id,
                selection=selection if role == "candidate" else None,
            )
            destination = stage.dir / f"{role}-model"
            folder = save_version_model(adapter, destination, config.model.source, base_dir, config, card)
            if smoke_rows:
                write_smoke_record(folder, smoke_answers(adapter))
            return folder, summary

        tags = {
            **lineage(config, tracker, data),
            "promote_run_id": stage.run_id,
            "evaluation_engine": evaluation.engine,  # the engine behind the version's metric tags
            **({"grpo_select": selection.select, "grpo_selected_step": selection.step} if selection else {}),
        }
        result = run_promote(
            stage, name, case, config.promotion, tags, adapter_dir, sft_adapter_dir, evaluation.of("sft"), package
        )
        verdict = "became **champion**" if result.promoted else "set as challenger (not promoted)"
        publish_markdown(
            "promote",
            f"### promote\n{result.registered_model} v{result.version} {verdict}: {result.reason}\n",
        )
    if not result.promoted:
        emit_pipeline_event("promotion-rejected", tracker.run_id, result.to_json())
    return result
