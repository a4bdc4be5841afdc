"""The end-of-run summary ``grpoflow run`` prints: stage times, probes, the hold-out table, the gains, and what
promotion did. Must not hold stage logic: it reads the run's summary dict."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from tasks.evaluation import describe

console = Console()


def print_summary(summary: dict[str, Any]) -> None:
    """The end-of-run table: stage times, probes, hold-out accuracy per model, the gain, the registry outcome."""
    times = Table(title=f"run {summary['run_id']}: stage wall time")
    times.add_column("stage")
    times.add_column("seconds", justify="right")
    for stage, seconds in summary.get("stage_seconds", {}).items():
        times.add_row(stage, f"{seconds:.1f}")
    console.print(times)
    data = summary.get("data") or {}
    if "rows_in" in data:
        reasons = ", ".join(
            f"{reason} ×{count}"
            for reason, count in sorted((data.get("reasons") or {}).items(), key=lambda item: -item[1])[:3]
        )
        console.print(
            f"data: {data['rows_in']} rows, {data['rows_kept']} kept, {data['rows_quarantined']} "
            f"quarantined{' (' + reasons + ')' if reasons else ''}"
        )
    probes = Table(title="probes (G samples per prompt, GRPO sampling settings)")
    for column in ("policy", "prompts", "groups with signal", "mean pass rate", "mean reward", "verdict"):
        probes.add_column(column, justify="right")
    for label, probe in summary.get("probes", {}).items():
        probes.add_row(
            label,
            str(probe["prompts"]),
            f"{probe['signal_share']:.0%}",
            f"{probe['pass_rate_mean']:.1%}",
            f"{probe['reward_mean']:.3f}",
            probe.get("verdict", "").split(":")[0],
        )
    console.print(probes)
    stopped = (summary.get("grpo") or {}).get("stopped")
    if stopped:
        console.print(f"GRPO stopped early at step {stopped['step']} ({stopped['cause']}): {stopped['message']}")
    selected = (summary.get("grpo") or {}).get("selected")
    if selected and selected.get("select") == "best":  # which step's adapter "grpo" below is
        console.print(
            f"GRPO handed on the adapter of step {selected['step']} of {selected['last_step']}: {selected['reason']}"
        )
    evaluation = summary.get("evaluation")
    if evaluation:
        engine = evaluation.get("engine", "transformers")
        table = Table(title=f"hold-out evaluation (same prompts for every model; sampled by {engine})")
        models = evaluation["models"]
        ks = list(next(iter(models.values()))["pass_at_k"])
        for column in ("model", "prompts", "greedy acc", *[f"pass@{k}" for k in ks], "pass@1 95% CI"):
            table.add_column(column, justify="right")
        for name, score in models.items():
            low, high = score["pass1_interval"]
            table.add_row(
                name,
                f"{score['n_prompts']}×{score['n_samples']}",
                f"{score['greedy_accuracy']:.1%}",
                *[f"{score['pass_at_k'][k]:.1%}" for k in ks],
                f"[{low:.1%}, {high:.1%}]",
            )
        console.print(table)
        if any(score.get("without_tools") for score in models.values()):
            console.print(tool_table(models))
        for against, key in (("base", "forgetting"), ("champion", "forgetting_vs_champion")):
            if evaluation.get(key):  # intervals are 95 %, paired over the same questions and documents
                console.print(f"forgetting vs {against}: {describe(evaluation[key])}")
        for key, diff in evaluation["comparisons"].items():
            console.print(
                f"{key}: sampled pass@1 gain {diff['mean']:+.1%} "
                f"(paired 95% CI [{diff['low']:+.1%}, {diff['high']:+.1%}], n={diff['n']} prompts)"
            )
    promotion = summary.get("promotion")
    for finding in (promotion or {}).get("audit") or []:
        console.print(f"[yellow]reward audit[/yellow] {finding['detector']}: {finding['message']}")
    if promotion:
        outcome = "[green]champion[/green]" if promotion["promoted"] else "[yellow]challenger[/yellow]"
        console.print(
            f"registered {promotion['registered_model']} v{promotion['version']} "
            f"(SFT backup: {promotion['registered_model']}-sft v{promotion['sft_version']}) → {outcome}: "
            f"{promotion['reason']}"
        )


def tool_table(models: dict[str, Any]) -> Table:
    """Each model with its tools and without them on the same prompts, and the paired gain the tools give."""
    table = Table(title="with and without the tools (same prompts, paired)")
    for column in ("model", "greedy with", "greedy without", "pass@1 with", "pass@1 without", "tool gain (95% CI)"):
        table.add_column(column, justify="right")
    table.add_column("calls / rollout", justify="right")
    for name, score in models.items():
        plain = score.get("without_tools")
        if not plain:
            continue
        gain = plain["tool_gain"]
        table.add_row(
            name,
            f"{score['greedy_accuracy']:.1%}",
            f"{plain['greedy_accuracy']:.1%}",
            f"{score['pass_at_k']['1']:.1%}",
            f"{plain['pass_at_k']['1']:.1%}",
            f"{gain['mean']:+.1%} [{gain['low']:+.1%}, {gain['high']:+.1%}]",
            f"{score.get('tool_use', {}).get('calls_per_rollout', 0.0):.2f}",
        )
    return table
