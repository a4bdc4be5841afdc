"""What a multi-node stage sends its nodes, sealed: the train (and hold-out) file, the SFT adapter, the base model
where the nodes cannot resolve it themselves, reward and tool modules from ``path`` folders, local reward-model
folders and the accelerate file, then the request, then the manifest of every file's digest.

Must not import: Prefect (the stage task wraps the stage).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tasks.config import PipelineConfig
from tasks.layout import HOLDOUT_FILE
from tasks.training.nodes.exchange import (
    INPUTS,
    MANIFEST,
    REQUEST,
    Manifest,
    NodeInputError,
    StageArtifacts,
    file_digests,
    model_digest,
)


def ships_base_model(config: PipelineConfig) -> bool:
    """Whether the stage sends the nodes its base model folder: a local folder (other machines may not have it),
    one of grpoflow's built-in models (built or converted here once; each node would convert it again: minutes for
    SmolLM2), or a Hub model with ``orchestration.ship_hub_model`` (nodes without Hub access). Else each node
    resolves the Hub id itself, checked against this host's bytes.

    >>> hub = PipelineConfig.model_validate({"model": {"source": "Qwen/Qwen2.5-0.5B"}})
    >>> ships_base_model(PipelineConfig()), ships_base_model(hub)
    (True, False)
    """
    from tasks.models import SMOLLM2, TINY_MODELS

    source = config.model.source
    if source == SMOLLM2 or source in TINY_MODELS or Path(source).expanduser().is_dir():
        return True
    return config.orchestration.ship_hub_model


def send_request(
    artifacts: StageArtifacts,
    stage: str,
    config: PipelineConfig,
    train_path: Path,
    base_model_dir: Path,
    sft_adapter_dir: Path | None,
    keep_ids: set[str] | None,
    checkpoint_store: dict[str, Any],
    restore_store: dict[str, Any] | None = None,
) -> str:
    """Upload the inputs, the request and last the manifest that seals them (the agents fetch the request first:
    it must find its inputs). The nodes copy checkpoints to ``checkpoint_store`` and resume from
    ``restore_store``'s newest (default: the same store). Returns the manifest's digest, which the agents get out of
    band (their command line) and check every fetched file against."""
    shipped_files: dict[str, str] = {}

    def ship(local: Path, name: str) -> None:
        shipped_files.update(file_digests(local, name))  # hashed before the upload: what this host holds
        artifacts.put(local, name)

    source = config.model.source
    shipped = ships_base_model(config)
    ship(train_path, f"{INPUTS}/{train_path.name}")
    holdout = train_path.with_name(HOLDOUT_FILE)  # GRPO's in-training evaluation reads it beside the train file
    ships_holdout = stage == "grpo" and bool(config.grpo.eval_steps) and holdout.is_file()
    if ships_holdout:
        ship(holdout, f"{INPUTS}/{HOLDOUT_FILE}")
    if sft_adapter_dir is not None:
        ship(sft_adapter_dir, f"{INPUTS}/sft-adapter")
    if shipped:
        ship(base_model_dir, f"{INPUTS}/base-model")
    reward_modules = ship_reward_modules(ship, config)
    reward_models = ship_reward_models(ship, config)
    tool_modules = ship_tool_modules(ship, config)
    if config.orchestration.accelerate_config:
        ship(Path(config.orchestration.accelerate_config), f"{INPUTS}/accelerate.yaml")
    request = {
        "stage": stage,
        "holdout_file": HOLDOUT_FILE if ships_holdout else None,
        "config": config.model_dump(mode="json"),
        "train_file": train_path.name,
        "sft_adapter": sft_adapter_dir is not None,
        "keep_ids": sorted(keep_ids) if keep_ids is not None else None,
        "model": {
            "source": source,
            "revision": config.model.revision,
            "digest": model_digest(base_model_dir),
            "shipped": shipped,
        },
        "checkpoint_store": checkpoint_store,
        "restore_store": restore_store or checkpoint_store,
        "reward_modules": reward_modules,
        "reward_models": reward_models,
        "tool_modules": tool_modules,
        "nodes": config.orchestration.nodes,
        "host": config.orchestration.rendezvous_host,
        "port": config.orchestration.rendezvous_port,
    }
    request_bytes = json.dumps(request).encode()
    artifacts.put_bytes(request_bytes, REQUEST)
    manifest = Manifest({"request": hashlib.sha256(request_bytes).hexdigest(), "files": shipped_files})
    artifacts.put_bytes(manifest.to_bytes(), MANIFEST)
    return manifest.digest()


def module_files(name: str, folder: Path) -> list[Path]:
    """The file or package of an import-path reward or tool inside its ``path`` folder (what another machine
    needs; a helper it imports belongs in the same package).

    >>> import tempfile; folder = Path(tempfile.mkdtemp()); _ = (folder / "my_reward.py").write_text("")
    >>> [p.name for p in module_files("my_reward:score", folder)], module_files("other:f", folder)
    (['my_reward.py'], [])
    """
    top = name.split(":")[0].split(".")[0]
    return [p for p in (folder / f"{top}.py", folder / top) if p.exists()]


def ship_reward_modules(ship: Callable[[Path, str], None], config: PipelineConfig) -> list[int]:
    """Upload the module of every reward imported from a ``path`` folder (``launch/inputs/rewards/<index>/``): the
    other machines do not have this one's folders. Rewards importable without a path come with each node's
    install. Returns the indexes shipped."""
    shipped = []
    for index, spec in enumerate(config.rewards):
        if ":" not in spec.name or spec.path is None:
            continue
        for local in module_files(spec.name, Path(spec.path)):
            ship(local, f"{INPUTS}/rewards/{index}/{local.name}")
        shipped.append(index)
    return shipped


def ship_tool_modules(ship: Callable[[Path, str], None], config: PipelineConfig) -> list[int]:
    """Upload the module of every tool imported from a ``path`` folder (``tools.use[].path``;
    ``launch/inputs/tools/<index>/``), as reward modules are. Returns the indexes shipped."""
    shipped = []
    for index, spec in enumerate(config.tools.use):
        if ":" not in spec.name or spec.path is None:
            continue
        for local in module_files(spec.name, Path(spec.path)):
            ship(local, f"{INPUTS}/tools/{index}/{local.name}")
        shipped.append(index)
    return shipped


def ship_reward_models(
    ship: Callable[[Path, str], None], config: PipelineConfig, hub_cache: Path | None = None
) -> list[int]:
    """Upload every reward model given as a local folder (``reward_model``'s ``args.model``;
    ``launch/inputs/reward-models/<index>/``): the other machines do not have this one's folders. A Hub id is
    resolved by each node itself, or, with ``orchestration.ship_hub_model``, shipped from this machine's Hub cache
    (``hub_cache``: default, the Hub's own) as the base model is. Returns the indexes shipped."""
    shipped = []
    for index, spec in enumerate(config.rewards):
        model = (spec.args or {}).get("model") if spec.name == "reward_model" else None
        if not isinstance(model, str):
            continue
        if Path(model).expanduser().is_dir():
            ship(Path(model).expanduser(), f"{INPUTS}/reward-models/{index}")
            shipped.append(index)
        elif config.orchestration.ship_hub_model:
            ship(cached_hub_model(model, f"rewards[{index}].args.model", hub_cache), f"{INPUTS}/reward-models/{index}")
            shipped.append(index)
    return shipped


def cached_hub_model(repo_id: str, key: str, hub_cache: Path | None = None) -> Path:
    """The folder of ``repo_id`` in this machine's Hub cache, for shipping to nodes without Hub access; a
    ``NodeInputError`` naming ``key`` when it is not there."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, cache_dir=hub_cache, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError) as exc:
        raise NodeInputError(
            f"{key}: {repo_id} is not in this machine's Hub cache, and orchestration.ship_hub_model sends the nodes "
            f"what is there (`hf download {repo_id}` first, or set ship_hub_model: false): {exc}"
        ) from exc
