"""The rollout ledger's commands: ``rollouts`` (browse and filter a run's samples) and ``rescore`` (what another
reward would have said about them).
Must not import: a stage, torch or Prefect at import; must not hold scoring logic (``tasks.evaluation`` owns it).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from flows.cli.common import ConfigOption, SetOption, TrackingOption, config_from, console, print_table, store_uri

RunArg = Annotated[str, typer.Argument(help="A pipeline run id, its folder, or a ledger folder (rollouts/).")]


def ledger_rows(run: str, config: Any, tracking_uri: str | None) -> list[dict[str, Any]]:
    """Every ledger row of a run: from a ledger folder, a run folder (every stage's ``rollouts/``), the config's
    output folder, or else the run's GRPO stage in the tracking store (its ``rollouts`` artifacts)."""
    import tempfile

    from tasks.errors import UserError
    from tasks.training import LEDGER_DIR, read_ledger

    path = Path(run)
    for folder in (path, config.output_dir / run):
        if folder.is_dir() and any(folder.glob("*.parquet")):
            return read_ledger(folder)
        parts = sorted(folder.glob(f"*/{LEDGER_DIR}")) if folder.is_dir() else []
        if parts:
            return [row for part in parts for row in read_ledger(part)]
    from tasks.tracking import RUN_ID_TAG, client_for

    uri = store_uri(config, tracking_uri)
    client = client_for(uri)
    experiment = client.get_experiment_by_name(config.tracking.experiment_name)
    runs = []
    if experiment is not None:
        query = f"tags.`{RUN_ID_TAG}` = '{run}' and tags.`grpoflow.stage` = 'grpo'"
        runs = client.search_runs([experiment.experiment_id], query, max_results=1)
    if not runs:
        raise UserError(
            f"no rollout ledger for {run!r}: not a folder with one, not under {config.output_dir}, and "
            f"no GRPO stage of that run id in {uri}"
        )
    with tempfile.TemporaryDirectory(prefix="grpoflow-ledger-") as scratch:  # rows are read into memory
        return read_ledger(Path(client.download_artifacts(runs[0].info.run_id, LEDGER_DIR, scratch)))


def _show(rows: list[dict[str, Any]], output: str, title: str) -> None:
    if output == "jsonl":
        for row in rows:
            sys.stdout.write(json.dumps(row, default=str) + "\n")
        return
    from reward_fns.text import question_of

    shown = []
    for row in rows:
        item = {key: row[key] for key in ("step", "prompt_id", "reward_total", "advantage", "trained") if key in row}
        item.update(question=question_of(row.get("prompt", ""))[:60], completion=str(row.get("completion", ""))[:80])
        if row.get("turns"):  # a tool-using rollout: its calls, how many failed
            item["tools"] = f"{row.get('tool_calls') or 0} calls, {row.get('tool_errors') or 0} failed"
        item["backend"] = row.get("backend")
        shown.append(
            {
                key: ("" if value is None else f"{value:.3g}" if isinstance(value, float) else str(value))
                for key, value in item.items()
            }
        )
    print_table(title, shown)


def conversation_lines(row: dict[str, Any]) -> list[str]:
    r"""A ledger row as the conversation it was: each assistant turn's words and calls, each tool answer with its
    time and whether it failed (a row without tool turns: its completion).

    >>> turns = [{"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
    ...     "name": "python", "arguments": {"code": "print(6*7)"}}}]}, {"role": "tool", "name": "python",
    ...     "content": "42", "seconds": 0.05, "failed": False}, {"role": "assistant", "content": "\\boxed{42}"}]
    >>> print("\n".join(conversation_lines({"turns": json.dumps(turns), "completion": "x"})))
    assistant: calls python(code='print(6*7)')
    tool python (0.05 s): 42
    assistant: \boxed{42}
    """
    if not row.get("turns"):
        return [f"assistant: {row.get('completion', '')}"]
    lines = []
    for turn in json.loads(row["turns"]):
        if turn.get("role") == "tool":
            seconds = turn.get("seconds")
            timing = f" ({seconds:.2f} s{', failed' if turn.get('failed') else ''})" if seconds is not None else ""
            lines.append(f"tool {turn.get('name', '?')}{timing}: {turn.get('content', '')}")
            continue
        if turn.get("content"):
            lines.append(f"assistant: {turn['content']}")
        for call in turn.get("tool_calls") or []:
            function = call.get("function", call)
            arguments = function.get("arguments") or {}
            if isinstance(arguments, str):
                arguments = json.loads(arguments)
            shown = ", ".join(f"{key}={value!r}" for key, value in arguments.items())
            lines.append(f"assistant: calls {function.get('name')}({shown})")
    return lines


def _show_conversations(rows: list[dict[str, Any]], title: str) -> None:
    from reward_fns.text import question_of

    console.print(title)
    for row in rows:
        reward = row.get("reward_total")
        head = f"step {row.get('step')} · {row.get('prompt_id')}" + (
            f" · reward {reward:.3g}" if isinstance(reward, float) else ""
        )
        console.print(f"\n[bold]{head}[/bold]", highlight=False)
        console.print(f"user: {question_of(row.get('prompt', ''))}", markup=False, highlight=False)
        for line in conversation_lines(row):
            console.print(line, markup=False, highlight=False, soft_wrap=True)


def rollouts(
    run: RunArg,
    steps: Annotated[str | None, typer.Option(help="A step range, e.g. 1:10 or 25.")] = None,
    reward: Annotated[str | None, typer.Option(help="Filter on this reward (else the weighted total).")] = None,
    min_value: Annotated[float | None, typer.Option("--min", help="Reward at least this.")] = None,
    max_value: Annotated[float | None, typer.Option("--max", help="Reward at most this.")] = None,
    prompt_id: Annotated[str | None, typer.Option("--prompt-id", help="Only this prompt.")] = None,
    grep: Annotated[str | None, typer.Option(help="Text in the prompt or completion.")] = None,
    role: Annotated[
        str | None,
        typer.Option(help="grpo (default), eval (GRPO's in-training hold-out), probe_base, probe_sft, eval_grpo, ..."),
    ] = "grpo",
    worst: Annotated[int | None, typer.Option(help="The N groups with the lowest mean reward.")] = None,
    best: Annotated[int | None, typer.Option(help="The N groups with the highest mean reward.")] = None,
    diff: Annotated[tuple[int, int] | None, typer.Option(help="STEP_A STEP_B: the same prompts early, late.")] = None,
    limit: Annotated[int, typer.Option(help="At most this many rows (0: all).")] = 20,
    output: Annotated[str, typer.Option("--format", help="table or jsonl.")] = "table",
    show_conversation: Annotated[
        bool, typer.Option("--conversation", help="Each row as its conversation: turns, tool calls and answers.")
    ] = False,
    config: ConfigOption = None,
    tracking_uri: TrackingOption = None,
    set_: SetOption = None,
) -> None:
    """Browse a run's rollout ledger: every sample GRPO trained on (and those the filter set aside), the probes'
    and evaluation's samples; filter, rank groups, or compare the same prompts early and late."""
    from tasks.evaluation import diff_steps, extreme_groups, filter_rows

    cfg = config_from(None, set_, config)
    rows = ledger_rows(run, cfg, tracking_uri)
    if diff:
        pairs = diff_steps(rows, *diff)[: limit or None]
        if output == "jsonl":
            _show(pairs, output, "")
            return
        same = all(p["same_prompt"] for p in pairs)
        title = (
            f"{run}: the same prompts at step ≤ {diff[0]} and ≥ {diff[1]} ({len(pairs)} shown)"
            if same
            else f"{run}: no prompt was sampled both by step {diff[0]} and from step {diff[1]} (each is drawn once per "
            f"epoch): steps {pairs[0]['step_a']} and {pairs[0]['step_b']}, group by group"
        )
        print_table(
            title,
            [
                {
                    "prompt_id": p["prompt_id"],
                    "steps": f"{p['step_a']}→{p['step_b']}",
                    "reward": f"{p['reward_a']:.2f}→{p['reward_b']:.2f}",
                    "early": str(p["completion_a"])[:50],
                    "late": str(p["completion_b"])[:50],
                }
                for p in pairs
            ],
        )
        return
    span = None
    if steps:
        first, _, last = steps.partition(":")
        span = (int(first), int(last or first))
    rows = filter_rows(
        rows,
        steps=span,
        reward=reward,
        min_value=min_value,
        max_value=max_value,
        prompt_id=prompt_id,
        text=grep,
        role=role or None,
    )
    if worst or best:
        rows = extreme_groups(rows, worst or best or 0, worst=bool(worst))
    total = len(rows)
    title = f"{run}: {min(total, limit or total)} of {total} rows"
    if show_conversation and output == "table":
        _show_conversations(rows[: limit or None], title)
        return
    _show(rows[: limit or None], output, title)


def rescore(
    run: RunArg,
    reward: Annotated[str, typer.Option(help="A built-in reward name or module:function.")],
    path: Annotated[Path | None, typer.Option(help="Folder to import module:function from.")] = None,
    weight: Annotated[float, typer.Option(help="Its weight, when it is not one of the run's rewards.")] = 1.0,
    config: ConfigOption = None,
    tracking_uri: TrackingOption = None,
    set_: SetOption = None,
) -> None:
    """Re-score a run's GRPO samples with another reward (or a new version of one) and say what would have
    changed: agreement with the training reward, groups turned (un)informative, the advantages' correlation.
    The reward's canaries run first."""
    from reward_fns.canaries import check_canaries, kind_canaries
    from reward_fns.judges import JUDGES
    from reward_fns.registry import build_reward_functions
    from tasks.errors import UserError
    from tasks.evaluation import rescore_report, reward_kwargs, verdict_cache

    cfg = config_from(None, set_, config)
    rows = [r for r in ledger_rows(run, cfg, tracking_uri) if r.get("role") == "grpo"]
    if not rows:
        raise UserError(f"the ledger of {run!r} holds no GRPO samples")
    configured = [s for s in cfg.rewards if s.name == reward]
    # A reward the run was configured with keeps its args (a judge's endpoint, rubric and model: its identity in
    # the verdict cache, so the same judge answers from the cache instead of asking again).
    spec = configured[0].model_dump() if configured and path is None else {"name": reward, "weight": weight}
    spec["path"] = str(path) if path else spec.get("path")
    if reward in JUDGES and not configured:
        raise UserError(f"{reward} is a judge: re-score with one the run's config sets up (its rewards: args)")
    functions, _ = build_reward_functions([spec], verdict_cache([spec]))
    function = functions[0]
    name = function.__name__
    problems = check_canaries(functions, [spec], kind_canaries(cfg.data.kind))
    if problems:
        raise UserError(
            f"reward {name} fails {len(problems)} canary case(s), e.g. {problems[0].describe()}; fix "
            "it before re-scoring"
        )
    from tasks.training import conversation

    # a tool-using rollout is scored as it was in training: its conversation (the final assistant turn answers)
    values = function(
        completions=[conversation(r) for r in rows], prompts=[r["prompt"] for r in rows], **reward_kwargs(rows)
    )
    weights = {(s.name.rsplit(":", 1)[-1]): s.weight for s in cfg.rewards}
    report = rescore_report(rows, name, values, weights, weights.get(name, weight), cfg.grpo.scale_rewards)
    judge_stats = getattr(function.function, "stats", None)
    if judge_stats is not None:  # a judge: how many verdicts the cache gave and how many it had to ask for
        report["judge"] = {"from_cache": judge_stats.cached, "asked": judge_stats.asked}
        report["judge"]["requests"] = getattr(judge_stats, "requests", judge_stats.asked)
    console.print(json.dumps(report, indent=2, default=str), soft_wrap=True)
