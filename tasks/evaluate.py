"""Stage 5, evaluate: hold-out greedy accuracy and sampled pass@k (unbiased estimator) for every model on the
same prompts and sampling settings, with bootstrap intervals and paired differences.

Models are handed in and results handed out by role (``ROLES``), never by position: what promotion compares
cannot change when a list is reordered. The current champion is fetched by its own task (``champion_task``).
Must not import: another stage's module; Prefect and MLflow appear only in its task wrapper.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from tasks import restore_defaults
from tasks.config import PipelineConfig
from tasks.evaluation import (
    Completions,
    GeneralAbility,
    Job,
    PolicyShelf,
    bootstrap_interval,
    evaluation_table,
    forgetting_drop,
    forgetting_items,
    forgetting_job,
    forgetting_metrics,
    general_questions_trained_on,
    judge_specs,
    paired_difference,
    pass_at_k,
    pass_at_k_curve,
    processes_for,
    run_jobs,
    sampling_job,
    score_groups,
    tool_use_figures,
    verdict_lists,
    win_rate,
)
from tasks.evaluation.extraction import extraction_scores
from tasks.inputs import prompt_text, read_jsonl
from tasks.layout import TEST_FILE
from tasks.models import samples_on_cpu
from tasks.tracking import Tracker, prefect_task, publish_table, tracked_stage, work_bar
from tasks.training import LEDGER_DIR, sample_rows, write_part

logger = logging.getLogger(__name__)

# The roles of the models one evaluation scores, in the order tables show them. ``base``: the untrained model
# (forgetting is measured against it); ``sft``: the SFT policy; ``reference``: the current champion, when there
# is one; ``candidate``: the adapter this run may register. Promotion compares the candidate with the reference,
# or with the base model when there is no champion.
ROLES = ("base", "sft", "reference", "candidate")


@dataclass
class ModelSpec:
    """One model to evaluate: a base folder, and the adapter on top (None for the base model itself)."""

    name: str
    base_model_dir: Path
    adapter_dir: Path | None = None
    registered_version: str | None = None  # for the champion: which version was evaluated


@dataclass
class ModelScores:
    __setstate__ = restore_defaults  # results pickled before a field was added load with its default

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
    registered_version: str | None = None  # the registry version that was scored, if it is one
    samples: list[dict[str, Any]] = field(default_factory=list, repr=False)  # a few greedy answers (model cards)
    engine: str = "transformers"  # what sampled its completions (tasks.models.engine_name)
    # per judge reward: its verdicts on the sampled completions, prompts × samples (None: no verdict)
    judged: dict[str, list[list[float | None]]] = field(default_factory=dict, repr=False)
    # with tools: the same numbers without them (tools.evaluate_without), with the paired gain the tools give
    without_tools: dict[str, Any] | None = field(default=None, repr=False)
    tool_use: dict[str, float] = field(default_factory=dict)  # with tools: calls per rollout, error share...
    # evaluation.extractions: per extraction (gsm8k_strict, ...), its greedy accuracy and sampled pass@1
    extractions: dict[str, dict[str, float]] = field(default_factory=dict)

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
            "engine": self.engine,
            **({"tool_use": self.tool_use} if self.tool_use else {}),
            **({"extractions": self.extractions} if self.extractions else {}),
            **({"without_tools": _public(self.without_tools)} if self.without_tools else {}),
        }


def _public(numbers: dict[str, Any]) -> dict[str, Any]:
    """A score's numbers without its per-prompt lists (what JSON and tables show), pass@k keyed by text as in
    ``to_json``, so the summary in memory reads as its JSON does.

    >>> _public({"pass_at_k": {1: 0.5}, "per_prompt_pass1": [0.5]})
    {'pass_at_k': {'1': 0.5}}
    """
    public = {key: value for key, value in numbers.items() if not key.startswith("per_prompt")}
    if "pass_at_k" in public:
        public["pass_at_k"] = {str(k): v for k, v in public["pass_at_k"].items()}
    return public


@dataclass
class EvalResult:
    """Scores by model name (in ``ROLES`` order, for tables), the candidate's paired differences with each
    other model (``<candidate>-vs-<name>``), forgetting against the base model, and which model had which
    role."""

    scores: dict[str, ModelScores]
    comparisons: dict[str, dict[str, float]]
    table_path: Path
    curve_path: Path
    forgetting: dict[str, Any] | None = None  # the candidate against the base model
    roles: dict[str, str] = field(default_factory=dict)  # role → model name
    forgetting_reference: dict[str, Any] | None = None  # the candidate against the champion, when there is one
    # per judge: the candidate's judged win rate over the champion (else SFT, else the base model), with "against"
    judged: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Results pickled before roles existed (Prefect's cache of a run started then) listed their models as
        ``[base, sft?, champion?, candidate]``; their roles are read from that order, once, here."""
        restore_defaults(self, state)
        if not self.__dict__.get("roles"):
            names = list(self.scores)
            self.roles = {"base": names[0], "candidate": names[-1]}
            for name, role in (("sft", "sft"), ("champion", "reference")):
                if name in names[1:-1]:
                    self.roles[role] = name

    @property
    def engine(self) -> str:
        """The engine that sampled every model's completions, or ``mixed: a, b`` when they differ (a comparison
        across engines: docs/vllm.md says what that costs).

        >>> score = ModelScores("a", 1, 1, 0.0, {}, (0.0, 0.0), [], [], engine="vllm-server")
        >>> EvalResult({"a": score}, {}, Path("t"), Path("c")).engine
        'vllm-server'
        """
        engines = sorted({score.engine for score in self.scores.values()})
        return engines[0] if len(engines) == 1 else "mixed: " + ", ".join(engines)

    def of(self, role: str) -> ModelScores | None:
        """The scores of the model that had ``role``, or None when no model had it."""
        name = self.roles.get(role)
        return None if name is None else self.scores[name]

    def comparison(self, role: str) -> dict[str, float] | None:
        """The candidate's paired pass@1 difference with the model that had ``role``."""
        name = self.roles.get(role)
        return None if name is None else self.comparisons[f"{self.roles['candidate']}-vs-{name}"]

    def to_json(self) -> dict[str, Any]:
        return {
            "models": {name: s.to_json() for name, s in self.scores.items()},
            "comparisons": self.comparisons,
            "forgetting": self.forgetting,
            "forgetting_vs_champion": self.forgetting_reference,
            "judged_win_rate": self.judged,
            "engine": self.engine,
        }


def holdout_rows(config: PipelineConfig, holdout_path: Path) -> list[dict[str, Any]]:
    """The rows the final evaluation scores: with ``data.test_source``, the first ``evaluation.num_prompts`` of the
    test set validate wrote beside the hold-out; else the first hold-out rows (the file order is stable), none of the
    slice GRPO chose its checkpoint on (``tasks.training.holdout.final_holdout_rows``)."""
    from tasks.training import final_holdout_rows

    test_path = holdout_path.with_name(TEST_FILE)
    if config.data.test_source:
        if not test_path.is_file():
            raise FileNotFoundError(f"data.test_source is set but validate wrote no {test_path}")
        return read_jsonl(test_path)[: config.evaluation.num_prompts]
    return final_holdout_rows(read_jsonl(holdout_path), config)


def evaluated_on(config: PipelineConfig) -> str:
    """What the final evaluation scores, in words (the card, the summary).

    >>> from types import SimpleNamespace as N
    >>> evaluated_on(N(data=N(test_source="hub:openai/gsm8k@main", test_split="test")))
    'test source hub:openai/gsm8k@main (split test)'
    """
    data = config.data
    return f"test source {data.test_source} (split {data.test_split})" if data.test_source else "hold-out split"


def score_model(
    config: PipelineConfig, spec: ModelSpec, rows: list[dict[str, Any]], ledger_dir: Path | None = None
) -> ModelScores:
    """Greedy accuracy and pass@k of one model on ``rows``; same seed → same numbers. With ``ledger_dir``, its
    samples (greedy and sampled, with their rewards) go to the rollout ledger there."""
    return score_models(config, {spec.name: spec}, rows, ledger_dir)[spec.name]


def score_models(
    config: PipelineConfig, specs: Mapping[str, ModelSpec], rows: list[dict[str, Any]], ledger_dir: Path | None = None
) -> dict[str, ModelScores]:
    """``score_model`` for every model in ``specs`` (scores keyed as ``specs``). Each model's sampling and its
    forgetting check are jobs (``tasks.evaluation.parallel``): on a CPU with two threads or more they run two at a
    time, in this process and a forked one, with half the threads each (``evaluation.processes``); the numbers
    are those of one process. The forgetting checks of adapters wait for the base model's (its log-probabilities
    give their KL). One bar shows all the work."""
    settings = config.evaluation
    shelf = PolicyShelf()
    base_job = next((f"forgetting {key}" for key, spec in specs.items() if spec.adapter_dir is None), None)
    jobs: list[Job] = []
    for key, spec in specs.items():
        if settings.forgetting:
            after = (base_job,) if spec.adapter_dir is not None and base_job else ()
            jobs.append(Job(f"forgetting {key}", partial(forgetting_job, config, spec, shelf), after))
        jobs.append(Job(f"sampling {key}", partial(sampling_job, config, spec, rows, shelf)))
    processes = processes_for(settings.processes, len(jobs), samples_on_cpu(config))
    units = len(specs) * len(rows) + (len(specs) * forgetting_items(settings) if settings.forgetting else 0)
    with work_bar(units, "evaluate " + ", ".join(spec.name for spec in specs.values()), "item") as advance:
        results = run_jobs(jobs, processes, advance)
    return {
        key: _assemble(config, spec, rows, results[f"sampling {key}"], results.get(f"forgetting {key}"), ledger_dir)
        for key, spec in specs.items()
    }


def _assemble(
    config: PipelineConfig,
    spec: ModelSpec,
    rows: list[dict[str, Any]],
    sampled: Completions,
    general: GeneralAbility | None,
    ledger_dir: Path | None,
) -> ModelScores:
    """One model's scores from its completions (rewards computed here) and its forgetting check; with tools, its
    scores without them beside (``without_tools``, with the paired gain the tools give)."""
    settings = config.evaluation
    numbers, greedy_correct, sampled_scores = _scored(
        config, spec, rows, sampled.greedy, sampled.sampled, ledger_dir, "", sampled
    )
    without = None
    if sampled.without_tools is not None:
        plain, _, _ = _scored(config, spec, rows, *sampled.without_tools, ledger_dir, "_no_tools", sampled)
        common = (settings.bootstrap_resamples, config.seed)
        without = {
            **plain,
            "tool_gain": paired_difference(numbers["per_prompt_pass1"], plain["per_prompt_pass1"], *common),
            "greedy_tool_gain": paired_difference(numbers["per_prompt_greedy"], plain["per_prompt_greedy"], *common),
        }
    samples = [
        {"prompt": prompt_text(row["prompt"]), "completion": _text(sampled.greedy[i][0]), "correct": bool(c)}
        for i, (row, c) in enumerate(zip(rows[:3], greedy_correct, strict=False))
    ]
    return ModelScores(
        samples=samples,
        registered_version=spec.registered_version,
        name=spec.name,
        n_prompts=len(rows),
        n_samples=settings.n_samples,
        greedy_accuracy=numbers["greedy_accuracy"],
        pass_at_k=numbers["pass_at_k"],
        pass1_interval=numbers["pass1_interval"],
        per_prompt_pass1=numbers["per_prompt_pass1"],
        per_prompt_greedy=numbers["per_prompt_greedy"],
        tokens_per_second=sampled.stats.tokens_per_second,
        general=general,
        engine=sampled.backend,
        judged={
            judge.name.rsplit(":", 1)[-1]: verdict_lists(sampled_scores["per_function"][judge.name.rsplit(":", 1)[-1]])
            for judge in judge_specs(config)
        },
        without_tools=without,
        tool_use=tool_use_figures(sampled.sampled) if config.tools.enabled else {},
        extractions=extraction_scores(
            settings.extractions,
            [[_text(c) for c in group] for group in sampled.greedy],
            [[_text(c) for c in group] for group in sampled.sampled],
            [str(row["ground_truth"]) for row in rows],
        )
        if settings.extractions
        else {},
    )


def _scored(
    config: PipelineConfig,
    spec: ModelSpec,
    rows: list[dict[str, Any]],
    greedy: list[list[Any]],
    sampled: list[list[Any]],
    ledger_dir: Path | None,
    suffix: str,
    completions: Completions,
) -> tuple[dict[str, Any], Any, dict[str, Any]]:
    """Greedy accuracy, pass@k and the pass@1 interval of one set of completions (and its ledger parts, roles
    ``eval_<model><suffix>`` and ``..._greedy``); with the greedy correctness per prompt and the sampled scores."""
    settings = config.evaluation
    greedy_scores = score_groups(config, rows, greedy)
    sampled_scores = score_groups(config, rows, sampled)
    if ledger_dir is not None:
        for kind, drawn, scored in (("greedy", greedy, greedy_scores), ("sampled", sampled, sampled_scores)):
            role = f"eval_{spec.name}{suffix}" + ("_greedy" if kind == "greedy" else "")
            ledger = sample_rows(role, rows, drawn, scored["per_function"], scored["total"], completions.backend)
            write_part(ledger_dir, ledger, f"eval-{spec.name}{suffix.replace('_', '-')}-{kind}")
    greedy_correct = greedy_scores["correct"][:, 0]
    counts = sampled_scores["correct"].sum(axis=1).astype(int)
    per_prompt_pass1 = (counts / settings.n_samples).tolist()
    numbers = {
        "greedy_accuracy": float(greedy_correct.mean()),
        "pass_at_k": {
            k: float(np.mean([pass_at_k(settings.n_samples, int(c), k) for c in counts])) for k in settings.k
        },
        "pass1_interval": bootstrap_interval(per_prompt_pass1, settings.bootstrap_resamples, config.seed),
        "per_prompt_pass1": per_prompt_pass1,
        "per_prompt_greedy": greedy_correct.tolist(),
    }
    return numbers, greedy_correct, sampled_scores


def _text(completion: Any) -> str:
    """A completion as the card shows it: its text, or a tool-using conversation as text."""
    from tasks.training import conversation_text

    return completion if isinstance(completion, str) else conversation_text(completion)


def compare(config: PipelineConfig, candidate: ModelScores, reference: ModelScores) -> dict[str, float]:
    """Paired bootstrap of the sampled pass@1 difference ``candidate - reference`` over the same prompts."""
    return paired_difference(
        candidate.per_prompt_pass1,
        reference.per_prompt_pass1,
        config.evaluation.bootstrap_resamples,
        config.seed,
    )


def run_evaluate(
    config: PipelineConfig, holdout_path: Path, models: Mapping[str, ModelSpec], stage_dir: Path
) -> EvalResult:
    """Score every model (keyed by role: ``base`` and ``candidate`` required, ``sft`` and ``reference``
    optional) on the same hold-out prompts, then compare the candidate with each of the others."""
    unknown = set(models) - set(ROLES)
    if unknown or not {"base", "candidate"} <= set(models):
        raise ValueError(f"evaluation takes models by role {ROLES} (base and candidate required), got {sorted(models)}")
    rows = holdout_rows(config, holdout_path)
    logger.info("evaluate: %d prompts of the %s", len(rows), evaluated_on(config))
    ledger = stage_dir / LEDGER_DIR
    scores = score_models(config, {role: models[role] for role in ROLES if role in models}, rows, ledger)
    return compare_roles(config, scores, stage_dir, general_questions_trained_on(config.evaluation, holdout_path))


def compare_roles(
    config: PipelineConfig, by_role: Mapping[str, ModelScores], stage_dir: Path, trained_on: set[str] | None = None
) -> EvalResult:
    """The evaluation result of scores keyed by role: paired differences of the candidate with every other
    model, forgetting of the candidate against the base model and the champion (leaving out the general
    questions ``trained_on``), the table and the pass@k curve."""
    ordered = [role for role in ROLES if role in by_role]
    candidate, base = by_role["candidate"], by_role["base"]
    scores = {by_role[role].name: by_role[role] for role in ordered}
    comparisons = {
        f"{candidate.name}-vs-{by_role[role].name}": compare(config, candidate, by_role[role])
        for role in ordered
        if role != "candidate"
    }
    settings = config.evaluation
    common = {"resamples": settings.bootstrap_resamples, "seed": config.seed, "exclude": trained_on}
    common_judged = {"resamples": settings.bootstrap_resamples, "seed": config.seed}
    drop = None
    if base.general and candidate.general:
        drop = forgetting_drop(base.general, candidate.general, **common)
    reference = by_role.get("reference")
    drop_reference = None
    if reference is not None and reference.general and candidate.general:
        drop_reference = forgetting_drop(reference.general, candidate.general, **common)
    stage_dir.mkdir(parents=True, exist_ok=True)
    against = next(by_role[role] for role in ("reference", "sft", "base") if role in by_role)
    judged = {
        judge: {"against": against.name, **win_rate(verdicts, against.judged.get(judge, []), **common_judged)}
        for judge, verdicts in candidate.judged.items()
        if against.judged.get(judge)
    }
    result = EvalResult(
        scores,
        comparisons,
        stage_dir / "evaluation.json",
        pass_at_k_curve(scores, stage_dir / "pass_at_k.png"),
        drop,
        {role: by_role[role].name for role in ordered},
        drop_reference,
        judged,
    )
    result.table_path.write_text(json.dumps(result.to_json(), indent=2))
    return result


def lineup(
    base_model_dir: Path, candidate_adapter: Path, sft_adapter: Path | None, reference: ModelSpec | None
) -> dict[str, ModelSpec]:
    """The models a pipeline run evaluates, by role."""
    models = {"base": ModelSpec("base", base_model_dir)}
    if sft_adapter is not None:
        models["sft"] = ModelSpec("sft", base_model_dir, sft_adapter)
    if reference is not None:
        models["reference"] = reference
    models["candidate"] = ModelSpec("grpo", base_model_dir, candidate_adapter)
    return models


@prefect_task("evaluate", cache="stage")
def evaluate_task(
    config: PipelineConfig, tracker: Tracker, holdout_path: Path, models: dict[str, ModelSpec]
) -> EvalResult:
    """Prefect wrapper: evaluate, log per-model metrics, the comparison table and the pass@k curve."""
    with tracked_stage(tracker, "evaluate") as stage:
        result = run_evaluate(config, holdout_path, models, stage.dir)
        stage.log_params({"generation_engine": result.engine})
        for name, score in result.scores.items():
            stage.log_metrics(
                {
                    f"{name}_greedy_accuracy": score.greedy_accuracy,
                    f"{name}_pass1_low": score.pass1_interval[0],
                    f"{name}_pass1_high": score.pass1_interval[1],
                    f"{name}_tokens_per_second": score.tokens_per_second,
                    f"{name}_general_qa_accuracy": score.general.qa_accuracy if score.general else None,
                    f"{name}_general_perplexity": score.general.perplexity if score.general else None,
                    f"{name}_general_kl": score.general.to_json().get("kl") if score.general else None,
                    **{f"{name}_pass_at_{k}": v for k, v in score.pass_at_k.items()},
                    **{
                        f"{name}_{extraction}_{measure}": value
                        for extraction, measures in score.extractions.items()
                        for measure, value in measures.items()
                    },
                }
            )
        for prefix, drop in (
            ("forgetting", result.forgetting),
            ("forgetting_vs_champion", result.forgetting_reference),
        ):
            stage.log_metrics(forgetting_metrics(prefix, drop or {}))
        for key, difference in result.comparisons.items():
            stage.log_metrics({f"{key}_gain": difference["mean"], f"{key}_gain_low": difference["low"]})
        for judge, rate in result.judged.items():
            stage.log_metrics({f"judged_win_rate/{judge}": rate["mean"], f"judged_win_rate/{judge}_low": rate["low"]})
        stage.log_artifact(result.table_path, "evaluate")
        stage.log_artifact(result.curve_path, "evaluate")
        publish_table("evaluation", evaluation_table(result))
        return result


def fetch_champion(config: PipelineConfig, download_dir: Path) -> ModelSpec | None:
    """The current ``champion`` of the configured registered model, downloaded, as the reference to evaluate
    (None when there is no champion yet)."""
    from tasks.models import resolve_model_source
    from tasks.registry import CHAMPION, alias_version_number, client_for, fetch_adapter

    name = config.tracking.registered_model_name
    current = alias_version_number(client_for(config.resolved_tracking_uri()), name, CHAMPION)
    if current is None:
        return None
    base, adapter_dir, version = fetch_adapter(
        config.resolved_tracking_uri(), f"models:/{name}/{current}", download_dir
    )
    return ModelSpec("champion", resolve_model_source(base), adapter_dir, str(version.version))


@prefect_task("champion", cache="never")
def champion_task(config: PipelineConfig, tracker: Tracker) -> ModelSpec | None:
    """Prefect wrapper: fetch the champion in its own MLflow stage run (retried like the other stages)."""
    with tracked_stage(tracker, "champion") as stage:
        spec = fetch_champion(config, stage.dir)
        stage.set_tags({"champion_version": spec.registered_version if spec else "none"})
        return spec
