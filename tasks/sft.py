"""Stage 3, sft: TRL ``SFTTrainer`` + a PEFT LoRA adapter teaches the answer format.
Must not import: another stage's module; Prefect and MLflow appear only in its task wrapper. Private TRL internals
live in ``tasks/speedups/``."""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from tasks.config import PipelineConfig
from tasks.environments import pipeline_tools, tool_sft_examples
from tasks.inputs import SOLUTION, answer_completion, read_jsonl, render_prompt, solution_completion
from tasks.layout import ADAPTER, CHECKPOINTS
from tasks.models import load_base_model, load_tokenizer
from tasks.speedups import speedups_on
from tasks.tracking import Tracker, prefect_task, tracked_stage
from tasks.training import (
    MetricsHistory,
    MlflowTrainerCallback,
    TrainResult,
    common_trainer_args,
    lora_config,
    replay_history,
    resumable_checkpoint,
    train_and_save,
    train_on_processes,
)
from tasks.training.nodes import train_on_nodes


def sft_examples(rows: Sequence[dict[str, Any]], tokenizer: Any, config: PipelineConfig) -> list[dict[str, Any]]:
    """Prompt/completion pairs: the row's ``completion`` when present, else its worked solution
    (``data.worked_solution``, ``solution_completion``), else the answer in the reward's format."""

    def completion(row: dict[str, Any]) -> Any:
        answer = answer_completion(config.data.kind, row["ground_truth"])
        if row.get("completion"):
            return row["completion"]
        if isinstance(row.get(SOLUTION), str) and row[SOLUTION].strip():
            return solution_completion(row[SOLUTION], answer)
        return answer

    return [
        {"prompt": render_prompt(tokenizer, row["prompt"], config.data.system_prompt), "completion": completion(row)}
        for row in rows
    ]


def run_sft(
    config: PipelineConfig,
    train_path: Path,
    base_model_dir: Path,
    stage_dir: Path,
    callbacks: Sequence[Any] = (),
) -> TrainResult:
    """Train a fresh LoRA adapter on the train split; returns its folder (adapter weights only)."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from tasks.speedups.frozen import store_frozen_in
    from tasks.speedups.trl_patches import score_only_labelled_positions

    tokenizer = load_tokenizer(base_model_dir)
    tools = pipeline_tools(config, tokenizer)  # the template every stage renders tool turns with
    rows = read_jsonl(train_path)
    examples = tool_sft_examples(rows, tools[0], config) if tools else sft_examples(rows, tokenizer, config)
    dataset = Dataset.from_list(examples)
    model = load_base_model(base_model_dir)
    args = SFTConfig(
        **common_trainer_args(config, stage_dir / CHECKPOINTS, config.sft.checkpoint_steps),
        max_steps=config.sft.max_steps,
        per_device_train_batch_size=config.sft.batch_size,
        learning_rate=config.sft.learning_rate,
        logging_steps=config.sft.logging_steps,
        max_length=config.sft.max_length,
        completion_only_loss=True,
        assistant_only_loss=tools is not None,  # not the tools' answers: the model does not write those
        lr_scheduler_type="cosine",
        warmup_steps=0.1,
    )
    recorder = MetricsHistory()
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=lora_config(config),
        callbacks=[recorder, *callbacks],
    )
    speedups = speedups_on(config.sft.speedups)
    if speedups:
        store_frozen_in(trainer.model, config.model.precision)
    started = time.perf_counter()
    resume_from = resumable_checkpoint(stage_dir / CHECKPOINTS)
    replay_history(resume_from, [recorder, *callbacks])
    with score_only_labelled_positions() if speedups else nullcontext():
        steps = train_and_save(trainer, resume_from, config.sft.max_steps, stage_dir / ADAPTER)
    return TrainResult(stage_dir / ADAPTER, steps, time.perf_counter() - started, recorder.history)


@prefect_task("sft", cache="stage")
def sft_task(config: PipelineConfig, tracker: Tracker, train_path: Path, base_model_dir: Path) -> TrainResult:
    """Prefect wrapper: SFT in its MLflow run, trainer metrics logged step by step."""
    with tracked_stage(tracker, "sft") as stage:
        stage.log_params({f"sft.{k}": v for k, v in config.sft.model_dump().items()})
        if config.orchestration.nodes > 1:
            result = train_on_nodes("sft", config, stage, train_path, base_model_dir)
        elif config.world_size() > 1:
            result = train_on_processes("sft", config, stage, train_path, base_model_dir)
        else:
            result = run_sft(config, train_path, base_model_dir, stage.dir, callbacks=[MlflowTrainerCallback(stage)])
        stage.log_metrics({"train_steps": result.steps, "train_seconds": result.seconds})
        return result
