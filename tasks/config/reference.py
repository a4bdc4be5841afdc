"""The configuration reference, generated from the pydantic models: every key by its dotted path, with its type,
default and description, one table per section (``docs/reference/configuration.md``; ``make docs`` writes it and a
test fails when the page is out of date or a key has no description).
Must not import: torch, transformers, Prefect, MLflow.
"""

from __future__ import annotations

import json
import types
import typing
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined


@dataclass(frozen=True)
class KeyDoc:
    """One config key: its dotted path, type, default (as YAML would say it) and description."""

    path: str
    type: str
    default: str
    description: str


def type_name(annotation: Any) -> str:
    """A type as a reader says it.

    >>> type_name(int | None), type_name(list[str]), type_name(typing.Literal["a", "b"])
    ('int | None', 'list[str]', "'a' | 'b'")
    """
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " | ".join(repr(value) for value in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(arg) for arg in typing.get_args(annotation))
    if origin is not None:
        args = ", ".join(type_name(arg) for arg in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


def _default(field: Any) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "(required)"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "(section)"
    if isinstance(value, list) and value and isinstance(value[0], BaseModel):
        value = [item.model_dump(mode="json", exclude_defaults=True) for item in value]
    return json.dumps(value, default=str)


def _item_model(annotation: Any) -> type[BaseModel] | None:
    for arg in typing.get_args(annotation):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def config_keys(model: type[BaseModel], prefix: str = "") -> list[KeyDoc]:
    """Every key under ``model``, sections walked, a list's item keys as ``key[].item``.

    >>> from tasks.config import PipelineConfig
    >>> [k.path for k in config_keys(PipelineConfig)][:3]
    ['name', 'output_dir', 'seed']
    """
    keys: list[KeyDoc] = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys += config_keys(annotation, f"{prefix}{name}.")
            continue
        description = " ".join((field.description or "").split())
        keys.append(KeyDoc(prefix + name, type_name(annotation), _default(field), description))
        item = _item_model(annotation)
        if item is not None:
            keys += config_keys(item, f"{prefix}{name}[].")
    return keys


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def config_reference() -> str:
    """The configuration reference page (Markdown), one table per top-level section."""
    from tasks.config.pipeline import PipelineConfig

    lines = [
        "# Configuration reference",
        "",
        "Generated from the config models (`tasks/config/`) by `make docs`; do not edit by hand. Every key can be",
        "set in the YAML file by its section or on the command line as `--set dotted.key=value`; a list's items are",
        "shown as `key[].item`. How the keys fit together: [../configuration.md](../configuration.md).",
    ]
    sections: dict[str, list[KeyDoc]] = {}
    for key in config_keys(PipelineConfig):
        section = key.path.split(".", 1)[0].split("[", 1)[0] if "." in key.path else "(top level)"
        sections.setdefault(section, []).append(key)
    for section, keys in sections.items():
        lines += ["", f"## {section}", "", "| key | type | default | description |", "|---|---|---|---|"]
        lines += [f"| `{k.path}` | {_cell(k.type)} | `{_cell(k.default)}` | {_cell(k.description)} |" for k in keys]
    return "\n".join(lines) + "\n"
