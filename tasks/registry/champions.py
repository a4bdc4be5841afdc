"""Who is ``@champion`` and how it got there: the champion history, promotion, rollback and alias exclusivity.

The history is a log of moves, one registered-model tag per move (``grpoflow.champion.move.000001``, …), so it
never outgrows a tag's 5,000-character limit on a Postgres store, whatever the number of moves. Before every
change the log is reconciled with the alias as it actually is: a move made in the MLflow UI is recorded as an
``external`` move, so ``rollback`` still goes back to the champion before.

Rollback replays the log as a stack: ``promote``, ``set`` (``rollback --to``), ``watch`` (the champion watch)
and ``external`` push a version,
``undo`` (a plain ``rollback``) pops one. So ``rollback`` after ``rollback --to 2`` returns to the champion that
``--to`` replaced.

>>> champion_stack([ChampionMove(1, "1", "promote"), ChampionMove(2, "2", "promote"), ChampionMove(3, "1", "set")])
['1', '2', '1']
>>> champion_stack([ChampionMove(1, "1", "promote"), ChampionMove(2, "2", "promote"), ChampionMove(3, "1", "undo")])
['1']

Owns: the champion history and every move of ``champion``. Must not import: torch, transformers, Prefect.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Any, Literal

from tasks.registry.versions import (
    CHALLENGER,
    CHAMPION,
    HISTORY_TAG,
    ModelNotFound,
    RegistryError,
    alias_version_number,
    registered_model,
)

MOVE_TAG_PREFIX = "grpoflow.champion.move."
MoveKind = Literal["promote", "set", "watch", "undo", "external", "removed"]
_MAX_REASON = 1000  # a tag value holds 5,000 characters on Postgres; the rest of a move is short


@dataclass(frozen=True)
class ChampionMove:
    """One move of ``@champion``: ``seq`` orders them; ``by`` is the run or command that made it."""

    seq: int
    version: str
    kind: MoveKind
    at: str = ""
    why: str = ""
    by: str = ""

    def to_tag(self) -> tuple[str, str]:
        body = {k: v for k, v in asdict(self).items() if k != "seq"}
        body["why"] = body["why"][:_MAX_REASON]
        return f"{MOVE_TAG_PREFIX}{self.seq:06d}", json.dumps(body)


def champion_moves(client: Any, name: str) -> list[ChampionMove]:
    """Every recorded move of ``name@champion``, oldest first. A history written before moves were tags (one
    JSON list in ``grpoflow.champion_history``) reads as promotions."""
    tags = registered_model(client, name).tags
    moves = [
        ChampionMove(seq=int(key.removeprefix(MOVE_TAG_PREFIX)), **json.loads(value))
        for key, value in tags.items()
        if key.startswith(MOVE_TAG_PREFIX)
    ]
    if not moves and HISTORY_TAG in tags:
        legacy = json.loads(tags[HISTORY_TAG])
        moves = [
            ChampionMove(i + 1, str(v), "promote", why="(recorded before move history)") for i, v in enumerate(legacy)
        ]
    return sorted(moves, key=lambda move: move.seq)


def champion_stack(moves: list[ChampionMove]) -> list[str]:
    """The champions a plain rollback walks back through, newest last (see the module docstring)."""
    stack: list[str] = []
    for move in moves:
        if move.kind in ("undo", "removed"):
            if stack:
                stack.pop()
        elif not stack or stack[-1] != move.version:
            stack.append(move.version)
    return stack


def timestamp() -> str:
    """When a move or pin happened, as the history records it."""
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def default_actor() -> str:
    """Who made a move when the caller does not say: the command line and the user."""
    return f"command by {os.environ.get('USER', 'unknown')}"


def _record(client: Any, name: str, moves: list[ChampionMove], version: str, kind: MoveKind, why: str, by: str) -> None:
    move = ChampionMove((moves[-1].seq if moves else 0) + 1, version, kind, timestamp(), why, by)
    client.set_registered_model_tag(name, *move.to_tag())
    moves.append(move)


def reconcile(client: Any, name: str) -> tuple[list[ChampionMove], str | None]:
    """The moves with the alias as it is now: a champion set or removed outside grpoflow (the MLflow UI, the
    API) is recorded as a move first. Returns (moves, current champion version or None)."""
    moves = champion_moves(client, name)
    current = alias_version_number(client, name, CHAMPION)
    stack = champion_stack(moves)
    top = stack[-1] if stack else None
    if current is not None and current != top:
        _record(client, name, moves, current, "external", "champion alias found moved outside grpoflow", "reconcile")
    elif current is None and top is not None:
        _record(client, name, moves, top, "removed", "champion alias found removed outside grpoflow", "reconcile")
    return moves, current


def _set_champion(client: Any, name: str, version: str) -> None:
    """Point ``champion`` at ``version``; an alias is held by one version only, so a challenger there loses it."""
    client.set_registered_model_alias(name, CHAMPION, version)
    if alias_version_number(client, name, CHALLENGER) == version:
        client.delete_registered_model_alias(name, CHALLENGER)


def move_champion(client: Any, name: str, version: str, reason: str, by: str = "") -> None:
    """Make ``version`` champion after a promotion decision, recording the move."""
    moves, _ = reconcile(client, name)
    _set_champion(client, name, version)
    _record(client, name, moves, version, "promote", reason, by or default_actor())
    client.set_model_version_tag(name, version, "grpoflow.promoted_at", timestamp())
    client.set_model_version_tag(name, version, "grpoflow.promotion_reason", reason[:_MAX_REASON])


@dataclass(frozen=True)
class PromotionOutcome:
    """What the registry did with a candidate version: made it champion, or set it as challenger, and why."""

    promoted: bool
    reason: str


def apply_promotion(
    client: Any,
    name: str,
    version: str,
    promote: bool,
    reason: str,
    champion_at_evaluation: str | None,
    by: str = "",
) -> PromotionOutcome:
    """Apply a promotion decision to the registry: ``version`` becomes ``champion`` when the decision says so and
    ``champion`` still points where it did when the candidate was evaluated; otherwise it becomes
    ``challenger``. The alias is re-read here, inside the caller's promotion lock, before anything moves."""
    current = alias_version_number(client, name, CHAMPION)
    if current == version:  # a resumed run that had already promoted this version
        return PromotionOutcome(True, "already champion")
    if promote and current != champion_at_evaluation:
        promote, reason = (
            False,
            (
                f"champion moved from {champion_at_evaluation} to {current} while this run was evaluated "
                "against it; not promoting over an adapter it was not compared with"
            ),
        )
    if promote:
        move_champion(client, name, version, reason, by)
    else:
        client.set_registered_model_alias(name, CHALLENGER, version)
    client.set_model_version_tag(name, version, "grpoflow.promotion_decision", reason[:_MAX_REASON])
    return PromotionOutcome(promote, reason)


def rollback_champion(
    client: Any,
    name: str,
    to_version: str | None = None,
    reason: str = "rollback",
    by: str = "",
    kind: MoveKind = "set",
) -> str:
    """Move ``champion`` back to the champion before it (or to ``to_version``); returns the version now champion.

    A plain rollback undoes the last move, whatever made it (a promotion, ``--to``, the MLflow UI)."""
    moves, current = reconcile(client, name)
    stack = champion_stack(moves)
    if to_version is None:
        earlier = stack[:-1] if current is not None else stack
        if not earlier:
            shown = ", ".join(f"v{m.version} ({m.kind})" for m in moves[-5:]) or "none"
            raise NothingToRollBack(
                f"{name} has no earlier champion to roll back to (last moves: {shown}); give a version with --to"
            )
        target, kind = earlier[-1], "undo"
    else:
        target = str(to_version)
    try:
        client.get_model_version(name, target)
    except Exception as exc:
        raise ModelNotFound(f"{name} has no version {target} at {client.tracking_uri}") from exc
    if target == current and kind != "undo":
        return target
    _set_champion(client, name, target)
    _record(client, name, moves, target, kind, reason, by or default_actor())
    stamp = timestamp()
    client.set_model_version_tag(name, target, "grpoflow.rolled_back_to_at", stamp)
    client.set_model_version_tag(name, target, "grpoflow.rollback_reason", reason[:_MAX_REASON])
    if current is not None:
        client.set_model_version_tag(name, current, "grpoflow.rolled_back_from_at", stamp)
    return target


def renumber_moves(client: Any, name: str, moved: dict[str, str]) -> None:
    """After ``grpoflow migrate`` re-registered versions: the history names the new version numbers."""
    for move in champion_moves(client, name):
        if move.version in moved:
            renamed = ChampionMove(move.seq, moved[move.version], move.kind, move.at, move.why, move.by)
            client.set_registered_model_tag(name, *renamed.to_tag())


HEADLINE = ("pass_at_1", "greedy_accuracy", "gain_vs_base", "gain_vs_champion")


def version_rows(client: Any, name: str) -> list[dict[str, str]]:
    """One row per version of ``name``, newest first: aliases, when, the run, headline metrics (from its tags)."""
    aliases: dict[str, list[str]] = {}
    for alias, holder in (registered_model(client, name).aliases or {}).items():
        aliases.setdefault(str(holder), []).append(alias)
    rows = []
    versions = client.search_model_versions(f"name = '{name}'")
    for version in sorted(versions, key=lambda v: int(v.version), reverse=True):
        number, tags = str(version.version), version.tags
        created = time.strftime("%Y-%m-%d %H:%M", time.localtime(version.creation_timestamp / 1000))
        row = {"version": number, "aliases": ",".join(sorted(aliases.get(number, []))) or "-", "created": created}
        row |= {key: tags.get(f"metric.{key}", "-") for key in HEADLINE}
        row["run"] = tags.get("pipeline_run_id", "-")
        rows.append(row)
    return rows


class NothingToRollBack(RegistryError):
    """``rollback`` without ``--to`` when no earlier champion exists: the request, not the registry, is wrong."""

    exit_code = 2
