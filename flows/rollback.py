"""The rollback flow: move ``champion`` back; deployable, so it can be clicked in the Prefect UI.
Must not import: torch, transformers (it loads only the registry modules)."""

from __future__ import annotations

from prefect import flow

from tasks.registry import client_for, promotion_lock, rollback_champion


@flow(name="grpoflow-rollback", flow_run_name="rollback-{name}")
def rollback_flow(
    tracking_uri: str, name: str, to_version: str | None = None, reason: str = "manual rollback", by: str = ""
) -> str:
    """Point ``name@champion`` at the previous champion (or ``to_version``); returns the version now champion.
    Holds the promotion lock, so it never interleaves with a run's promotion."""
    with promotion_lock(tracking_uri, name):
        return rollback_champion(client_for(tracking_uri), name, to_version, reason, by or "grpoflow rollback")
