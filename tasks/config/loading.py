"""Loading a config: the YAML file (or only the defaults), dotted-key overrides, paths anchored to the file's folder,
and the import of custom reward functions. Static: it reads the file and checks types and names, but touches no
network, model or data file.
Must not import: torch, transformers, Prefect, MLflow.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from tasks.config.pipeline import PipelineConfig
from tasks.errors import UserError


class ConfigError(UserError, ValueError):
    """A config file that cannot be used; the message names the file and every bad key's path."""


def _format_errors(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        path = ".".join(str(part) for part in item["loc"]) or "(top level)"
        hint = _did_you_mean(item["loc"]) if item["type"] == "extra_forbidden" else ""
        lines.append(f"  {path}: {item['msg'].removeprefix('Value error, ')}{hint}")
    return "\n".join(lines)


def _did_you_mean(location: tuple[Any, ...]) -> str:
    """For an unknown key, the closest key its section has.

    >>> _did_you_mean(("grpo", "num_generation"))
    ' (did you mean grpo.num_generations?)'
    >>> _did_you_mean(("grpo", "zzz"))
    ''
    """
    import difflib

    model: Any = PipelineConfig
    for part in location[:-1]:
        field = getattr(model, "model_fields", {}).get(str(part))
        if field is None or not hasattr(field.annotation, "model_fields"):
            return ""
        model = field.annotation
    close = difflib.get_close_matches(str(location[-1]), list(getattr(model, "model_fields", {})), n=1)
    return f" (did you mean {'.'.join([*map(str, location[:-1]), close[0]])}?)" if close else ""


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> PipelineConfig:
    """Read a YAML config (or only the defaults), apply dotted-key ``overrides`` and validate.

    >>> load_config(overrides={"seed": 2, "grpo.max_steps": 3}).grpo.max_steps
    3
    """
    raw: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        raw = read_config_file(Path(path))
    config_dir = Path(path).resolve().parent if path is not None else None
    for dotted, value in (overrides or {}).items():
        set_dotted(raw, dotted, value)
    anchor_paths(raw, Path.cwd())  # the rest (from --set): relative to the current folder
    try:
        config = PipelineConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(f"{source}: invalid config\n{_format_errors(exc)}") from exc
    import_rewards(config, config_dir, source)
    import_tools(config, config_dir, source)
    return config


def read_config_file(file: Path, extending: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A config file's sections, its paths anchored to its own folder. With ``extends: OTHER.yaml`` (relative to the
    file), the file is an overlay: its sections are merged into OTHER's (``merged``), so a stack's settings can sit
    in a file of their own beside a recipe that runs as it is."""
    if not file.is_file():
        raise ConfigError(f"config file not found: {file}")
    try:
        raw = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{file}: not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{file}: the top level must be a mapping of sections")
    base = raw.pop("extends", None)
    anchor_paths(raw, file.resolve().parent)  # paths written in the file: relative to the file's folder
    if base is None:
        return raw
    parent = (file.resolve().parent / str(base)).resolve()
    if parent in extending or parent == file.resolve():
        raise ConfigError(f"{file}: extends {base}, which extends {file.name} again")
    if not parent.is_file():
        raise ConfigError(f"{file}: extends {base}: no such config file ({parent})")
    return merged(read_config_file(parent, (*extending, file.resolve())), raw)


def merged(base: dict[str, Any], overlay: dict[str, Any]) -> dict[str, Any]:
    """``overlay``'s keys over ``base``'s, section by section (a mapping merges into a mapping; anything else,
    lists included, replaces).

    >>> merged({"grpo": {"max_steps": 5, "beta": 0.0}, "rewards": [1]}, {"grpo": {"max_steps": 9}, "rewards": [2]})
    {'grpo': {'max_steps': 9, 'beta': 0.0}, 'rewards': [2]}
    """
    result = dict(base)
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = merged(result[key], value)
        else:
            result[key] = value
    return result


def set_dotted(raw: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``dotted`` (``grpo.max_steps``; a number picks a list's item: ``rewards.0.args.url``) in ``raw``.

    >>> raw = {"rewards": [{"name": "llm_judge", "args": {}}]}
    >>> set_dotted(raw, "rewards.0.args.url", "http://h:1/v1"); set_dotted(raw, "grpo.max_steps", 3); raw["grpo"]
    {'max_steps': 3}
    >>> raw["rewards"][0]["args"]
    {'url': 'http://h:1/v1'}
    """
    node: Any = raw
    *parents, leaf = dotted.split(".")
    try:
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
        if isinstance(node, list):
            node[int(leaf)] = value
        else:
            node[leaf] = value
    except (ValueError, IndexError, AttributeError, TypeError) as exc:
        raise ConfigError(f"--set {dotted}: no such place in the config ({exc})") from None


def _is_data_path(source: Any) -> bool:
    return isinstance(source, str) and not source.startswith(("builtin:", "hub:"))


def _is_model_path(source: str, base: Path) -> bool:
    """A model source written as a path: ``./x``, ``../x``, ``/x``, ``~/x``, ``a/b/c``, or an existing folder.
    ``org/name`` that is no folder here stays a Hub id (the pre-flight check says when it is neither)."""
    return source.startswith((".", "/", "~")) or source.count("/") > 1 or (base / source).exists()


def anchor_paths(raw: dict[str, Any], base: Path) -> None:
    """Make the input paths of a raw config absolute against ``base``, in place: ``data.source`` (a file or
    folder), ``model.source`` (when written as a path), ``evaluation.general_corpus``/``general_questions`` and
    ``rewards[].path``, ``canaries.file``, ``orchestration.accelerate_config``. ``output_dir`` stays relative to
    the folder a command runs in.

    >>> raw = {"data": {"source": "rows.jsonl"}, "model": {"source": "Qwen/Qwen2.5-0.5B"}}
    >>> anchor_paths(raw, Path("/project/configs")); raw["data"]["source"], raw["model"]["source"]
    ('/project/configs/rows.jsonl', 'Qwen/Qwen2.5-0.5B')
    """

    def anchored(value: Any) -> Any:
        if not isinstance(value, (str, Path)) or not str(value):
            return value
        local = Path(value).expanduser()
        return str(local if local.is_absolute() else base / local)

    sections = {key: raw.get(key) for key in ("data", "model", "evaluation")}
    data, model, evaluation = (value if isinstance(value, dict) else {} for value in sections.values())
    if _is_data_path(data.get("source")):
        data["source"] = anchored(data["source"])
    if isinstance(model.get("source"), str) and _is_model_path(model["source"], base):
        model["source"] = anchored(model["source"])
    for key in ("general_corpus", "general_questions"):
        if evaluation.get(key):
            evaluation[key] = anchored(evaluation[key])
    for spec in raw.get("rewards") or []:
        if isinstance(spec, dict) and spec.get("path"):
            spec["path"] = anchored(spec["path"])
        args = spec.get("args") if isinstance(spec, dict) else None
        model = args.get("model") if isinstance(args, dict) and spec.get("name") == "reward_model" else None
        if isinstance(model, str) and (model.startswith(".") or (base / model).exists()):  # a folder, not a Hub id
            args["model"] = anchored(model)
    tools = raw.get("tools")
    for spec in (tools.get("use") or []) if isinstance(tools, dict) else []:
        if isinstance(spec, dict) and spec.get("path"):
            spec["path"] = anchored(spec["path"])
    canaries = raw.get("canaries")
    for key in ("file", "judge_file"):
        if isinstance(canaries, dict) and canaries.get(key):
            canaries[key] = anchored(canaries[key])
    orchestration = raw.get("orchestration")
    if isinstance(orchestration, dict) and orchestration.get("accelerate_config"):
        orchestration["accelerate_config"] = anchored(orchestration["accelerate_config"])


def import_rewards(config: PipelineConfig, config_dir: Path | None, source: str) -> None:
    """Import every reward given as ``module:function`` now, not after validation and model loading: from its
    ``path``, else ``sys.path`` (``PYTHONPATH``), else the config file's folder — which then becomes the
    reward's ``path``, so a resumed or remote run imports it from the same place."""
    from reward_fns.registry import resolve_reward

    for index, spec in enumerate(config.rewards):
        if ":" in spec.name:
            _import_from_paths("rewards", index, spec, resolve_reward, config_dir, source)


def import_tools(config: PipelineConfig, config_dir: Path | None, source: str) -> None:
    """Import every tool given as ``module:function`` or ``module:Class`` now, as rewards are (``import_rewards``);
    whether it can be a tool (type hints, a docstring for every argument) is checked where its schema is built
    (``tasks.environments``), by ``grpoflow check`` and the validate stage."""
    for index, spec in enumerate(config.tools.use):
        if ":" in spec.name:
            _import_from_paths("tools.use", index, spec, import_object, config_dir, source)


def import_object(name: str, path: str | Path | None = None) -> Any:
    """The object behind ``package.module:attribute``; ``path`` (a folder) is put on ``sys.path`` first.
    ValueError names what could not be imported."""
    import importlib
    import sys

    if path is not None and str(path) not in sys.path:
        sys.path.append(str(path))
    module_name, _, attribute = name.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{name!r} cannot be imported: {exc}") from exc


def _import_from_paths(section: str, index: int, spec: Any, resolve: Any, config_dir: Path | None, source: str) -> None:
    """``resolve(spec.name, folder)`` from the spec's ``path``, else ``sys.path``, else the config's folder (which
    then becomes its ``path``); a ConfigError naming ``section.index`` when none works."""
    try:
        resolve(spec.name, spec.path)
    except ValueError as first:
        if spec.path is not None or config_dir is None:
            where = f"{section}.{index}.path ({spec.path})" if spec.path else "PYTHONPATH"
            raise ConfigError(
                f"{source}: {section}.{index}.name: {first}; the module must be importable from {where}"
                + ("" if spec.path else f", or set {section}[].path to its folder")
            ) from first
        try:
            resolve(spec.name, config_dir)
        except ValueError as exc:
            raise ConfigError(
                f"{source}: {section}.{index}.name: {exc}; the module must be importable from PYTHONPATH or "
                f"{config_dir}, or set {section}[].path to its folder"
            ) from exc
        spec.path = config_dir
