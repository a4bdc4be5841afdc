"""Stage 5, evaluate: hold-out greedy accuracy and sampled pass@k (unbiased estimator) for every model on the
same prompts and sampling settings, with bootstrap intervals and paired differences."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from prefect import task

from tasks.caching import stage_cache_key
from tasks.config import PipelineConfig
from tasks.data import read_jsonl, render_prompt
from tasks.forgetting import DEFAULT_CORPUS, DEFAULT_QUESTIONS, GeneralAbility, forgetting, general_ability
from tasks.generation import GenerationStats, generate_completions
from tasks.models import load_policy, load_tokenizer
from tasks.reporting import publish_table
from tasks.scoring import bootstrap_interval, paired_difference, pass_at_k, score_groups
from tasks.tracking import Tracker

logger = logging.getLogger(__name__)


@dataclass
class ModelSpec:
    """One model to evaluate: a base folder, and the adapter on top (None for the base model itself)."""

    name: str
    base_model_dir: Path
    adapter_dir: Path | None = None
    registered_version: str | None = None  # for the champion: which version was evaluated


@dataclass
class ModelScores:
    name: str
    n_prompts: int
    n_samples: int
    greedy_accuracy: float
    pass_at_k: dict[int, float]
    pass1_interval: tuple[float, float]
    per_prompt_pass1: list[float] = field(repr=False)
    per_prompt_greedy: list[float] = field(repr=False)
    tokens_per_second: float = 0.0
    general: GeneralAbility | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "n_prompts": self.n_prompts,
            "n_samples": self.n_samples,
            "greedy_accuracy": self.greedy_accuracy,
            "pass_at_k": {str(k): v for k, v in self.pass_at_k.items()},
            "pass1_interval": list(self.pass1_interval),
            "tokens_per_second": self.tokens_per_second,
            "general": self.general.to_json() if self.general else None,
        }


@dataclass
class EvalResult:
    scores: dict[str, ModelScores]
    comparisons: dict[str, dict[str, float]]
    table_path: Path
    curve_path: Path
    forgetting: dict[str, float] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "models": {name: s.to_json() for name, s in self.scores.items()},
            "comparisons": self.comparisons,
            "forgetting": self.forgetting,
        }


def holdout_rows(config: PipelineConfig, holdout_path: Path) -> list[dict[str, Any]]:
    """The first ``evaluation.num_prompts`` hold-out rows (the file order is stable)."""
    return read_jsonl(holdout_path)[: config.evaluation.num_prompts]


def score_model(config: PipelineConfig, spec: ModelSpec, rows: list[dict[str, Any]]) -> ModelScores:
    """Greedy accuracy and pass@k of one model on ``rows``; same seed → same numbers."""
    settings = config.evaluation
    logger.info(
        "evaluate %s: %d prompts, greedy + %d samples each%s",
        spec.name,
        len(rows),
        settings.n_samples,
        ", then the forgetting probe" if settings.forgetting else "",
    )
    tokenizer = load_tokenizer(spec.base_model_dir)
    model = load_policy(spec.base_model_dir, spec.adapter_dir)
    prompts = [render_prompt(tokenizer, row["prompt"], config.data.system_prompt) for row in rows]
    stats = GenerationStats()
    common = {
        "max_new_tokens": settings.max_new_tokens,
        "batch_size": settings.batch_size,
        "stats": stats,
        "precision": config.model.precision,
        "progress": lambda done, total: logger.info("evaluate %s: %d/%d prompts", spec.name, done, total),
    }
    greedy = generate_completions(model, tokenizer, prompts, greedy=True, seed=config.seed, **common)
    sampled = generate_completions(
        model, tokenizer, prompts, n=settings.n_samples, temperature=settings.temperature, seed=config.seed, **common
    )
    greedy_correct = score_groups(config, rows, greedy)["correct"][:, 0]
    sample_correct = score_groups(config, rows, sampled)["correct"]
    counts = sample_correct.sum(axis=1).astype(int)
    general = None
    if settings.forgetting:
        general = general_ability(
            model,
            tokenizer,
            settings.general_corpus or DEFAULT_CORPUS,
            settings.general_questions or DEFAULT_QUESTIONS,
            batch_size=settings.batch_size,
            precision=config.model.precision,
        )
    per_prompt_pass1 = (counts / settings.n_samples).tolist()
    return ModelScores(
        name=spec.name,
        n_prompts=len(rows),
        n_samples=settings.n_samples,
        greedy_accuracy=float(greedy_correct.mean()),
        pass_at_k={k: float(np.mean([pass_at_k(settings.n_samples, int(c), k) for c in counts])) for k in settings.k},
        pass1_interval=bootstrap_interval(per_prompt_pass1, settings.bootstrap_resamples, config.seed),
        per_prompt_pass1=per_prompt_pass1,
        per_prompt_greedy=greedy_correct.tolist(),
        tokens_per_second=stats.tokens_per_second,
        general=general,
    )


def compare(config: PipelineConfig, candidate: ModelScores, reference: ModelScores) -> dict[str, float]:
    """Paired bootstrap of the sampled pass@1 difference ``candidate - reference`` over the same prompts."""
    return paired_difference(
        candidate.per_prompt_pass1,
        reference.per_prompt_pass1,
        config.evaluation.bootstrap_resamples,
        config.seed,
    )


def _curve(scores: dict[str, ModelScores], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(5, 3.5))
    for name, score in scores.items():
        ks = sorted(score.pass_at_k)
        axes.plot(ks, [score.pass_at_k[k] for k in ks], marker="o", label=name)
    axes.set(xlabel="k", ylabel="pass@k", title="hold-out pass@k", ylim=(0, 1.02), xscale="log", xticks=ks)
    axes.set_xticklabels([str(k) for k in ks])
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def run_evaluate(config: PipelineConfig, holdout_path: Path, models: list[ModelSpec], stage_dir: Path) -> EvalResult:
    """Score every model on the same hold-out prompts; compare the last one (the candidate) with the others."""
    rows = holdout_rows(config, holdout_path)
    scores = {spec.name: score_model(config, spec, rows) for spec in models}
    candidate = models[-1].name
    comparisons = {
        f"{candidate}-vs-{name}": compare(config, scores[candidate], score)
        for name, score in scores.items()
        if name != candidate
    }
    base, final = scores[models[0].name], scores[candidate]
    drop = forgetting(base.general, final.general) if base.general and final.general else None
    stage_dir.mkdir(parents=True, exist_ok=True)
    result = EvalResult(
        scores, comparisons, stage_dir / "evaluation.json", _curve(scores, stage_dir / "pass_at_k.png"), drop
    )
    result.table_path.write_text(json.dumps(result.to_json(), indent=2))
    return result


@task(name="evaluate", cache_key_fn=stage_cache_key, persist_result=True)
def evaluate_task(config: PipelineConfig, tracker: Tracker, holdout_path: Path, models: list[ModelSpec]) -> EvalResult:
    """Prefect wrapper: evaluate, log per-model metrics, the comparison table and the pass@k curve."""
    with tracker.stage("evaluate") as stage:
        result = run_evaluate(config, holdout_path, models, stage.dir)
        for name, score in result.scores.items():
            stage.log_metrics(
                {
                    f"{name}_greedy_accuracy": score.greedy_accuracy,
                    f"{name}_pass1_low": score.pass1_interval[0],
                    f"{name}_pass1_high": score.pass1_interval[1],
                    f"{name}_tokens_per_second": score.tokens_per_second,
                    f"{name}_general_qa_accuracy": score.general.qa_accuracy if score.general else None,
                    f"{name}_general_perplexity": score.general.perplexity if score.general else None,
                    **{f"{name}_pass_at_{k}": v for k, v in score.pass_at_k.items()},
                }
            )
        if result.forgetting:
            stage.log_metrics({f"forgetting_{k}": v for k, v in result.forgetting.items()})
        for key, difference in result.comparisons.items():
            stage.log_metrics({f"{key}_gain": difference["mean"], f"{key}_gain_low": difference["low"]})
        stage.log_artifact(result.table_path, "evaluate")
        stage.log_artifact(result.curve_path, "evaluate")
        publish_table("evaluation", evaluation_table(result))
        return result


def evaluation_table(result: EvalResult) -> list[dict[str, Any]]:
    """One row per model: greedy accuracy, pass@k and the pass@1 interval, with the sample sizes."""
    return [
        {
            "model": name,
            "prompts": score.n_prompts,
            "samples": score.n_samples,
            "greedy": round(score.greedy_accuracy, 4),
            **{f"pass@{k}": round(v, 4) for k, v in score.pass_at_k.items()},
            "pass@1 95% CI": f"[{score.pass1_interval[0]:.3f}, {score.pass1_interval[1]:.3f}]",
            "general QA": round(score.general.qa_accuracy, 4) if score.general else None,
            "general ppl": round(score.general.perplexity, 3) if score.general else None,
        }
        for name, score in result.scores.items()
    ]


def champion_spec(config: PipelineConfig, download_dir: Path) -> tuple[str | None, ModelSpec | None]:
    """The current ``champion`` of the configured registered model, downloaded, as a model to evaluate."""
    from tasks.models import resolve_model_source
    from tasks.tracking import CHAMPION, alias_version, client_for, fetch_adapter

    name = config.tracking.registered_model_name
    current = alias_version(client_for(config.resolved_tracking_uri()), name, CHAMPION)
    if current is None:
        return None, None
    base, adapter_dir, version = fetch_adapter(
        config.resolved_tracking_uri(), f"models:/{name}/{current.version}", download_dir
    )
    return str(version.version), ModelSpec("champion", resolve_model_source(base), adapter_dir, str(version.version))
