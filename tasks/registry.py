"""The MLflow Model Registry: versions, the ``champion``/``challenger`` aliases, champion history, rollback,
downloading a registered adapter, and migrating versions registered before they were MLflow models.

Owns: every registry read and write. Must not import: torch, transformers, PEFT, Prefect (``grpoflow rollback``
and the registry commands load only this; a test checks it in a fresh interpreter).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.packaging import adapter_in
from tasks.runs import RegistryError, client_for

__all__ = ["RegistryError", "client_for"]  # the registry's error type and client, re-exported for callers

CHAMPION = "champion"
CHALLENGER = "challenger"
HISTORY_TAG = "grpoflow.champion_history"


def alias_version(client: Any, name: str, alias: str) -> Any | None:
    """The model version behind ``name@alias``, or None when the model or alias does not exist."""
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException as exc:
        if "RESOURCE_DOES_NOT_EXIST" in str(exc.error_code) or "not found" in str(exc).lower():
            return None
        raise RegistryError(f"registry lookup of {name}@{alias} failed: {exc}") from exc


def alias_version_number(client: Any, name: str, alias: str) -> str | None:
    """The version number behind ``name@alias`` as a string, or None."""
    version = alias_version(client, name, alias)
    return None if version is None else str(version.version)


def register_adapter(client: Any, name: str, run_id: str, artifact_path: str, tags: dict[str, Any]) -> str:
    """Register ``runs:/<run_id>/<artifact_path>`` as a new version of ``name``; returns the version.

    Idempotent per pipeline run: when a version tagged with the same ``pipeline_run_id`` exists (a resumed
    run that crashed after registering), that version is returned instead of a second one."""
    from mlflow.exceptions import MlflowException

    try:
        try:
            client.get_registered_model(name)
        except MlflowException:
            client.create_registered_model(name, description="LoRA adapters trained by grpoflow")
        pipeline_run = tags.get("pipeline_run_id")
        if pipeline_run:
            for existing in client.search_model_versions(f"name = '{name}'"):
                if existing.tags.get("pipeline_run_id") == str(pipeline_run):
                    return str(existing.version)
        version = client.create_model_version(
            name,
            source=f"runs:/{run_id}/{artifact_path}",
            run_id=run_id,
            tags={k: str(v) for k, v in tags.items()},
        )
    except MlflowException as exc:
        raise RegistryError(f"could not register a version of {name}: {exc}") from exc
    return str(version.version)


class ModelNotFound(RegistryError):
    """No such registered model or version: the name, or the store it was looked up in, is wrong."""

    exit_code = 2  # a user error, not an unavailable registry


def registered_model(client: Any, name: str) -> Any:
    """The registered model ``name``; a missing one is a RegistryError that names it and where it was looked for."""
    from mlflow.exceptions import MlflowException

    try:
        return client.get_registered_model(name)
    except MlflowException as exc:
        if "RESOURCE_DOES_NOT_EXIST" in str(exc.error_code) or "not found" in str(exc).lower():
            raise ModelNotFound(
                f"no registered model {name!r} at {client.tracking_uri}; give the config (--config) whose "
                "tracking store holds it"
            ) from exc
        raise RegistryError(f"registry lookup of {name} failed: {exc}") from exc


def champion_history(client: Any, name: str) -> list[str]:
    return json.loads(registered_model(client, name).tags.get(HISTORY_TAG, "[]"))


def move_champion(client: Any, name: str, version: str, reason: str) -> None:
    """Point ``name@champion`` at ``version`` and append it to the history kept on the registered model."""
    history = champion_history(client, name)
    client.set_registered_model_alias(name, CHAMPION, version)
    history.append(version)
    client.set_registered_model_tag(name, HISTORY_TAG, json.dumps(history))
    client.set_model_version_tag(name, version, "grpoflow.promoted_at", time.strftime("%Y-%m-%dT%H:%M:%S"))
    client.set_model_version_tag(name, version, "grpoflow.promotion_reason", reason)


@dataclass(frozen=True)
class PromotionOutcome:
    """What the registry did with a candidate version: made it champion, or set it as challenger, and why."""

    promoted: bool
    reason: str


def apply_promotion(
    client: Any, name: str, version: str, promote: bool, reason: str, champion_at_evaluation: str | None
) -> PromotionOutcome:
    """Apply a promotion decision to the registry: ``version`` becomes ``champion`` when the decision says so and
    ``champion`` still points where it did when the candidate was evaluated; otherwise it becomes
    ``challenger``. The alias is re-read here, inside the caller's promotion lock, before anything moves."""
    current = alias_version_number(client, name, CHAMPION)
    if current == version:  # a resumed run that had already promoted this version
        return PromotionOutcome(True, "already champion")
    if promote and current != champion_at_evaluation:
        promote, reason = False, (
            f"champion moved from {champion_at_evaluation} to {current} while this run was evaluated "
            "against it; not promoting over an adapter it was not compared with"
        )
    if promote:
        move_champion(client, name, version, reason)
    else:
        client.set_registered_model_alias(name, CHALLENGER, version)
    client.set_model_version_tag(name, version, "grpoflow.promotion_decision", reason)
    return PromotionOutcome(promote, reason)


def rollback_champion(client: Any, name: str, to_version: str | None = None, reason: str = "rollback") -> str:
    """Move ``champion`` back to the previous champion (or to ``to_version``); returns the version now champion."""
    history = champion_history(client, name)
    current = alias_version(client, name, CHAMPION)
    if to_version is None:
        earlier = [v for v in history if current is None or v != str(current.version)]
        if not earlier:
            raise RegistryError(f"{name} has no earlier champion to roll back to (history: {history})")
        to_version = earlier[-1]
    client.get_model_version(name, to_version)  # raises when it does not exist
    client.set_registered_model_alias(name, CHAMPION, to_version)
    if history and current is not None and history[-1] == str(current.version):
        history.pop()
    if not history or history[-1] != to_version:
        history.append(to_version)
    client.set_registered_model_tag(name, HISTORY_TAG, json.dumps(history))
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    client.set_model_version_tag(name, to_version, "grpoflow.rolled_back_to_at", stamp)
    client.set_model_version_tag(name, to_version, "grpoflow.rollback_reason", reason)
    if current is not None:
        client.set_model_version_tag(name, str(current.version), "grpoflow.rolled_back_from_at", stamp)
    return to_version


def parse_model_uri(uri: str) -> tuple[str, str | None, str | None]:
    """``models:/NAME@alias`` or ``models:/NAME/VERSION`` → (name, alias, version).

    >>> parse_model_uri("models:/demo@champion"), parse_model_uri("models:/demo/3")
    (('demo', 'champion', None), ('demo', None, '3'))
    """
    if not uri.startswith("models:/"):
        raise ValueError(f"expected models:/NAME@ALIAS or models:/NAME/VERSION, got {uri!r}")
    body = uri[len("models:/") :]
    if "@" in body:
        name, alias = body.split("@", 1)
        return name, alias, None
    name, _, version = body.partition("/")
    return name, None, version or None


def fetch_adapter(tracking_uri: str, uri: str, destination: Path) -> tuple[str, Path, Any]:
    """Download a registered adapter; returns (base model source from the version's tag, adapter dir, version)."""
    import mlflow.artifacts

    client = client_for(tracking_uri)
    name, alias, version = parse_model_uri(uri)
    try:
        model_version = alias_version(client, name, alias) if alias else client.get_model_version(name, version)
    except RegistryError:
        raise
    except Exception as exc:
        raise RegistryError(f"{uri} could not be read from {tracking_uri}: {str(exc)[:200]}") from exc
    if model_version is None:
        raise ModelNotFound(f"{uri} does not exist at {tracking_uri}")
    base = model_version.tags.get("base_model")
    if not base:
        raise RegistryError(f"{name} version {model_version.version} has no base_model tag")
    destination.mkdir(parents=True, exist_ok=True)
    local = mlflow.artifacts.download_artifacts(
        artifact_uri=model_version.source, dst_path=str(destination), tracking_uri=tracking_uri
    )
    return base, adapter_in(Path(local)), model_version


def migrate_versions(tracking_uri: str, name: str, experiment_name: str, scratch: Path) -> dict[str, str]:
    """Re-register every version of ``name`` that is a plain adapter folder (registered before versions were
    MLflow models) as an MLflow model: a new version with the old one's tags plus ``grpoflow.migrated_from``,
    its card made from those tags; the aliases and the champion history move to it. Returns old → new."""
    import mlflow.artifacts
    from huggingface_hub import ModelCard, ModelCardData

    from tasks.config import PipelineConfig
    from tasks.packaging import save_version_model
    from tasks.sources import resolve_model_source

    client = client_for(tracking_uri)
    experiment = client.get_experiment_by_name(experiment_name)
    experiment_id = experiment.experiment_id if experiment else client.create_experiment(experiment_name)
    run = None
    moved: dict[str, str] = {}
    model = registered_model(client, name)
    for version in sorted(client.search_model_versions(f"name = '{name}'"), key=lambda v: int(v.version)):
        if version.tags.get("grpoflow.migrated_to"):
            continue
        number = str(version.version)
        download = {"dst_path": str(scratch / number), "tracking_uri": tracking_uri}
        local = Path(mlflow.artifacts.download_artifacts(version.source, **download))
        if (local / "MLmodel").is_file():
            continue
        base = version.tags.get("base_model", "")
        metrics = [f"- {k.removeprefix('metric.')}: {v}" for k, v in version.tags.items() if k.startswith("metric.")]
        card_data = ModelCardData(base_model=base, library_name="peft", pipeline_tag="text-generation")
        card = str(
            ModelCard.from_template(
                card_data,
                template_str="---\n{{ card_data }}\n---\n\n# {{ title }}\n\n{{ body }}\n",
                title=f"{name} version {number}, migrated",
                body="Registered before versions were MLflow models; re-registered by `grpoflow migrate`.\n\n"
                + "\n".join(metrics),
            )
        )
        if run is None:
            run = client.create_run(experiment_id, run_name=f"migrate-{name}", tags={"grpoflow.stage": "migrate"})
        config = PipelineConfig.model_validate({"model": {"source": base}})
        destination = scratch / f"model-{number}"
        folder = save_version_model(local, destination, base, resolve_model_source(base), config, card)
        client.log_artifacts(run.info.run_id, str(folder), f"model-{number}")
        tags = {**version.tags, "grpoflow.migrated_from": number}
        tags.pop("pipeline_run_id", None)  # registration is idempotent per pipeline run: this is a new version
        new = register_adapter(client, name, run.info.run_id, f"model-{number}", tags)
        if version.tags.get("pipeline_run_id"):
            client.set_model_version_tag(name, new, "pipeline_run_id", version.tags["pipeline_run_id"])
        client.set_model_version_tag(name, number, "grpoflow.migrated_to", new)
        for alias, holder in (model.aliases or {}).items():  # version search results carry no aliases
            if str(holder) == number:
                client.set_registered_model_alias(name, alias, new)
        moved[number] = new
    if moved and HISTORY_TAG in model.tags:
        history = [moved.get(v, v) for v in json.loads(model.tags[HISTORY_TAG])]
        client.set_registered_model_tag(name, HISTORY_TAG, json.dumps(history))
    if run is not None:
        client.set_terminated(run.info.run_id, "FINISHED")
    return moved
