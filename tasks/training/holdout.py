"""Hold-out accuracy while GRPO trains: every ``grpo.eval_steps`` steps (and at the last), the policy being trained
samples a fixed slice of the hold-out split — the last ``grpo.eval_prompts`` rows — through the engine that
generates (the adapter as it is now, loaded the way evaluation loads one: grpoflow's transformers loop, or vLLM
in-process or on the server), greedy and
``grpo.eval_samples`` samples per prompt, scored by the pipeline's rewards. The scores are transformers' own
evaluation metrics (``eval_holdout_*``: the trainer's log, its callbacks, MLflow, ``trainer_state.json``), so
transformers keeps the best step (``metric_for_best_model``; ties: the earlier) and its checkpoint out of the
rotation, and a resumed run keeps the history. The samples go to the rollout ledger as role ``eval`` (and
``eval_greedy``) at the step. The sampling draws from its own seeded generator inside ``torch.random.fork_rng``:
turning the evaluation on does not change the adapter.

``select_adapter`` hands on the last adapter or the best checkpoint's (``grpo.select``); ``HoldoutPatience`` stops
training when the score has not improved for ``grpo.eval_patience`` evaluations. Both read the slice's noise: an
evaluation counts as better only when it beats the earlier by more than ``grpo.eval_margin`` standard errors of
their paired per-prompt difference (``clearly_better``).
Must not import: Prefect, MLflow, tasks.registry (the stage's callbacks report)."""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from tasks.layout import HOLDOUT_FILE
from tasks.training.learning_signal import StopVerdict

logger = logging.getLogger(__name__)

PREFIX = "eval_holdout_"
SELECTION_FILE = "selection.json"
HOLDOUT_SCORES_FILE = "holdout-scores.json"  # each evaluation's per-prompt scores
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def holdout_slice(rows: Sequence[dict[str, Any]], prompts: int) -> list[dict[str, Any]]:
    """The in-training slice: the last ``prompts`` hold-out rows (the file order is stable).

    >>> [r["id"] for r in holdout_slice([{"id": i} for i in range(5)], 2)]
    [3, 4]
    """
    return list(rows[-prompts:]) if prompts else []


def final_holdout_rows(rows: Sequence[dict[str, Any]], config: Any) -> list[dict[str, Any]]:
    """The rows the final evaluation reports: the first ``evaluation.num_prompts``; whenever GRPO evaluates while it
    trains (``grpo.eval_steps``), none of the in-training slice: it chose the checkpoint (``select: best``) or when
    to stop (``eval_patience``), and the promotion gate reading the same prompts would be biased by that choice.

    >>> from types import SimpleNamespace as N
    >>> config = N(grpo=N(select="last", eval_steps=5, eval_prompts=2), evaluation=N(num_prompts=10))
    >>> [r["id"] for r in final_holdout_rows([{"id": i} for i in range(5)], config)]
    [0, 1, 2]
    """
    settings = config.grpo
    if settings.eval_steps:
        rows = rows[: max(0, len(rows) - settings.eval_prompts)]
    return list(rows[: config.evaluation.num_prompts])


def slice_for(train_path: Path, config: Any) -> list[dict[str, Any]]:
    """The in-training slice of the hold-out file beside ``train_path``; one clear error when it is missing or
    leaves no prompt to the final evaluation (validate refuses that first: ``holdout_problems``)."""
    from tasks.config.grpo_steering import holdout_problems
    from tasks.errors import UserError
    from tasks.inputs import read_jsonl

    path = train_path.with_name(HOLDOUT_FILE)
    if not path.is_file():
        raise UserError(f"grpo.eval_steps: no hold-out file beside {train_path} ({HOLDOUT_FILE}, written by validate)")
    rows = read_jsonl(path)
    problems = holdout_problems(config.grpo, len(rows))
    if problems:
        raise UserError(problems[0])
    return holdout_slice(rows, config.grpo.eval_prompts)


def holdout_trainer_args(config: Any) -> dict[str, Any]:
    """The ``GRPOConfig`` arguments of the in-training evaluation (none when ``grpo.eval_steps`` is 0): transformers
    evaluates every ``eval_steps`` and keeps the checkpoint of ``select: best``'s pick (``pick_evaluation``) by the
    step it reports.

    >>> from types import SimpleNamespace as N
    >>> holdout_trainer_args(N(grpo=N(eval_steps=5, eval_metric="reward", num_generations=8)))["metric_for_best_model"]
    'holdout_selected_step'
    """
    settings = config.grpo
    if not settings.eval_steps:
        return {}
    return {
        "eval_strategy": "steps",
        "eval_steps": settings.eval_steps,
        "metric_for_best_model": "holdout_selected_step",  # the pick's step: it rises only when the pick moves
        "greater_is_better": True,
        "per_device_eval_batch_size": settings.num_generations,  # TRL's check; our evaluation batches its own way
    }


class HoldoutEvaluation:
    """What one in-training evaluation needs: the slice, the pipeline's settings and base model, the ledger."""

    def __init__(
        self,
        config: Any,
        base_model_dir: Path,
        rows: list[dict[str, Any]],
        ledger: Any = None,
        scores_file: Path | None = None,
        resume_step: int | None = None,
    ) -> None:
        self.config, self.base_model_dir, self.rows, self.ledger = config, base_model_dir, rows, ledger
        self.keeps_best = config.grpo.select == "best"
        self.seconds = 0.0
        self._kept: Any = None  # the base model, loaded at the first evaluation (transformers' engine)
        # Each evaluation's per-prompt score of grpo.eval_metric, by step: the paired noise that selection and
        # patience read. Kept in the stage folder so a resumed run has the steps up to its checkpoint.
        self.scores_file = scores_file
        kept = read_per_prompt(scores_file).items()
        self.per_prompt: dict[int, list[float]] = {
            s: v for s, v in kept if resume_step is not None and s <= resume_step
        }
        # The pick so far (pick_evaluation), reported as eval_holdout_selected_step: transformers keeps the checkpoint
        # of its highest value out of the rotation, which is then the pick's, not the plain maximum's.
        means = [(step, sum(values) / len(values)) for step, values in sorted(self.per_prompt.items()) if values]
        self.pick = pick_evaluation(means, self.per_prompt, config.grpo.eval_margin)

    def score(self, trainer: Any, step: int, state_dict: dict[str, Any] | None = None) -> dict[str, float]:
        """Sample the slice with the trainer's policy as it is now (``state_dict``: its weights as the trainer's
        gathering path gave them), score it, ledger it; the metrics (unprefixed)."""
        import torch

        started = time.perf_counter()
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):  # the training random stream is left as it was
            greedy, sampled, backend = self._sample(trainer, step, state_dict)
        metrics = self._metrics(greedy, sampled, backend, step)
        candidate = (step, metrics[self.config.grpo.eval_metric])
        if self.pick is None or improves(candidate, self.pick, self.per_prompt, self.config.grpo.eval_margin):
            self.pick = candidate
        metrics["selected_step"] = float(self.pick[0])
        seconds = time.perf_counter() - started
        self.seconds += seconds
        metrics["seconds"] = seconds
        return metrics

    def _sample(
        self, trainer: Any, step: int, state_dict: dict[str, Any] | None = None
    ) -> tuple[list[list[Any]], list[list[Any]], str]:
        """The adapter as it is now, saved and sampled the way evaluation samples a GRPO adapter (loaded by
        ``policy_sampler`` for the pipeline's engine), so the score is the one evaluation would give it."""
        from tasks.models import policy_sampler

        config = self.config
        adapter_dir = Path(trainer.args.output_dir).parent / "holdout-adapters" / f"step-{step:06d}"
        policy = trainer.accelerator.unwrap_model(trainer.model)
        policy.save_pretrained(str(adapter_dir), state_dict=state_dict)  # PEFT keeps the adapter's part
        try:
            with self._policy(adapter_dir) as model:
                sampler = policy_sampler(config, self.base_model_dir, adapter_dir, config.evaluation.batch_size, model)
                prompts = [sampler.prompt_of(row, config.data.system_prompt) for row in self.rows]
                settings = {"max_new_tokens": config.evaluation.max_new_tokens, "seed": config.seed}
                sampling = {"n": config.grpo.eval_samples, "temperature": config.evaluation.temperature, **settings}
                if hasattr(sampler, "sample_with_greedy"):
                    greedy, sampled = sampler.sample_with_greedy(prompts, **sampling)
                else:
                    greedy = sampler.sample(prompts, greedy=True, **settings)
                    sampled = sampler.sample(prompts, **sampling)
        finally:
            shutil.rmtree(adapter_dir.parent, ignore_errors=True)
        return greedy, sampled, sampler.backend

    def _policy(self, adapter_dir: Path) -> Any:
        """The adapter on the base model this evaluation keeps loaded (transformers' engine; the first evaluation
        loads it), as a context; None for vLLM, whose engine or server holds the base itself."""
        from tasks.models import KeptBase, pipeline_backend

        if pipeline_backend(self.config) == "vllm":
            return contextlib.nullcontext(None)
        if self._kept is None:
            self._kept = KeptBase(self.base_model_dir)
        return self._kept.policy(adapter_dir, self.config.model.precision)

    def _metrics(self, greedy: list[list[Any]], sampled: list[list[Any]], backend: str, step: int) -> dict[str, float]:
        from tasks.evaluation.scoring import score_groups
        from tasks.training.ledger import sample_rows

        greedy_scores = score_groups(self.config, self.rows, greedy)
        sampled_scores = score_groups(self.config, self.rows, sampled)
        if self.ledger is not None:
            for role, completions, scored in (
                ("eval", sampled, sampled_scores),
                ("eval_greedy", greedy, greedy_scores),
            ):
                rows = sample_rows(role, self.rows, completions, scored["per_function"], scored["total"], backend)
                self.ledger.add({**row, "step": step} for row in rows)
        per_prompt = {
            "pass_at_1": sampled_scores["correct"].mean(axis=1),
            "greedy_accuracy": greedy_scores["correct"][:, 0],
            "reward": sampled_scores["total"].mean(axis=1),
        }
        self.per_prompt[step] = [float(v) for v in per_prompt[self.config.grpo.eval_metric]]
        if self.scores_file is not None:
            self.scores_file.write_text(json.dumps({str(k): v for k, v in sorted(self.per_prompt.items())}))
        return {name: float(values.mean()) for name, values in per_prompt.items()}


class HoldoutEvaluationMixin:
    """Trainer mixin: ``evaluate`` (transformers calls it every ``eval_steps``) runs ``HoldoutEvaluation`` on the
    first process and hands the numbers to every other (which wait for them), logs them as the step's
    ``eval_holdout_*`` metrics, and with ``select: best`` saves a checkpoint at that step. Without ``holdout`` it
    changes nothing."""

    def __init__(self, *args: Any, holdout: HoldoutEvaluation | None = None, **kwargs: Any) -> None:
        self.holdout = holdout
        super().__init__(*args, **kwargs)

    def evaluate(self, eval_dataset: Any = None, ignore_keys: Any = None, metric_key_prefix: str = "eval") -> Any:  # noqa: D102
        if self.holdout is None:
            return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)  # type: ignore[misc]
        from accelerate.utils import broadcast_object_list

        step = self.state.global_step
        # Every rank takes part in gathering the weights, as transformers' save_model does: under DeepSpeed ZeRO-3 a
        # rank holds a shard, and the first process saving alone would write empty tensors.
        state = self.accelerator.get_state_dict(self.model) if self.accelerator.num_processes > 1 else None
        main = self.accelerator.is_main_process
        numbers = [(self.holdout.score(self, step, state), self.holdout.per_prompt[step]) if main else None]
        if self.accelerator.num_processes > 1:  # every rank's patience reads the same scores and noise
            broadcast_object_list(numbers, from_process=0)
        scores, self.holdout.per_prompt[step] = numbers[0]
        metrics = {f"{metric_key_prefix}_holdout_{key}": value for key, value in scores.items()}
        model = self.model
        was_training = model.training
        model.eval()  # TRL's log adds its per-mode metrics: in eval mode, the (empty) evaluation ones
        try:
            self.log(metrics)
        finally:
            model.train(was_training)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        if self.holdout.keeps_best:
            self.control.should_save = True  # every evaluation falls on a checkpoint the best can be taken from
        return metrics


class HoldoutPatience(TrainerCallback):
    """Evaluates at the last step too (so ``last`` is among the candidates), and stops GRPO when the score has not
    improved for ``patience`` evaluations in a row (0: never), with a verdict like the signal guards'. History
    replayed on resume rebuilds the count."""

    replays_history = True  # tasks.training.trainer.replay_history hands it the metrics logged before a resume

    def __init__(
        self, metric: str, patience: int, margin: float = 0.0, per_prompt: dict[int, list[float]] | None = None
    ) -> None:
        self.key, self.patience, self.margin = f"{PREFIX}{metric}", patience, margin
        self.per_prompt = per_prompt if per_prompt is not None else {}
        self.best: tuple[int, float] | None = None
        self.since_best = 0
        self.verdict: StopVerdict | None = None

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step >= state.max_steps and args.eval_strategy != "no":
            control.should_evaluate = True

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        value = (logs or {}).get(self.key)
        if value is None:
            return
        step = state.global_step
        if self.best is None or improves((step, value), self.best, self.per_prompt, self.margin):
            self.best, self.since_best = (step, value), 0
            return
        self.since_best += 1
        if control is None or not self.patience or self.since_best < self.patience or self.verdict is not None:
            return
        self.verdict = StopVerdict(
            cause="holdout_plateau",
            step=state.global_step,
            message=(
                f"hold-out {self.key.removeprefix(PREFIX)} has not improved on {self.best[1]:.4g} (step "
                f"{self.best[0]}) by more than {self.margin:g} standard errors for {self.since_best} evaluations "
                f"(grpo.eval_patience {self.patience}, grpo.eval_margin); stopped at step {state.global_step}"
            ),
            numbers={"best": self.best[1], "last": float(value), "evaluations_since_best": self.since_best},
        )
        logger.warning("GRPO stops early: %s", self.verdict.message)
        control.should_training_stop = True


@dataclass
class Selection:
    """Which GRPO adapter went on, and why (``selection.json`` in the stage folder, the run's tags)."""

    select: str
    step: int
    last_step: int
    metric: str | None = None
    score: float | None = None
    last_score: float | None = None
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def evaluations(history: Sequence[dict[str, float]], metric: str) -> list[tuple[int, float]]:
    """``(step, score)`` of every in-training evaluation in a trainer's history, in order, each step once.

    >>> evaluations([{"step": 2, "eval_holdout_reward": 0.5}, {"step": 2, "loss": 1.0}], "reward")
    [(2, 0.5)]
    """
    found = {int(e["step"]): float(e[f"{PREFIX}{metric}"]) for e in history if f"{PREFIX}{metric}" in e}
    return sorted(found.items())


def clearly_better(later: Sequence[float], earlier: Sequence[float], margin: float) -> bool:
    """Whether ``later`` (per-prompt scores) beats ``earlier`` (the same prompts, in the same order) by more than
    ``margin`` standard errors of their paired difference; with ``margin`` 0, by any amount.

    >>> clearly_better([1, 1, 0, 0], [0, 1, 0, 0], 1.0)  # +0.25, one standard error 0.25: not beyond it
    False
    >>> clearly_better([1, 1, 0, 0], [0, 0, 0, 0], 1.0)  # +0.5, one standard error 0.29
    True
    >>> clearly_better([1, 1, 0, 0], [0, 1, 0, 0], 0.0)
    True
    """
    import numpy as np

    difference = np.subtract(np.asarray(later, dtype=float), np.asarray(earlier, dtype=float))
    error = difference.std(ddof=1) / np.sqrt(len(difference)) if len(difference) > 1 else 0.0
    return bool(difference.mean() > 0 and difference.mean() > margin * error)


def improves(
    candidate: tuple[int, float], best: tuple[int, float], per_prompt: dict[int, list[float]], margin: float
) -> bool:
    """Whether the evaluation ``(step, score)`` ``candidate`` replaces ``best``: ``clearly_better`` on both steps'
    per-prompt scores, or a plain higher score where either step's are unknown (a history from before them).

    >>> improves((20, 0.5), (10, 0.25), {10: [0, 1, 0, 0], 20: [1, 1, 0, 0]}, 1.0)
    False
    >>> improves((20, 0.5), (10, 0.25), {}, 1.0)
    True
    """
    if candidate[0] in per_prompt and best[0] in per_prompt:
        return clearly_better(per_prompt[candidate[0]], per_prompt[best[0]], margin)
    return candidate[1] > best[1]


def pick_evaluation(
    scores: Sequence[tuple[int, float]], per_prompt: dict[int, list[float]] | None = None, margin: float = 0.0
) -> tuple[int, float] | None:
    """The evaluation ``select: best`` hands on: the earliest, replaced in step order by each later one that
    ``improves`` on it, so a later step wins only when it is better beyond the noise of the slice (with ``margin``
    0 or no per-prompt scores: the highest score, ties to the earlier).

    >>> pick_evaluation([(5, 0.2), (10, 0.4), (15, 0.4)])
    (10, 0.4)
    >>> per_prompt = {10: [0, 0, 1, 0], 20: [0, 1, 1, 0], 30: [1, 1, 1, 0]}
    >>> pick_evaluation([(10, 0.25), (20, 0.5), (30, 0.75)], per_prompt, 1.0)  # 20 is within step 10's noise
    (30, 0.75)
    """
    best = None
    for step, score in scores:
        if best is None or improves((step, score), best, per_prompt or {}, margin):
            best = (step, score)
    return best


def read_per_prompt(path: Path | None) -> dict[int, list[float]]:
    """The per-prompt scores ``HoldoutEvaluation`` kept, by step (empty when there are none)."""
    if path is None or not path.is_file():
        return {}
    return {int(step): values for step, values in json.loads(path.read_text()).items()}


def select_adapter(
    config: Any,
    history: Sequence[dict[str, float]],
    last_step: int,
    checkpoints_dir: Path,
    adapter_dir: Path,
    per_prompt: dict[int, list[float]] | None = None,
) -> Selection:
    """With ``grpo.select: best``, replace the adapter in ``adapter_dir`` by the picked checkpoint's
    (``pick_evaluation``; its files as they are: the bytes evaluation and promotion then read); either way, say which
    step went on and why."""
    settings = config.grpo
    scores = evaluations(history, settings.eval_metric)
    last_score = dict(scores).get(last_step)
    metric = f"hold-out {settings.eval_metric}"
    if settings.select != "best" or not scores:
        reason = "grpo.select last" + ("" if settings.select == "last" else ": no in-training evaluation ran")
        return Selection(settings.select, last_step, last_step, settings.eval_metric, last_score, last_score, reason)
    margin = settings.eval_margin
    step, score = pick_evaluation(scores, per_prompt, margin)  # type: ignore[misc]
    if step != last_step:
        checkpoint = checkpoints_dir / f"checkpoint-{step}"
        if not all((checkpoint / name).is_file() for name in ADAPTER_FILES):
            raise FileNotFoundError(f"grpo.select best: {checkpoint} (the best step's checkpoint) has no adapter")
        for name in ADAPTER_FILES:
            shutil.copy2(checkpoint / name, adapter_dir / name)
    previous = ", ".join(f"{s}: {v:.4g}" for s, v in scores)
    reason = (
        f"grpo.select best: {metric} {score:.4g} at step {step} of {len(scores)} evaluations ({previous}); a later "
        f"step replaces an earlier pick only when it beats it by more than {margin:g} standard errors of their "
        f"paired per-prompt difference (grpo.eval_margin)"
    )
    logger.info("GRPO hands on the adapter of step %d of %d: %s", step, last_step, reason)
    return Selection("best", step, last_step, settings.eval_metric, score, last_score, reason)


def write_selection(stage_dir: Path, selection: Selection) -> Path:
    """The selection beside the adapter, where promotion's audit reads which steps made it."""
    path = stage_dir / SELECTION_FILE
    path.write_text(json.dumps(selection.to_json(), indent=2))
    return path


def read_selection(stage_dir: Path) -> Selection | None:
    """The GRPO stage's selection, if it wrote one."""
    path = stage_dir / SELECTION_FILE
    return Selection(**json.loads(path.read_text())) if path.is_file() else None
