"""Pins: a pinned champion is reported on by the champion watch but never reverted (``grpoflow pin``/``unpin``).
Must not import: torch, transformers, Prefect.
"""

from __future__ import annotations

import json
from typing import Any

from tasks.registry.champions import default_actor, timestamp
from tasks.registry.versions import ModelNotFound, registered_model

PIN_TAG = "grpoflow.champion.pinned"


def pin_champion(client: Any, name: str, version: str, reason: str, by: str = "") -> None:
    """Pin ``version`` (the watch reports on a pinned champion but never reverts it)."""
    registered_model(client, name)
    try:
        client.get_model_version(name, version)
    except Exception as exc:
        raise ModelNotFound(f"{name} has no version {version} at {client.tracking_uri}") from exc
    body = {"version": str(version), "reason": reason[:1000], "at": timestamp(), "by": by or default_actor()}
    client.set_registered_model_tag(name, PIN_TAG, json.dumps(body))


def unpin_champion(client: Any, name: str) -> None:
    if PIN_TAG in registered_model(client, name).tags:
        client.delete_registered_model_tag(name, PIN_TAG)


def pinned_version(client: Any, name: str) -> dict[str, str] | None:
    raw = registered_model(client, name).tags.get(PIN_TAG)
    return json.loads(raw) if raw else None


# ---------------------------------------------------------------------------------------------- decision
