"""Evaluation's two jobs per model (``tasks.evaluation.parallel`` runs them): its hold-out completions
(``sampling_job``) and its forgetting check (``forgetting_job``), each reporting its share of the stage's bar. A
model is any object with ``name``, ``base_model_dir``, ``adapter_dir`` and ``registered_version`` (the stage's
``ModelSpec``).
Must not import: Prefect, MLflow, the stages.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.config import EvaluationSettings
from tasks.evaluation.cache import fingerprint, model_content_key, sample_for_evaluation
from tasks.evaluation.forgetting import (
    DEFAULT_CORPUS,
    DEFAULT_QUESTIONS,
    GeneralAbility,
    general_ability,
    load_corpus,
    load_questions,
)
from tasks.evaluation.parallel import Report
from tasks.models import GenerationStats, load_policy, load_tokenizer, pipeline_backend, policy_sampler
from tasks.speedups import speedups_on

logger = logging.getLogger(__name__)


def forgetting_items(settings: EvaluationSettings) -> int:
    """How many passages and questions one model's forgetting check scores (its share of the stage's bar)."""
    return len(load_corpus(settings.general_corpus or DEFAULT_CORPUS)) + len(
        load_questions(settings.general_questions or DEFAULT_QUESTIONS)
    )


class PolicyShelf:
    """The policy last loaded in this process: a model's sampling and forgetting check share it (one model kept
    at a time; a forked worker gets its own copy of the shelf)."""

    def __init__(self) -> None:
        self.key: tuple[Path, Path | None, str] | None = None
        self.model: Any = None

    def policy(self, spec: Any, precision: str) -> Any:
        key = (spec.base_model_dir, spec.adapter_dir, precision)
        if key != self.key:
            self.key, self.model = None, None  # the last one freed before the next loads
            self.model, self.key = load_policy(spec.base_model_dir, spec.adapter_dir, precision=precision), key
        return self.model


@dataclass
class Completions:
    """One model's hold-out completions: greedy (one per prompt) and sampled, with the engine's figures."""

    greedy: list[list[Any]]
    sampled: list[list[Any]]
    stats: GenerationStats
    backend: str
    # with tools (``tools.evaluate_without``): the same model's greedy and sampled completions without them
    without_tools: tuple[list[list[str]], list[list[str]]] | None = None


def sampling_job(config: Any, spec: Any, rows: list[dict[str, Any]], shelf: PolicyShelf, report: Report) -> Completions:
    """One model's greedy and sampled completions of ``rows`` (from the evaluation cache when it has them)."""
    settings = config.evaluation
    model = shelf.policy(spec, config.model.precision) if pipeline_backend(config) == "transformers" else None
    sampler = policy_sampler(config, spec.base_model_dir, spec.adapter_dir, settings.batch_size, model=model)
    logger.info(
        "evaluate %s: sampling %d prompts, greedy + %d samples each, with %s",
        spec.name,
        len(rows),
        settings.n_samples,
        sampler.backend,
    )
    samplers = [sampler]
    if config.tools.enabled and config.tools.evaluate_without:
        samplers.append(sampler.without_tools)  # the same engine and template, no tools in the prompt
    # Greedy and sampled are two passes over the prompts unless the engine decodes them together.
    passes = sum(
        getattr(each, "passes_for_greedy", 1 if hasattr(each, "sample_with_greedy") else 2) for each in samplers
    )
    counted = JobShare(report, len(rows), passes=passes)
    stats = GenerationStats()
    drawn = []
    for each in samplers:
        prompts = [each.prompt_of(row, config.data.system_prompt) for row in rows]
        drawn.append(sample_for_evaluation(config, spec, each, prompts, stats, counted.progress))
    counted.finish()
    (greedy, sampled), *without = drawn
    return Completions(greedy, sampled, stats, sampler.backend, without[0] if without else None)


def forgetting_job(config: Any, spec: Any, shelf: PolicyShelf, report: Report) -> GeneralAbility:
    """One model's general ability (the forgetting check). The base model is cached by its fingerprint,
    registered versions by their adapter's bytes (downloaded afresh each run: a key by file times would never
    hit); a fresh adapter by its bytes under evaluation.cache (a same-seed rerun's adapters), else scored again."""
    settings = config.evaluation
    base_key = fingerprint(spec.base_model_dir)
    model_key = base_key if spec.adapter_dir is None else None
    if spec.adapter_dir is not None and (spec.registered_version is not None or settings.cache):
        model_key = model_content_key(spec.base_model_dir, spec.adapter_dir)
    logger.info("evaluate %s: the forgetting probe", spec.name)
    counted = JobShare(report, forgetting_items(settings))
    # Forgetting scores likelihoods: the transformers model, whichever engine sampled.
    general = general_ability(
        shelf.policy(spec, config.model.precision),
        load_tokenizer(spec.base_model_dir),
        settings.general_corpus or DEFAULT_CORPUS,
        settings.general_questions or DEFAULT_QUESTIONS,
        batch_size=settings.batch_size,
        precision=config.model.precision,
        model_key=model_key,
        base_key=None if spec.adapter_dir is None else base_key,
        stock=not speedups_on(config.grpo.speedups),
        report=counted.add,
    )
    counted.finish()
    return general


class JobShare:
    """A job's share of the bar: what it reports, topped up to ``units`` when it ends (a cached result reports
    nothing). ``progress(done, of)`` takes a sampler's passes over the prompts, ``passes`` of them sharing the
    units (a new pass starts once the last one reached ``of``, or below its last ``done``).

    >>> seen = []
    >>> share = JobShare(seen.append, 10, passes=2)
    >>> for done in (2, 4, 1, 4):  # greedy over 4 prompts, then the samples of the same 4
    ...     share.progress(done, 4)
    >>> seen, share.reported
    ([2, 3, 1, 4], 10)
    """

    def __init__(self, report: Report, units: int, passes: int = 1) -> None:
        self.report, self.units, self.passes = report, units, max(passes, 1)
        self.reported, self.last, self.passes_done = 0, 0, 0

    def add(self, units: int) -> None:
        units = min(units, self.units - self.reported)
        if units > 0:
            self.reported += units
            self.report(units)

    def progress(self, done: int, of: int) -> None:
        if done < self.last or (self.last >= of > 0 and done > 0 and self.passes_done + 1 < self.passes):
            self.passes_done += 1
        self.last = done
        fraction = min((self.passes_done + done / max(of, 1)) / self.passes, 1.0)
        self.add(int(fraction * self.units) - self.reported)

    def finish(self) -> None:
        self.add(self.units - self.reported)
