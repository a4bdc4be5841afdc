"""The rollback flow: move ``champion`` back; deployable, so it can be clicked in the Prefect UI.
Must not import: torch, transformers (it loads only ``tasks/registry.py``)."""

from __future__ import annotations

from prefect import flow

from tasks.registry import client_for, rollback_champion


@flow(name="grpoflow-rollback", flow_run_name="rollback-{name}")
def rollback_flow(tracking_uri: str, name: str, to_version: str | None = None, reason: str = "manual rollback") -> str:
    """Point ``name@champion`` at the previous champion (or ``to_version``); returns the version now champion."""
    return rollback_champion(client_for(tracking_uri), name, to_version, reason)
