"""Reading the rollout ledger: filters, groups, the worst and best groups, the same prompts early and late, and
re-scoring with another reward (``grpoflow rollouts`` and ``grpoflow rescore``).
Must not import: Prefect, MLflow, the stages.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from tasks.training.ledger import reward_values


def filter_rows(
    rows: Sequence[dict[str, Any]],
    *,
    steps: tuple[int, int] | None = None,
    reward: str | None = None,
    min_value: float | None = None,
    max_value: float | None = None,
    prompt_id: str | None = None,
    text: str | None = None,
    role: str | None = None,
    trained: bool | None = None,
) -> list[dict[str, Any]]:
    """The rows that pass every filter given: a step range (inclusive), a reward's value range (``reward`` names a
    function; ``reward_total`` without one), a prompt id, a text in the prompt or completion, a role.

    >>> rows = [{"step": 1, "prompt_id": "a", "prompt": "2+2", "completion": "4", "reward_total": 1.0},
    ...         {"step": 5, "prompt_id": "b", "prompt": "3+3", "completion": "7", "reward_total": 0.0}]
    >>> [r["prompt_id"] for r in filter_rows(rows, steps=(2, 9))]
    ['b']
    >>> [r["prompt_id"] for r in filter_rows(rows, max_value=0.5)]
    ['b']
    """
    key = f"reward/{reward}" if reward else "reward_total"
    kept = []
    for row in rows:
        step = row.get("step")
        if steps and (step is None or not steps[0] <= step <= steps[1]):
            continue
        value = row.get(key)
        if (min_value is not None or max_value is not None) and value is None:
            continue
        if (min_value is not None and value < min_value) or (max_value is not None and value > max_value):
            continue
        if prompt_id is not None and str(row.get("prompt_id")) != prompt_id:
            continue
        if text is not None and text not in str(row.get("completion", "")) and text not in str(row.get("prompt", "")):
            continue
        if role is not None and row.get("role") != role:
            continue
        if trained is not None and row.get("trained") is not trained:
            continue
        kept.append(row)
    return kept


def group_key(row: dict[str, Any]) -> tuple:
    """A GRPO group: one prompt's samples in one generation batch (on one rank); elsewhere, a role's prompt."""
    if row.get("role") == "grpo":
        return ("grpo", row.get("generation_batch"), row.get("rank", 0), row.get("group"))
    return (row.get("role"), row.get("prompt_id"))


def groups_of(rows: Sequence[dict[str, Any]]) -> dict[tuple, list[dict[str, Any]]]:
    found: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        found.setdefault(group_key(row), []).append(row)
    return found


def extreme_groups(rows: Sequence[dict[str, Any]], count: int, worst: bool = True) -> list[dict[str, Any]]:
    """The rows of the ``count`` groups with the lowest (``worst``) or highest mean weighted reward.

    >>> rows = [{"role": "p", "prompt_id": i % 3, "reward_total": float(i % 3)} for i in range(6)]
    >>> sorted({r["prompt_id"] for r in extreme_groups(rows, 1)})
    [0]
    >>> sorted({r["prompt_id"] for r in extreme_groups(rows, 1, worst=False)})
    [2]
    """
    groups = list(groups_of(rows).values())
    groups.sort(key=lambda g: _mean([r.get("reward_total") for r in g]), reverse=not worst)
    return [row for group in groups[:count] for row in group]


def diff_steps(rows: Sequence[dict[str, Any]], early: int, late: int) -> list[dict[str, Any]]:
    """The same prompts early and late: for each prompt sampled at a step ≤ ``early`` and again at a step
    ≥ ``late``, its last early group and its first late group, side by side (one row per prompt). When no prompt
    was sampled both times (a short run draws each prompt once per epoch), the groups of the steps nearest to
    ``early`` and ``late``, side by side in order (``same_prompt`` false)."""
    groups = list(groups_of([r for r in rows if r.get("role") == "grpo"]).values())
    before: dict[str, list[dict[str, Any]]] = {}
    after: dict[str, list[dict[str, Any]]] = {}
    for group in groups:
        step, prompt = group[0]["step"], str(group[0]["prompt_id"])
        if step <= early and (prompt not in before or before[prompt][0]["step"] < step):
            before[prompt] = group
        if step >= late and (prompt not in after or after[prompt][0]["step"] > step):
            after[prompt] = group
    common = sorted(set(before) & set(after), key=lambda p: before[p][0]["step"])
    pairs = [(before[p], after[p], True) for p in common]
    if not pairs and groups:
        steps = sorted({g[0]["step"] for g in groups})
        first = max([s for s in steps if s <= early] or steps[:1])
        last = min([s for s in steps if s >= late] or steps[-1:])
        early_groups = [g for g in groups if g[0]["step"] == first]
        late_groups = [g for g in groups if g[0]["step"] == last]
        pairs = [(a, b, False) for a, b in zip(early_groups, late_groups, strict=False)]
    return [
        {
            "same_prompt": same,
            "prompt_id": a[0]["prompt_id"] if same else f"{a[0]['prompt_id']} / {b[0]['prompt_id']}",
            "prompt": a[0]["prompt"],
            "step_a": a[0]["step"],
            "step_b": b[0]["step"],
            "reward_a": _mean([r.get("reward_total") for r in a]),
            "reward_b": _mean([r.get("reward_total") for r in b]),
            "completion_a": a[0]["completion"],
            "completion_b": b[0]["completion"],
        }
        for a, b, same in pairs
    ]


def _mean(values: Sequence[float | None]) -> float:
    numbers = [v for v in values if v is not None and v == v]
    return sum(numbers) / len(numbers) if numbers else math.nan


def correlation(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Pearson's r (NaN when either side is constant).

    >>> round(correlation([1, 2, 3], [2, 4, 7]), 3), correlation([1, 1], [1, 2])
    (0.993, nan)
    """
    n = len(xs)
    if n < 2:
        return math.nan
    mx, my = sum(xs) / n, sum(ys) / n
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    sx, sy = math.sqrt(sum((x - mx) ** 2 for x in xs)), math.sqrt(sum((y - my) ** 2 for y in ys))
    return sxy / (sx * sy) if sx and sy else math.nan


def group_advantages(totals: Sequence[float], scale: str = "group") -> list[float]:
    """GRPO's advantages of one group, as TRL computes them: reward minus the group's mean, divided by the group's
    standard deviation (``scale='group'``; unbiased, plus 1e-4) or not at all (``'none'``).

    >>> [round(a, 3) for a in group_advantages([1.0, 0.0, 0.0, 1.0])]
    [0.866, -0.866, -0.866, 0.866]
    """
    mean = sum(totals) / len(totals)
    centred = [t - mean for t in totals]
    if scale != "group" or len(totals) < 2:
        return centred
    std = math.sqrt(sum(c * c for c in centred) / (len(totals) - 1))
    return [c / (std + 1e-4) for c in centred]


def rescore_report(
    rows: Sequence[dict[str, Any]],
    name: str,
    new_values: Sequence[float | None],
    weights: dict[str, float],
    weight: float,
    scale: str = "group",
) -> dict[str, Any]:
    """How a reward change would have changed training: ``new_values`` (one per GRPO row) replace the function
    ``name`` in the weighted total (or join it with ``weight``). Agreement with the old values of ``name`` (or
    with the old total), groups that turn informative or uninformative, and the advantages' correlation with TRL's."""
    old_key = f"reward/{name}"
    compared = [(r.get(old_key, r.get("reward_total")), v) for r, v in zip(rows, new_values, strict=True)]
    both = [(o, v) for o, v in compared if o is not None and v is not None]
    # The ledger holds what TRL trained on, float32 (0.7 is 0.699999988): equal to float32's precision is agreement.
    agree = sum(abs(o - v) <= 1e-6 * max(1.0, abs(o)) for o, v in both)
    new_totals = []
    for row, value in zip(rows, new_values, strict=True):
        rewards = reward_values(row)
        rewards[name] = value
        terms = [(weights.get(k, weight if k == name else 0.0), v) for k, v in rewards.items()]
        judged = [w * v for w, v in terms if v is not None]
        new_totals.append(sum(judged) if judged else None)
    flips = {"to_informative": 0, "to_uninformative": 0}
    old_adv, new_adv, groups = [], [], 0
    for members in groups_of([dict(r, _new=t) for r, t in zip(rows, new_totals, strict=True)]).values():
        old = [m.get("reward_total") for m in members]
        new = [m["_new"] for m in members]
        if any(v is None for v in old + new):
            continue
        groups += 1
        was, now = len(set(old)) > 1, len(set(new)) > 1
        flips["to_informative"] += now and not was
        flips["to_uninformative"] += was and not now
        old_adv += [m["advantage"] for m in members]
        new_adv += group_advantages(new, scale)
    return {
        "reward": name,
        "rows": len(rows),
        "compared_rows": len(both),
        "agreement": agree / len(both) if both else math.nan,
        "value_correlation": correlation([o for o, _ in both], [v for _, v in both]),
        "groups": groups,
        **flips,
        "advantage_correlation": correlation(old_adv, new_adv),
    }


def reward_kwargs(rows: Sequence[dict[str, Any]]) -> dict[str, list[Any]]:
    """The reward columns each row was scored with (its ``columns``), as TRL hands them to reward functions."""
    decoded = [json.loads(r.get("columns") or "{}") for r in rows]
    names = list(dict.fromkeys(k for d in decoded for k in d))
    return {name: [d.get(name) for d in decoded] for name in names}
