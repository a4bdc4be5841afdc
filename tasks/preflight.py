"""Checks that need no model, run before any flow starts (and on a worker before the stages): input paths,
model sources, the output folder, and — for ``grpoflow check`` — the data's columns and the tracking store.

Owns: pre-flight checks. Must not import: torch, transformers, Prefect (it runs before any of them is needed).
"""

from __future__ import annotations

import os
from pathlib import Path

from tasks.config import PipelineConfig
from tasks.errors import UserError


class PreflightError(UserError, ValueError):
    """An input the run needs is missing; the message names the config key and the path."""


def _hub_cached(repo_id: str, revision: str | None) -> bool:
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, "config.json", revision=revision)
    return isinstance(found, str)


def model_source_problem(source: str, revision: str | None = None) -> str | None:
    """What is wrong with ``model.source``, or None. A path-like source must be a model folder; a Hub id must be
    in the local cache when the Hub is off (``HF_HUB_OFFLINE``).

    >>> model_source_problem("/nowhere/my-model")
    'model.source: model folder not found: /nowhere/my-model'
    >>> model_source_problem("tiny-random") is None
    True
    """
    from tasks.models import SMOLLM2, TINY_MODELS

    if source == SMOLLM2 or source in TINY_MODELS:
        return None
    local = Path(source).expanduser()
    if local.exists():
        if not (local / "config.json").is_file():
            return f"model.source: {local} has no config.json (not a transformers model folder)"
        return None
    if source.startswith((".", "/", "~")) or source.count("/") != 1:
        return f"model.source: model folder not found: {local}"
    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("0", "", "false")
    if offline and not _hub_cached(source, revision):
        return (
            f"model.source: {source!r} is neither a folder ({local.resolve()} does not exist) nor a Hub model in "
            "the local cache (HF_HUB_OFFLINE is set); give a model folder, or download it where the Hub is reachable"
        )
    return None


def path_problems(config: PipelineConfig) -> list[str]:
    """Every missing input path of ``config``, each naming its key: the data file or folder, the model, the
    general sets, reward folders; and an output folder that cannot be created."""
    problems = []
    source = config.data.source
    if not source.startswith(("builtin:", "hub:")) and not Path(source).exists():
        problems.append(f"data.source: data file not found: {source}")
    model = model_source_problem(config.model.source, config.model.revision)
    if model:
        problems.append(model)
    for key in ("general_corpus", "general_questions"):
        value = getattr(config.evaluation, key)
        if value is not None and not Path(value).is_file():
            problems.append(f"evaluation.{key}: file not found: {value}")
    if config.canaries.file is not None and not Path(config.canaries.file).is_file():
        problems.append(f"canaries.file: file not found: {config.canaries.file}")
    if config.canaries.judge_file is not None and not Path(config.canaries.judge_file).is_file():
        problems.append(f"canaries.judge_file: file not found: {config.canaries.judge_file}")
    for spec in config.rewards:
        model = spec.args.get("model") if spec.name == "reward_model" else None
        if isinstance(model, str) and model.startswith(("/", ".", "~")) and not Path(model).expanduser().is_dir():
            problems.append(f"rewards[{spec.name}].args.model: folder not found: {model}")
    accelerate_file = config.orchestration.accelerate_config
    if accelerate_file is not None and not Path(accelerate_file).is_file():
        problems.append(f"orchestration.accelerate_config: file not found: {accelerate_file}")
    for index, spec in enumerate(config.rewards):
        if spec.path is not None and not Path(spec.path).is_dir():
            problems.append(f"rewards.{index}.path: folder not found: {spec.path}")
    output = config.output_dir.resolve()
    existing = next((p for p in (output, *output.parents) if p.exists()), None)
    if existing is not None and (not existing.is_dir() or not os.access(existing, os.W_OK)):
        problems.append(f"output_dir: {output} cannot be created ({existing} is not a writable folder)")
    return problems


def generation_problem(config: PipelineConfig) -> str | None:
    """What keeps the configured vLLM backend from running here: vLLM asked for in-process but not installed.
    A configured server that does not answer raises ``VllmServerUnavailable`` (an infrastructure error)."""
    from tasks.models.vllm_engine import INSTALL_HINT, vllm_installed
    from tasks.models.vllm_server import VllmServerClient, handover_root

    generation = config.grpo.generation
    if generation.backend == "transformers" or not (config.grpo.enabled or config.probe.enabled):
        return None
    if generation.vllm_mode == "server" and generation.vllm_server_base_url:
        client = VllmServerClient(generation.vllm_server_base_url, timeout_s=30)
        client.check()
        if config.grpo.enabled:  # GRPO hands the server an adapter each step, through a folder both must see
            client.check_reads(handover_root(generation.vllm_adapter_dir))
    elif generation.backend == "vllm" and not vllm_installed():
        return f"grpo.generation.backend: 'vllm' but vLLM is not installed here ({INSTALL_HINT})"
    return None


def check_tracking_server(tracking_uri: str, timeout_s: float = 5.0) -> None:
    """Raise ``RegistryError`` (exit 4) when an MLflow server at an http(s) URI does not answer at all: any HTTP
    reply counts as an answer (a proxy's 401 or 404 included), only a connection that fails or times out does not.
    Local stores are not touched.

    >>> check_tracking_server("sqlite:///nowhere/mlflow.db")
    >>> check_tracking_server("http://127.0.0.1:9", timeout_s=1)
    Traceback (most recent call last):
    ...
    tasks.tracking.client.RegistryError: MLflow at http://127.0.0.1:9 is unavailable while checking it before ...
    """
    import urllib.error
    import urllib.request

    from tasks.tracking.client import tracking_error

    if not tracking_uri.startswith(("http://", "https://")):
        return
    try:
        with urllib.request.urlopen(tracking_uri.rstrip("/") + "/health", timeout=timeout_s):
            pass
    except urllib.error.HTTPError:
        return
    except (OSError, ValueError) as exc:
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        raise tracking_error(tracking_uri, "checking it before the run", OSError(str(reason))) from exc


def preflight(config: PipelineConfig, tracking: bool = False) -> None:
    """Raise PreflightError naming every missing input (at most three in the message) before anything starts;
    a configured vLLM server that does not answer is named too (exit 4), and with ``tracking`` (a pipeline run,
    which tracks in the config's store) an MLflow server that does not answer."""
    nodes = nodes_problem(config)  # a config mistake: said before the network is asked anything
    if nodes:
        raise PreflightError(nodes)
    if tracking:
        check_tracking_server(config.resolved_tracking_uri())
    problems = path_problems(config)
    generation = generation_problem(config)
    if generation:
        problems.append(generation)
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise PreflightError("; ".join(problems[:3]) + more)


def nodes_problem(config: PipelineConfig) -> str | None:
    """With several nodes, a tracking store they cannot all reach, said before the first stage (not at SFT)."""
    if config.orchestration.nodes <= 1:
        return None
    from tasks.training.nodes import NodesNeedServer, check_shared_store, store_served_to_nodes

    uri = config.resolved_tracking_uri()
    if store_served_to_nodes(config, uri):
        return None
    try:
        check_shared_store(config, uri)
    except NodesNeedServer as exc:
        return str(exc)
    return None


def tracking_problem(config: PipelineConfig) -> str | None:
    """None when the tracking store answers (a local store is created if new); else what is wrong."""
    from tasks.tracking import client_for

    uri = config.resolved_tracking_uri()
    try:
        client_for(uri).search_experiments(max_results=1)
    except Exception as exc:
        return f"tracking store {uri} does not answer: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return None
