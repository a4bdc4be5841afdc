"""The MLflow Model Registry: versions, alias lookups and downloading a registered adapter (migrating versions
registered before they were MLflow models: ``migrate.py``; who is champion: ``champions.py``).

Owns: registry reads and version writes. Must not import: torch, transformers, PEFT, Prefect (``grpoflow rollback``
and the registry commands load only this; a test checks it in a fresh interpreter).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tasks.registry.packaging import adapter_in
from tasks.tracking import RegistryError, client_for

__all__ = ["RegistryError", "client_for"]  # the registry's error type and client, re-exported for callers

CHAMPION = "champion"
CHALLENGER = "challenger"
HISTORY_TAG = "grpoflow.champion_history"  # the history before moves were tags (tasks/registry/champions.py)


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
        if "RESOURCE_DOES_NOT_EXIST" in str(getattr(exc, "error_code", "")) or "not found" in str(exc).lower():
            raise ModelNotFound(f"{uri} does not exist at {tracking_uri}") from exc
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
