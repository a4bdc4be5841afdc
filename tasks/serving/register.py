"""Registering an adapter made outside a pipeline run (a benchmark's, a test's: ``random_adapter``) the way promote
registers one: the
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


def random_adapter(base_dir: Path, folder: Path, seed: int, rank: int = 4, scale: float = 0.5) -> Path:
    """A LoRA adapter over ``base_dir`` on the attention projections (layers vLLM takes too), alpha twice the rank,
    its B matrices drawn from ``seed`` with standard deviation ``scale`` (each seed answers differently); saved in
    ``folder``."""
    import torch
    from peft import LoraConfig, get_peft_model

    from tasks.models import load_base_model

    torch.manual_seed(seed)
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    model = get_peft_model(load_base_model(base_dir), lora)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, scale)
    model.save_pretrained(folder)
    return folder


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
