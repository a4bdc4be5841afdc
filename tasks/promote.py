"""Stage 6, promote: register the final adapter (and the SFT backup) with lineage tags, and move ``champion``
only when the candidate beats the current champion (or the base model, when there is none)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.config import PipelineConfig, PromotionSettings
from tasks.evaluate import EvalResult, ModelScores
from tasks.reporting import publish_markdown
from tasks.tracking import (
    CHALLENGER,
    CHAMPION,
    RegistryError,
    StageRun,
    Tracker,
    alias_version,
    move_champion,
    register_adapter,
)

T = TypeVar("T")


@dataclass
class PromotionResult:
    registered_model: str
    version: str
    sft_version: str | None
    promoted: bool
    reason: str
    reference: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def decide_promotion(
    candidate: ModelScores,
    reference: ModelScores,
    difference: dict[str, float],
    settings: PromotionSettings,
    forgetting: dict[str, float] | None = None,
) -> tuple[bool, str]:
    """The gate (pure): the paired interval's lower end must clear the margin, pass@k must not drop, and
    general ability (``forgetting``, measured against the base model) must stay within its tolerances.

    >>> from tasks.evaluate import ModelScores
    >>> a = ModelScores("grpo", 4, 4, 0.5, {1: 0.5}, (0.3, 0.7), [], [])
    >>> b = ModelScores("base", 4, 4, 0.1, {1: 0.1}, (0.0, 0.2), [], [])
    >>> decide_promotion(a, b, {"mean": 0.4, "low": 0.2, "high": 0.6, "n": 4}, PromotionSettings())[0]
    True
    >>> decide_promotion(a, b, {"mean": 0.4, "low": -0.1, "high": 0.6, "n": 4}, PromotionSettings())[0]
    False
    """
    name = reference.name
    if not difference["low"] > settings.margin:
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
    if forgetting is not None:
        if forgetting["qa_accuracy_drop"] > settings.max_qa_accuracy_drop:
            return False, (
                f"forgetting: general QA accuracy fell {forgetting['qa_accuracy_drop']:.1%} from the base model "
                f"(tolerance {settings.max_qa_accuracy_drop:.1%})"
            )
        if forgetting["perplexity_increase"] > settings.max_perplexity_increase:
            return False, (
                f"forgetting: general-text perplexity rose {forgetting['perplexity_increase']:.1%} over the base "
                f"model (tolerance {settings.max_perplexity_increase:.1%})"
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


@registry_errors
def run_promote(
    stage: StageRun,
    registered_model: str,
    adapter_dir: Path,
    sft_adapter_dir: Path | None,
    candidate: ModelScores,
    reference: ModelScores,
    difference: dict[str, float],
    champion_at_evaluation: str | None,
    settings: PromotionSettings,
    lineage: dict[str, Any],
    forgetting: dict[str, float] | None = None,
) -> PromotionResult:
    """Log and register the adapters, then apply the gate. Aliases move last, only after registration
    succeeded, and only if ``champion`` still points where it did when the candidate was evaluated."""
    client = stage.client
    stage.log_artifact(adapter_dir, "adapter")
    if sft_adapter_dir is not None:
        stage.log_artifact(sft_adapter_dir, "sft_adapter")
    metrics = {
        "pass1": candidate.pass_at_k.get(1),
        "pass1_low": candidate.pass1_interval[0],
        "pass1_high": candidate.pass1_interval[1],
        "greedy_accuracy": candidate.greedy_accuracy,
        **{f"pass_at_{k}": v for k, v in candidate.pass_at_k.items()},
        f"gain_vs_{reference.name}": difference["mean"],
        f"gain_vs_{reference.name}_low": difference["low"],
        **{f"forgetting_{k}": v for k, v in (forgetting or {}).items()},
    }
    tags = {**lineage, **{f"metric.{k}": f"{v:.4f}" for k, v in metrics.items() if v is not None}}
    sft_version = None
    if sft_adapter_dir is not None:
        sft_version = register_adapter(client, f"{registered_model}-sft", stage.run_id, "sft_adapter", tags)
    version = register_adapter(client, registered_model, stage.run_id, "adapter", tags)

    promote, reason = decide_promotion(candidate, reference, difference, settings, forgetting)
    current = alias_version(client, registered_model, CHAMPION)
    current_version = None if current is None else str(current.version)
    if current_version == version:  # a resumed run that had already promoted this version
        return PromotionResult(registered_model, version, sft_version, True, "already champion", reference.name)
    if promote and current_version != champion_at_evaluation:
        promote = False
        reason = (
            f"champion moved from {champion_at_evaluation} to {current_version} while this run was evaluated "
            "against it; not promoting over an adapter it was not compared with"
        )
    if promote:
        move_champion(client, registered_model, version, reason)
    else:
        client.set_registered_model_alias(registered_model, CHALLENGER, version)
    client.set_model_version_tag(registered_model, version, "grpoflow.promotion_decision", reason)
    stage.log_metrics({k: v for k, v in metrics.items() if v is not None})
    stage.set_tags({"promoted": promote, "promotion_reason": reason, "registered_version": version})
    return PromotionResult(registered_model, version, sft_version, promote, reason, reference.name)


@task(name="promote", cache_policy=NO_CACHE)
def promote_task(
    config: PipelineConfig,
    tracker: Tracker,
    evaluation: EvalResult,
    adapter_dir: Path,
    sft_adapter_dir: Path | None,
    champion_at_evaluation: str | None,
    lineage: dict[str, Any],
) -> PromotionResult:
    """Prefect wrapper: compare with the champion when it was evaluated, else with the base model."""
    candidate = list(evaluation.scores)[-1]
    reference = "champion" if "champion" in evaluation.scores else "base"
    with tracker.stage("promote") as stage, promotion_lock(config.tracking.registered_model_name):
        result = run_promote(
            stage,
            config.tracking.registered_model_name,
            adapter_dir,
            sft_adapter_dir,
            evaluation.scores[candidate],
            evaluation.scores[reference],
            evaluation.comparisons[f"{candidate}-vs-{reference}"],
            champion_at_evaluation,
            config.promotion,
            {**lineage, **tracker.stage_run_ids(), "promote_run_id": stage.run_id},
            evaluation.forgetting,
        )
        verdict = "became **champion**" if result.promoted else "set as challenger (not promoted)"
        publish_markdown(
            "promote",
            f"### promote\n{result.registered_model} v{result.version} {verdict}: {result.reason}\n",
        )
        return result


@contextmanager
def promotion_lock(registered_model: str) -> Iterator[None]:
    """One promotion per registered model at a time, across processes and workers: a Prefect global
    concurrency limit of 1 (created on first use). Inside it, ``run_promote`` re-reads the alias before moving."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.concurrency.sync import concurrency
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    name = f"grpoflow-promote-{registered_model}"
    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            with suppress(ObjectAlreadyExists):
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
    with concurrency(name, occupy=1, timeout_seconds=1800, strict=True):
        yield
