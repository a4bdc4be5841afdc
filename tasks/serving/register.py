"""Registering an adapter made outside a pipeline run (a benchmark's, a test's) the way promote registers one: the
MLflow model with its card, the ``adapter_digest`` tag and the smoke record, so ``grpoflow serve`` checks it as it
checks a trained version.
Must not import: Prefect, the stages.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from tasks.serving.engines import TransformersEngine
from tasks.serving.records import DIGEST_TAG, adapter_digest, write_smoke_record
from tasks.serving.smoke import record_smoke


def register_served_version(
    config: Any,
    adapter_dir: Path,
    prompts: list[str],
    engine: TransformersEngine,
    folder: Path,
    card: str = "# An adapter registered for serving\n",
    experiment: str = "grpoflow-serving",
) -> tuple[str, str]:
    """Package ``adapter_dir`` into ``folder`` as promote does, record ``engine``'s greedy answers to ``prompts``,
    log it to a run of ``experiment`` and register it under the config's model name; returns (version, run id)."""
    from tasks.models import resolve_model_source
    from tasks.registry import client_for, register_adapter, save_version_model
    from tasks.registry.packaging import adapter_in

    base_dir = resolve_model_source(config.model.source, config.model.revision)
    model = save_version_model(adapter_dir, folder, config.model.source, base_dir, config, card)
    rows = [{"prompt": prompt} for prompt in prompts]
    write_smoke_record(
        model, record_smoke(engine, adapter_dir, rows, config.data.system_prompt, config.serving.smoke_max_tokens)
    )
    client = client_for(config.resolved_tracking_uri())
    found = client.get_experiment_by_name(experiment)
    run = client.create_run(found.experiment_id if found else client.create_experiment(experiment))
    client.log_artifacts(run.info.run_id, str(model), "model")
    client.set_terminated(run.info.run_id)
    tags = {"base_model": config.model.source, DIGEST_TAG: adapter_digest(adapter_in(model))}
    version = register_adapter(client, config.tracking.registered_model_name, run.info.run_id, "model", tags)
    shutil.rmtree(model, ignore_errors=True)
    return version, run.info.run_id
