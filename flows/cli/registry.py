"""The registry commands: ``versions``, ``history``, ``rollback``, ``watch``, ``pin``, ``unpin``, ``migrate``.
Must not import: a stage, torch or Prefect at import; must not hold registry logic (``tasks.registry`` owns it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from flows.cli.common import (
    ConfigOption,
    NameArg,
    SetOption,
    TrackingOption,
    config_from,
    console,
    print_table,
    registry_client,
    setup_logging,
    store_uri,
)


def rollback(
    name: NameArg,
    to: Annotated[str | None, typer.Option("--to", help="Version to make champion (default: the one before).")] = None,
    reason: Annotated[str, typer.Option(help="Why; recorded in the history and on the version.")] = "manual rollback",
    config: ConfigOption = None,
    tracking_uri: TrackingOption = None,
    set_: SetOption = None,
) -> None:
    """Move champion back to the champion before it (or to --to VERSION); a plain rollback undoes the last move.
    With PREFECT_API_URL set it runs as the grpoflow-rollback flow there (seen in its UI); else it moves the
    alias directly, starting no Prefect server."""
    import os

    from tasks.registry import promotion_lock, registered_model, rollback_champion

    client = registry_client(config, set_, tracking_uri)
    registered_model(client, name)  # a missing model is named before any flow or lock starts
    if os.environ.get("PREFECT_API_URL"):
        from flows.rollback import rollback_flow

        version = rollback_flow(client.tracking_uri, name, to, reason)
    else:
        with promotion_lock(client.tracking_uri, name):
            version = rollback_champion(client, name, to, reason, "grpoflow rollback")
    console.print(f"{name}@champion → version {version}")


def versions(
    name: NameArg, config: ConfigOption = None, tracking_uri: TrackingOption = None, set_: SetOption = None
) -> None:
    """Every version of a registered model with its aliases and headline metrics, newest first."""
    from tasks.registry import version_rows

    rows = version_rows(registry_client(config, set_, tracking_uri), name)
    print_table(f"{name}: {len(rows)} versions", rows)


def history(
    name: NameArg, config: ConfigOption = None, tracking_uri: TrackingOption = None, set_: SetOption = None
) -> None:
    """The champion's moves, oldest first: version, when, why, by which run or command."""
    from tasks.registry import reconcile

    moves, current = reconcile(registry_client(config, set_, tracking_uri), name)
    rows = [
        {"#": str(m.seq), "version": m.version, "move": m.kind, "when": m.at or "-", "why": m.why, "by": m.by}
        for m in moves
    ]
    print_table(f"{name}@champion history (now: {'v' + current if current else 'none'})", rows)


def watch(
    name: Annotated[str | None, typer.Argument(help="Registered model name. Default: the config's.")] = None,
    config: ConfigOption = None,
    tracking_uri: TrackingOption = None,
    set_: SetOption = None,
) -> None:
    """Re-evaluate champion against the champion before it on the config's hold-out data; with
    watch.action=rollback, move it back when the earlier one is now better or the champion forgets too much."""
    from flows.watch import watch_flow

    setup_logging()
    cfg = config_from(None, set_, config, **{"tracking.tracking_uri": tracking_uri})
    store_uri(cfg)
    report = watch_flow(cfg, name)
    if report.get("skipped"):
        console.print(report["skipped"])
        return
    print_table(f"{report['name']}@champion watch", report["table"])
    decision = report["decision"]
    colour = "green" if decision["status"] == "healthy" else "yellow"
    console.print(f"[{colour}]{decision['status']}[/{colour}]: {decision['reason']}", soft_wrap=True)
    for note in decision["notes"]:
        console.print(f"note: {note}", soft_wrap=True)


def pin(
    name: NameArg,
    version: Annotated[str, typer.Argument(help="The version to pin (normally the champion).")],
    reason: Annotated[str, typer.Option(help="Why; shown by the watch.")] = "pinned by hand",
    config: ConfigOption = None,
    tracking_uri: TrackingOption = None,
    set_: SetOption = None,
) -> None:
    """Pin a version: the champion watch reports on a pinned champion but never reverts it."""
    from tasks.registry import pin_champion

    pin_champion(registry_client(config, set_, tracking_uri), name, version, reason)
    console.print(f"{name} v{version} pinned: {reason}")


def unpin(
    name: NameArg, config: ConfigOption = None, tracking_uri: TrackingOption = None, set_: SetOption = None
) -> None:
    """Remove the pin: the champion watch may revert the champion again."""
    from tasks.registry import unpin_champion

    unpin_champion(registry_client(config, set_, tracking_uri), name)
    console.print(f"{name}: no pin")


def migrate(
    name: NameArg, config: ConfigOption = None, tracking_uri: TrackingOption = None, set_: SetOption = None
) -> None:
    """Re-register versions registered as plain adapter folders as MLflow models (aliases move with them)."""
    import tempfile

    from tasks.registry import migrate_versions

    cfg = config_from(None, set_, config)
    uri = store_uri(cfg, tracking_uri)
    with tempfile.TemporaryDirectory() as scratch:
        moved = migrate_versions(uri, name, cfg.tracking.experiment_name, Path(scratch))
    console.print(", ".join(f"v{old} → v{new}" for old, new in moved.items()) or "nothing to migrate")
