"""Champion watch: re-evaluate ``@champion`` against the champion before it (and optionally the newest
challenger) on today's hold-out data, and roll back, explained, when an earlier champion is now better or the
champion forgets too much.

The decision is one pure function, ``decide_watch``, over the models' scores: the documented seam where tests
inject scores (``run_watch(..., score=...)``). Everything else is the evaluation stage's own code (same prompts
for every model, paired bootstrap) and the registry's moves (promotion lock, alias re-read, champion history).
Owns: the watch's decision, pins, the last-watch record. Must not import: Prefect (the flow wraps it).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tasks.config import PipelineConfig, PromotionSettings, WatchSettings
from tasks.errors import UserError
from tasks.evaluation import forgetting_drop, forgetting_problem, watch_table
from tasks.registry import (
    CHALLENGER,
    CHAMPION,
    alias_version_number,
    champion_stack,
    client_for,
    pinned_version,
    reconcile,
    registered_model,
    rollback_champion,
    timestamp,
)

LAST_WATCH_TAG = "grpoflow.watch.last"


class WatchRefused(UserError, ValueError):
    """The watch config cannot judge this champion (another task kind, rewards or hold-out split)."""


@dataclass
class WatchScores:
    """What the decision reads: each model's scores (``ModelScores``), keyed ``champion``, ``previous``,
    ``challenger``, ``base``; the paired pass@1 differences ``previous-vs-champion`` and
    ``challenger-vs-champion`` (other minus champion); forgetting of each adapter against the base model."""

    scores: dict[str, Any]
    differences: dict[str, dict[str, float]] = field(default_factory=dict)
    forgetting: dict[str, dict[str, float]] = field(default_factory=dict)


@dataclass
class WatchDecision:
    status: str  # "healthy" or "regressed"
    reason: str
    move_to: str | None = None  # the version the watch moves champion to (None: no move)
    would_move_to: str | None = None  # the version a rollback would choose (also with action alert)
    event: str | None = None  # grpoflow.champion.<event>
    notes: list[str] = field(default_factory=list)


def _forgets(drop: dict[str, Any] | None, settings: PromotionSettings) -> str | None:
    return forgetting_problem(drop, settings, "the base model")


def decide_watch(
    scores: WatchScores,
    versions: Mapping[str, str],
    settings: PromotionSettings,
    watch: WatchSettings,
    pinned: str | None = None,
    hours_since_move: float | None = None,
) -> WatchDecision:
    """Whether ``@champion`` regressed and what to do (pure), with the promotion gate's statistics: an earlier
    champion is better when the lower end of its paired pass@1 interval against the champion exceeds
    ``promotion.margin``; the champion forgets when it breaks ``promotion``'s forgetting tolerances (then the
    earlier champion is the way back only if it does not). ``versions``: role → registry version.

    >>> from tasks.evaluate import ModelScores
    >>> s = lambda name, p: ModelScores(name, 40, 4, p, {1: p}, (p - .1, p + .1), [], [])
    >>> scores = WatchScores({"champion": s("v2", .2), "previous": s("v1", .6)},
    ...                      {"previous-vs-champion": {"mean": .4, "low": .3, "high": .5, "n": 40}})
    >>> versions = {"champion": "2", "previous": "1"}
    >>> d = decide_watch(scores, versions, PromotionSettings(), WatchSettings(action="rollback"))
    >>> d.status, d.move_to, d.event
    ('regressed', '1', 'rolled-back')
    >>> decide_watch(scores, versions, PromotionSettings(), WatchSettings()).move_to is None
    True
    """
    champion, previous = versions["champion"], versions.get("previous")
    problems: list[str] = []
    target = None
    better = scores.differences.get("previous-vs-champion")
    if previous and better and better["low"] > settings.margin:
        problems.append(
            f"v{previous} (the champion before) is now better: pass@1 {better['mean']:+.3f} over v{champion}, "
            f"paired 95% CI [{better['low']:+.3f}, {better['high']:+.3f}] (n={better['n']} prompts), "
            f"lower end above the margin {settings.margin:+.3f}"
        )
        target = previous
    forgets = _forgets(scores.forgetting.get("champion"), settings)
    if forgets:
        problems.append(f"v{champion} forgets — {forgets}")
        if previous and not _forgets(scores.forgetting.get("previous"), settings):
            target = target or previous
    notes = []
    challenger = scores.differences.get("challenger-vs-champion")
    if challenger and versions.get("challenger") and challenger["low"] > settings.margin:
        notes.append(
            f"challenger v{versions['challenger']} now beats the champion: pass@1 {challenger['mean']:+.3f}, "
            f"CI [{challenger['low']:+.3f}, {challenger['high']:+.3f}] (promote it with a run or --to)"
        )
    if not problems:
        held = f"v{champion} holds"
        if better:
            held += f" (v{previous} vs it: {better['mean']:+.3f}, CI [{better['low']:+.3f}, {better['high']:+.3f}])"
        return WatchDecision("healthy", held + " and keeps general ability within tolerance", notes=notes)
    reason = "; ".join(problems)
    if target is None:
        return WatchDecision(
            "regressed", reason + "; no earlier champion to go back to", event="regressed", notes=notes
        )
    blocked = None
    if watch.action != "rollback":
        blocked = "watch.action is alert: nothing moved"
    elif pinned == champion:
        blocked = f"v{champion} is pinned: reported, not reverted"
    elif hours_since_move is not None and hours_since_move < watch.cooldown_h:
        blocked = f"champion moved {hours_since_move:.1f} h ago, within the {watch.cooldown_h:g} h cooldown: not moved"
    if blocked:
        return WatchDecision("regressed", f"{reason}; {blocked}", None, target, "regressed", notes)
    return WatchDecision(
        "regressed", f"{reason}; champion moved back to v{target}", target, target, "rolled-back", notes
    )


# ---------------------------------------------------------------------------------------------- the watch


def check_same_task(config: PipelineConfig, run_params: Mapping[str, str], version: str) -> None:
    """Refuse a watch config that would judge the champion on another task: its kind, rewards (names and
    weights) and hold-out fraction must be those of the run that trained it."""
    ours = {
        "data.kind": config.data.kind,
        "data.holdout_fraction": float(config.data.holdout_fraction),
        "rewards": [(r.name, float(r.weight)) for r in config.rewards],
    }
    theirs: dict[str, Any] = {}
    if "data.kind" in run_params:
        theirs["data.kind"] = run_params["data.kind"]
    if "data.holdout_fraction" in run_params:
        theirs["data.holdout_fraction"] = float(run_params["data.holdout_fraction"])
    if "rewards" in run_params:
        theirs["rewards"] = [(r["name"], float(r.get("weight", 1.0))) for r in json.loads(run_params["rewards"])]
    different = [key for key in theirs if theirs[key] != ours[key]]
    if different:
        detail = "; ".join(f"{key}: the champion's run had {theirs[key]}, this config {ours[key]}" for key in different)
        raise WatchRefused(
            f"the watch config cannot judge v{version}: {detail}; watch with the config it was trained on"
        )


def training_params(client: Any, name: str, version: str) -> dict[str, str]:
    """The parameters of the pipeline run that registered ``version`` (its promote stage's parent run)."""
    run_id = client.get_model_version(name, version).run_id
    run = client.get_run(run_id)
    parent = run.data.tags.get("mlflow.parentRunId")
    return client.get_run(parent).data.params if parent else run.data.params


def settings_hash(config: PipelineConfig) -> str:
    """What the watch's verdict depends on besides the models and the data: evaluation and promotion settings."""
    payload = {
        "evaluation": config.evaluation.model_dump(mode="json"),
        "promotion": config.promotion.model_dump(),
        "watch": config.watch.model_dump(),
        "seed": config.seed,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def _hours_since(stamp: str) -> float | None:
    try:
        return (time.time() - time.mktime(time.strptime(stamp[:19], "%Y-%m-%dT%H:%M:%S"))) / 3600
    except (ValueError, TypeError):
        return None


@dataclass
class WatchReport:
    """The watch's outcome: the versions it judged, the table, the decision, what moved."""

    name: str
    versions: dict[str, str]
    decision: WatchDecision | None
    table: list[dict[str, Any]] = field(default_factory=list)
    skipped: str | None = None
    moved: bool = False
    fingerprint: str = ""

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        return data

    def markdown(self) -> str:
        if self.skipped:
            return f"### champion watch: {self.name}\n{self.skipped}\n"
        header = "| " + " | ".join(self.table[0]) + " |\n|" + "---|" * len(self.table[0]) + "\n" if self.table else ""
        rows = "".join("| " + " | ".join(str(v) for v in row.values()) + " |\n" for row in self.table)
        decision = self.decision
        notes = "".join(f"\n- {note}" for note in decision.notes) if decision else ""
        return f"### champion watch: {self.name}\n**{decision.status}**: {decision.reason}{notes}\n\n{header}{rows}"


# Scores the watch's models on the hold-out rows: (config, holdout path, specs by role) → ModelScores by role.
Scorer = Callable[[PipelineConfig, Path, dict[str, Any]], dict[str, Any]]


def score_with_evaluation(config: PipelineConfig, holdout_path: Path, specs: dict[str, Any]) -> dict[str, Any]:
    """The evaluation stage's own scoring, every model on the same hold-out prompts and samples."""
    from tasks.evaluate import holdout_rows, score_models

    return score_models(config, specs, holdout_rows(config, holdout_path))


def watch_scores(config: PipelineConfig, by_role: dict[str, Any]) -> WatchScores:
    """Paired differences against the champion and forgetting against the base model, as promotion does."""
    from tasks.evaluate import compare

    champion = by_role["champion"]
    differences = {
        f"{role}-vs-champion": compare(config, by_role[role], champion)
        for role in ("previous", "challenger")
        if role in by_role
    }
    base = by_role.get("base")
    drops = {
        role: forgetting_drop(base.general, score.general, config.evaluation.bootstrap_resamples, config.seed)
        for role, score in by_role.items()
        if role != "base" and base is not None and base.general and score.general
    }
    return WatchScores(dict(by_role), differences, drops)


def run_watch(config: PipelineConfig, name: str, work_dir: Path, score: Scorer = score_with_evaluation) -> WatchReport:
    """Judge ``name@champion`` on the config's hold-out data; move it back when the decision says so.

    Under the promotion lock the alias is re-read first: a champion that changed while the watch evaluated is
    never moved. A skip when champion, data fingerprint and settings equal the last watch's."""
    from tasks.evaluate import ModelSpec
    from tasks.models import resolve_model_source
    from tasks.registry import fetch_adapter, promotion_lock
    from tasks.validate import enforce_limits, run_validate

    uri = config.resolved_tracking_uri()
    client = client_for(uri)
    moves, champion = reconcile(client, name)
    if champion is None:
        raise WatchRefused(f"{name} has no @champion to watch at {uri}")
    stack = champion_stack(moves)
    versions = {"champion": champion}
    if len(stack) >= 2:
        versions["previous"] = stack[-2]
    challenger = alias_version_number(client, name, CHALLENGER)
    if config.watch.include_challenger and challenger and challenger != champion:
        versions["challenger"] = challenger
    check_same_task(config, training_params(client, name, champion), champion)
    data = run_validate(config, work_dir / "validate")
    enforce_limits(data, config)
    key = {
        "champion": champion,
        "fingerprint": data.fingerprint,
        "settings": settings_hash(config),
        "previous": versions.get("previous"),
    }
    last = json.loads(registered_model(client, name).tags.get(LAST_WATCH_TAG, "{}"))
    if all(last.get(k) == v for k, v in key.items()):
        message = (
            f"champion v{champion}, data {data.fingerprint} and settings unchanged since the watch of "
            f"{last.get('at', '?')} ({last.get('status', '?')}): nothing to re-check"
        )
        return WatchReport(name, versions, None, skipped=message, fingerprint=data.fingerprint)
    specs: dict[str, Any] = {}
    base_source = None
    for role, version in versions.items():
        base_source, adapter, _ = fetch_adapter(uri, f"models:/{name}/{version}", work_dir / f"v{version}")
        specs[role] = ModelSpec(f"v{version}", resolve_model_source(base_source), adapter, version)
    base = ModelSpec("base", resolve_model_source(base_source or config.model.source))
    specs = {"base": base, **specs}  # scored first: the others' KL is measured against its log-probabilities
    scores = watch_scores(config, score(config, data.holdout_path, specs))
    pin = pinned_version(client, name)
    since = _hours_since(moves[-1].at) if moves else None
    decision = decide_watch(scores, versions, config.promotion, config.watch, pin and pin["version"], since)
    report = WatchReport(name, versions, decision, watch_table(scores, versions), fingerprint=data.fingerprint)
    settings = config.orchestration
    if decision.move_to is not None:
        with promotion_lock(uri, name, settings.promotion_lease_s, settings.promotion_lock_timeout_s):
            now = alias_version_number(client, name, CHAMPION)
            if now != champion:  # moved by someone else while the watch evaluated: theirs stands
                decision.reason += f"; not moved: champion changed to v{now} while the watch evaluated"
                decision.move_to, decision.event = None, "regressed"
            else:
                rollback_champion(
                    client, name, decision.move_to, f"watch: {decision.reason}", "grpoflow watch", kind="watch"
                )
                client.set_model_version_tag(name, champion, "grpoflow.watch_regressed", decision.reason[:1000])
                report.moved = True
    record = {**key, "at": timestamp(), "status": decision.status, "moved_to": decision.move_to}
    if report.moved:
        record["champion"] = decision.move_to  # the next watch judges the champion it restored
    client.set_registered_model_tag(name, LAST_WATCH_TAG, json.dumps(record))
    return report


def record_watch_run(config: PipelineConfig, report: WatchReport, work_dir: Path) -> str:
    """An MLflow run ``watch-<name>`` with the table, the decision and the scores; returns its id."""
    from tasks.layout import write_atomically
    from tasks.tracking import experiment_for

    client = client_for(config.resolved_tracking_uri())
    experiment_id = experiment_for(config, client)
    decision = report.decision
    tags = {
        "grpoflow.stage": "watch",
        "grpoflow.watch.model": report.name,
        "grpoflow.watch.status": "skipped" if report.skipped else decision.status,
        "grpoflow.watch.reason": (report.skipped or decision.reason)[:5000],
        "grpoflow.watch.moved_to": decision.move_to if decision and decision.move_to else "",
        **{f"grpoflow.watch.{role}": version for role, version in report.versions.items()},
    }
    run = client.create_run(experiment_id, run_name=f"watch-{report.name}", tags=tags)
    work_dir.mkdir(parents=True, exist_ok=True)
    write_atomically(work_dir / "watch.json", json.dumps(report.to_json(), indent=2, default=str))
    write_atomically(work_dir / "watch.md", report.markdown())
    client.log_artifact(run.info.run_id, str(work_dir / "watch.json"), "watch")
    client.log_artifact(run.info.run_id, str(work_dir / "watch.md"), "watch")
    if report.table:
        client.log_table(
            run.info.run_id, {k: [row[k] for row in report.table] for k in report.table[0]}, "watch/table.json"
        )
    client.set_terminated(run.info.run_id, "FINISHED")
    return run.info.run_id
