"""How an evaluation is shown: its table and its pass@k curve, for MLflow, the Prefect UI and the console.
Must not import: Prefect, MLflow, torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any


def pass_at_k_curve(scores: Mapping[str, Any], path: Path) -> Path:
    """A PNG of pass@k against k (log scale) for each model's scores (anything with a ``pass_at_k`` dict)."""
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


def evaluation_table(result: Any) -> list[dict[str, Any]]:
    """One row per model of an evaluation result (``tasks.evaluate.EvalResult``): greedy accuracy, pass@k and
    the pass@1 interval, with the sample sizes."""
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
            "general KL": round(score.general.to_json().get("kl", 0.0), 5) if score.general else None,
            "engine": score.engine,
            **tool_columns(score),
        }
        for name, score in result.scores.items()
    ]


def tool_columns(score: Any) -> dict[str, Any]:
    """With tools: the model's numbers without them and the paired gain the tools give (empty without tools).

    >>> from types import SimpleNamespace as S
    >>> gain = {"mean": 0.25, "low": 0.1, "high": 0.4, "n": 8}
    >>> plain = {"greedy_accuracy": 0.5, "pass_at_k": {1: 0.25}, "tool_gain": gain, "greedy_tool_gain": gain}
    >>> tool_columns(S(without_tools=plain, tool_use={"calls_per_rollout": 1.0}))["tool gain pass@1 (95% CI)"]
    '+25.0 [+10.0, +40.0] pts'
    """
    plain = getattr(score, "without_tools", None)
    if not plain:
        return {}
    gain, greedy_gain = plain["tool_gain"], plain["greedy_tool_gain"]
    use = getattr(score, "tool_use", {}) or {}
    return {
        "greedy without tools": round(plain["greedy_accuracy"], 4),
        "pass@1 without tools": round(plain["pass_at_k"].get(1, plain["pass_at_k"].get("1", float("nan"))), 4),
        "tool gain pass@1 (95% CI)": _points(gain),
        "tool gain greedy (95% CI)": _points(greedy_gain),
        "tool calls per rollout": round(use.get("calls_per_rollout", 0.0), 3),
        "tool error share": round(use.get("error_share", 0.0), 3),
    }


def _points(difference: dict[str, Any]) -> str:
    return f"{100 * difference['mean']:+.1f} [{100 * difference['low']:+.1f}, {100 * difference['high']:+.1f}] pts"


def _with_interval(drop: dict[str, Any] | None, point: str, interval: str) -> str:
    if drop is None:
        return "-"
    if interval not in drop:
        return f"{drop[point]:+.1%}"
    low, high = drop[interval]
    return f"{drop[point]:+.1%} [{low:+.1%}, {high:+.1%}]"


def watch_table(scores: Any, versions: Mapping[str, str]) -> list[dict[str, Any]]:
    """One row per model the champion watch scored (``tasks.watch.WatchScores``), with its forgetting intervals."""
    rows = []
    for role in ("champion", "previous", "challenger", "base"):
        score = scores.scores.get(role)
        if score is None:
            continue
        difference = scores.differences.get(f"{role}-vs-champion")
        drop = scores.forgetting.get(role)
        rows.append(
            {
                "role": role,
                "version": f"v{versions[role]}" if role in versions else "-",
                "greedy": f"{score.greedy_accuracy:.1%}",
                "pass@1": f"{score.pass_at_k.get(1, float('nan')):.1%}",
                "vs champion (95% CI)": "-"
                if difference is None
                else f"{difference['mean']:+.1%} [{difference['low']:+.1%}, {difference['high']:+.1%}]",
                "QA drop vs base": _with_interval(drop, "qa_accuracy_drop", "qa_drop_interval"),
                "ppl rise vs base": _with_interval(drop, "perplexity_increase", "perplexity_interval"),
            }
        )
    return rows
