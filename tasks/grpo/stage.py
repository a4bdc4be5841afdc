"""The GRPO stage's composition: the trainer built from the config (rewards with their weights as TRL's
``reward_weights``, callbacks, the in-training hold-out, the sampler), and its Prefect task.
Must not import: another stage's module; Prefect and MLflow appear only in its task wrapper. Private TRL internals
live in ``tasks/speedups/``."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from reward_fns.registry import CORRECTNESS_REWARD, build_reward_functions, reward_columns
from tasks.config import PipelineConfig
from tasks.environments import pipeline_tools
from tasks.evaluation import verdict_cache
from tasks.grpo.reports import report_selection, report_stop, tool_tags
from tasks.inputs import prompt_messages, read_jsonl, render_prompt
from tasks.layout import (
    ADAPTER,
    CHECKPOINTS,
)
from tasks.models import engine_name, load_policy, load_tokenizer, pipeline_backend
from tasks.speedups import speedups_on
from tasks.tracking import Tracker, prefect_task, tracked_stage
from tasks.training import (
    HOLDOUT_SCORES_FILE,
    LEDGER_DIR,
    CheckpointMirror,
    HoldoutEvaluation,
    HoldoutPatience,
    LedgerCallback,
    LedgerRecorder,
    MetricsHistory,
    MlflowTrainerCallback,
    NoneShareGuard,
    RewardNoneLimitExceeded,
    SamplerAgreement,
    SamplerAgreementGuard,
    SignalStateSaver,
    SignalStop,
    TrainResult,
    checkpoint_step,
    grpo_trainer_class,
    grpo_training_args,
    load_signal_state,
    lora_config,
    replay_history,
    resumable_checkpoint,
    select_adapter,
    slice_for,
    store_for,
    train_and_save,
    train_on_processes,
    vllm_setup,
    write_selection,
)
from tasks.training.nodes import train_on_nodes

logger = logging.getLogger(__name__)


def grpo_examples(rows: Sequence[dict[str, Any]], tokenizer: Any, config: PipelineConfig) -> list[dict[str, Any]]:
    """Rendered prompts plus every other column of the validated rows, which TRL hands the reward functions
    (``reward_columns``: the same values evaluation hands them). With tools, the prompts stay messages: TRL renders
    them itself with the tools' schemas and parses the completions into conversations."""
    columns = reward_columns(rows)
    system = config.data.system_prompt
    return [
        {
            "prompt": prompt_messages(row["prompt"], system)
            if config.tools.enabled
            else render_prompt(tokenizer, row["prompt"], system),
            **{name: values[index] for name, values in columns.items()},
        }
        for index, row in enumerate(rows)
    ]


def run_grpo(
    config: PipelineConfig,
    train_path: Path,
    base_model_dir: Path,
    sft_adapter_dir: Path | None,
    stage_dir: Path,
    callbacks: Sequence[Any] = (),
    keep_ids: set[str] | None = None,
    completion_sink: Callable[[int, dict[str, list[Any]]], None] | None = None,
) -> TrainResult:
    """Continue the SFT adapter with GRPO (or train a fresh one when SFT was disabled)."""
    from datasets import Dataset

    from tasks.speedups.frozen import store_frozen_in

    rows = read_jsonl(train_path)
    if keep_ids is not None:
        rows = [row for row in rows if row["id"] in keep_ids]
    if not rows:
        raise ValueError("no training prompts left for GRPO (did the probe's pass-rate filter drop them all?)")
    tokenizer = load_tokenizer(base_model_dir)
    tools = pipeline_tools(config, tokenizer)  # the template every stage renders tool turns with
    dataset = Dataset.from_list(grpo_examples(rows, tokenizer, config))
    eval_rows = slice_for(train_path, config) if config.grpo.eval_steps else []
    model = load_policy(base_model_dir, sft_adapter_dir, trainable=True)
    rewards, weights = build_reward_functions(config.rewards, verdict_cache(config.rewards))
    settings = config.grpo
    backend = pipeline_backend(config)
    logger.info(
        "GRPO generation backend: %s (configured: %s%s)",
        backend,
        settings.generation.backend,
        f", {settings.generation.vllm_mode} mode" if backend == "vllm" else "",
    )
    args = grpo_training_args(config, stage_dir, backend, weights)
    recorder = MetricsHistory()
    resume_from = resumable_checkpoint(stage_dir / CHECKPOINTS)
    pool = load_signal_state(resume_from, settings.dynamic_sampling.retire_after)
    signal_stop = SignalStop(settings.stop)
    speedups = speedups_on(settings.speedups)
    trainer_class = grpo_trainer_class(settings.speedups)
    logger.info("GRPO trainer: %s (grpo.speedups %s)", trainer_class.__name__, settings.speedups)
    if tools is not None:
        summary = {**tool_tags(config, trainer_class), "template": tools[1].describe()}
        logger.info("GRPO %s", "; ".join(f"{key.removeprefix('grpo.')}: {value}" for key, value in summary.items()))
    ledger = LedgerRecorder(stage_dir / LEDGER_DIR)
    scores_file = stage_dir / HOLDOUT_SCORES_FILE
    if resume_from is None:
        scores_file.unlink(missing_ok=True)  # a fresh run's evaluations only
    resume_step = checkpoint_step(resume_from) if resume_from else None
    holdout = (
        HoldoutEvaluation(config, base_model_dir, eval_rows, ledger, scores_file, resume_step) if eval_rows else None
    )
    per_prompt = holdout.per_prompt if holdout else {}
    patience = HoldoutPatience(settings.eval_metric, settings.eval_patience, settings.eval_margin, per_prompt)
    ledger_writer = LedgerCallback(
        ledger,
        settings.ledger_flush_steps,
        settings.checkpoint_steps > 0,
        completion_sink,
        settings.log_completions_every,
    )
    agreement = SamplerAgreement()
    engine = engine_name(backend, settings.generation.vllm_mode)
    trainer = trainer_class(
        sampler_agreement=agreement,
        holdout=holdout,
        ledger=ledger,
        backend=engine,
        dynamic_sampling=settings.dynamic_sampling,
        correctness_reward=CORRECTNESS_REWARD.get(config.data.kind),
        retirement_pool=pool,
        vllm_setup=vllm_setup(config, base_model_dir, backend),
        **({"environment_factory": tools[0].factory} if tools else {}),
        **({"precision": config.model.precision} if speedups else {}),
        model=model,
        reward_funcs=rewards,
        args=args,
        train_dataset=dataset,
        eval_dataset=Dataset.from_list(grpo_examples(eval_rows, tokenizer, config)) if holdout else None,
        processing_class=tokenizer,
        peft_config=None if sft_adapter_dir else lora_config(config),
        callbacks=[
            recorder,
            NoneShareGuard(rewards, settings.max_none_share),
            signal_stop,
            SignalStateSaver(pool),
            SamplerAgreementGuard(agreement, settings.generation.max_logp_difference, engine),
            *([patience] if holdout else []),
            ledger_writer,  # before the callbacks handed in: a checkpoint mirror copies the ledger's copy too
            *callbacks,
        ],
    )
    if speedups:
        store_frozen_in(trainer.model, config.model.precision)  # the adapter exists by now (SFT's or a new one)
    if trainer.is_world_process_zero():
        ledger.restore(resume_from)  # a fresh ledger, or the checkpoint's: rows of later steps come again
    started = time.perf_counter()
    replay_history(resume_from, [recorder, signal_stop, patience, *callbacks])
    try:
        steps = train_and_save(trainer, resume_from, settings.max_steps, stage_dir / ADAPTER)
    finally:
        close = getattr(getattr(trainer, "vllm_generation", None), "close", None)
        if close is not None:
            close()  # the synced adapters' folder
    generated_by = trainer.generation_record.describe()
    if agreement.steps:  # this process's view of every rank's differences (each rank records the gathered sums)
        run = agreement.summary()
        logger.info(
            "GRPO sampler agreement over %d steps: mean |log-prob difference| %.4f, worst step %.4f, worst token %.3f",
            run["steps"],
            run["mean"],
            run["max_step_mean"],
            run["max"],
        )
    logger.info(
        "GRPO generated with %s; rollout ledger: %d bytes written in %.2f s",
        generated_by,
        ledger.bytes_written,
        ledger.seconds,
    )
    for reward in rewards:  # however short the run: an adapter trained on unjudged samples is not promoted
        stats = reward.stats
        if stats.scored and stats.none_share > settings.max_none_share:
            raise RewardNoneLimitExceeded(
                f"reward {reward.__name__} could not judge {stats.none}/{stats.scored} completions "
                f"({stats.none_share:.0%} > grpo.max_none_share {settings.max_none_share:.0%}; last error: "
                f"{stats.last_error}); the run stops before evaluation and promotion"
            )
    selection = None
    if trainer.is_world_process_zero():
        selection = select_adapter(
            config, recorder.history, steps, stage_dir / CHECKPOINTS, stage_dir / ADAPTER, per_prompt
        )
        write_selection(stage_dir, selection)
    verdict = signal_stop.verdict or patience.verdict
    return TrainResult(
        stage_dir / ADAPTER,
        steps,
        time.perf_counter() - started,
        recorder.history,
        verdict.to_json() if verdict else None,
        generated_by=generated_by,
        selection=selection.to_json() if selection else None,
        holdout_seconds=holdout.seconds if holdout else 0.0,
    )


@prefect_task("grpo", cache="stage")
def grpo_task(
    config: PipelineConfig,
    tracker: Tracker,
    train_path: Path,
    base_model_dir: Path,
    sft_adapter_dir: Path | None,
    keep_ids: set[str] | None = None,
    checkpoint_store: dict[str, Any] | None = None,
) -> TrainResult:
    """Prefect wrapper: GRPO in its MLflow run, TRL's metrics (rewards, frac_reward_zero_std, ...) per step.
    ``checkpoint_store`` (``tasks.training.remote_checkpoints.store_for``): each checkpoint is also copied there."""
    with tracked_stage(tracker, "grpo") as stage:
        stage.log_params({f"grpo.{k}": v for k, v in config.grpo.model_dump().items()})
        trainer_class = grpo_trainer_class(config.grpo.speedups)
        stage.set_tags(
            {
                "generation_backend_configured": config.grpo.generation.backend,
                "grpo.trainer": trainer_class.__name__,
                **tool_tags(config, trainer_class),
            }
        )
        if keep_ids is not None:
            stage.log_metrics({"prompts_kept_by_filter": len(keep_ids)})
        if config.orchestration.nodes > 1:
            result = train_on_nodes(
                "grpo", config, stage, train_path, base_model_dir, sft_adapter_dir, keep_ids, checkpoint_store
            )
        elif config.world_size() > 1:
            result = train_on_processes(
                "grpo", config, stage, train_path, base_model_dir, sft_adapter_dir, keep_ids, checkpoint_store
            )
        else:
            keep = config.orchestration.keep_checkpoints
            mirror = [CheckpointMirror(store_for(checkpoint_store), keep)] if checkpoint_store else []
            result = run_grpo(
                config,
                train_path,
                base_model_dir,
                sft_adapter_dir,
                stage.dir,
                [MlflowTrainerCallback(stage), *mirror],
                keep_ids,
                completion_sink=lambda step, table: stage.log_table(table, f"completions/step_{step:05d}.json"),
            )
        stage.log_metrics({"train_steps": result.steps, "train_seconds": result.seconds})
        if result.selection:
            report_selection(stage, result)
        stage.log_artifact(result.adapter_dir.parent / LEDGER_DIR, LEDGER_DIR)  # the rollout ledger's parts
        if result.generated_by:  # what generated, not what was configured
            stage.set_tags(
                {"generation_backend": result.generated_by.split(":")[0], "generation": result.generated_by[:4000]}
            )
        if result.stop:
            report_stop(stage, tracker.run_id, result.stop)
        return result
