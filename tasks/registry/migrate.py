"""``grpoflow migrate``: versions registered before versions were MLflow models (plain adapter folders) become
MLflow models; their aliases and the champion history move with them.
Must not import: Prefect; torch and transformers only through the packaging functions it calls.
"""

from __future__ import annotations

import json
from pathlib import Path

from tasks.config import PipelineConfig
from tasks.models import resolve_model_source
from tasks.registry.champions import renumber_moves
from tasks.registry.packaging import save_version_model
from tasks.registry.versions import HISTORY_TAG, register_adapter, registered_model
from tasks.tracking import client_for


def migrate_versions(tracking_uri: str, name: str, experiment_name: str, scratch: Path) -> dict[str, str]:
    """Re-register every version of ``name`` that is a plain adapter folder (registered before versions were
    MLflow models) as an MLflow model: a new version with the old one's tags plus ``grpoflow.migrated_from``,
    its card made from those tags; the aliases and the champion history move to it. Returns old → new."""
    import mlflow.artifacts
    from huggingface_hub import ModelCard, ModelCardData

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
    if moved:
        renumber_moves(client, name, moved)
        if HISTORY_TAG in model.tags:  # a history written before moves were tags
            history = [moved.get(v, v) for v in json.loads(model.tags[HISTORY_TAG])]
            client.set_registered_model_tag(name, HISTORY_TAG, json.dumps(history))
    if run is not None:
        client.set_terminated(run.info.run_id, "FINISHED")
    return moved
