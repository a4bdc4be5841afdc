"""The GRPO stage's tags and reports in its MLflow run: tool use, which step's adapter went on, an early stop.
Must not import: another stage's module."""

from __future__ import annotations

from typing import Any

from tasks.config import PipelineConfig
from tasks.models import pipeline_backend
from tasks.training import Selection, TrainResult, tool_generation, write_selection


def tool_tags(config: PipelineConfig, trainer_class: type) -> dict[str, str]:
    """The GRPO stage run's tags of tool use: the tools, their per-rollout limits, what samples their turns."""
    if not config.tools.enabled:
        return {}
    tools = config.tools
    limits = f"{tools.max_turns} rounds, {tools.max_calls} calls, {tools.max_seconds:g} s, {tools.max_output_bytes} B"
    return {
        "grpo.tools": ", ".join(spec.name for spec in tools.use),
        "grpo.tool_limits": f"{limits} per rollout",
        "grpo.tool_generation": tool_generation(trainer_class, pipeline_backend(config)),
    }


def report_selection(stage: Any, result: TrainResult) -> None:
    """Which step's adapter GRPO handed on and why (``selection.json`` in the stage folder, where promotion's
    audit reads it; tags), and what the in-training evaluation cost (its seconds and share of the stage)."""
    selection = result.selection or {}
    write_selection(stage.dir, Selection(**selection))
    stage.set_tags(
        {
            "grpo.select": selection["select"],
            "grpo.selected_step": selection["step"],
            "grpo.selection": selection["reason"][:4000],
        }
    )
    metrics: dict[str, float] = {"selected_step": selection["step"]}
    if result.holdout_seconds:
        metrics |= {
            "holdout_seconds": result.holdout_seconds,
            "holdout_share": result.holdout_seconds / max(result.seconds, 1e-9),
        }
    stage.log_metrics(metrics)


def report_stop(stage: Any, run_id: str, verdict: dict[str, Any]) -> None:
    """An early stop's verdict in the stage's MLflow run (tags, metrics), the run log and a Prefect event."""
    from tasks.tracking import emit_pipeline_event, publish_markdown

    stage.set_tags({"grpo.stopped": verdict["cause"], "grpo.stop_verdict": verdict["message"][:4000]})
    stage.log_metrics({"stopped_at_step": verdict["step"]})
    publish_markdown("grpo-stopped", f"### GRPO stopped early at step {verdict['step']}\n{verdict['message']}\n")
    emit_pipeline_event("grpo-stopped", run_id, verdict)
