"""The ``tools`` section: which tools the model may call while it answers (the built-in sandboxed ``python``, a
user's ``module:function``, or an environment class ``module:Class``), the limits of one rollout's calls, and the
chat template that renders them. Empty ``tools.use`` (the default): no tools anywhere, every stage as before.
Must not import: torch, transformers, Prefect, MLflow (loading a config is static).

>>> ToolSettings.model_validate({"use": [{"name": "python"}]}).use[0].name
'python'
>>> ToolSettings.model_validate({"use": [{"name": "python"}, {"name": "python"}]})
Traceback (most recent call last):
...
pydantic_core._pydantic_core.ValidationError: 1 validation error for ToolSettings
use
  Value error, tools.use names 'python' twice: each tool needs a name of its own ...
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from tasks.config.base import Strict

PYTHON_TOOL = "python"
# The keys the built-in python tool takes in ``args``: the sandbox's limits for one call.
PYTHON_TOOL_ARGS = {
    "timeout_s": (float, 5.0),
    "cpu_seconds": (int, 3),
    "memory_mb": (int, 256),
    "output_bytes": (int, 1024),
}


class ToolCanary(Strict):
    """A known call of a tool and what its answer must contain, checked in validate before any training."""

    arguments: dict[str, Any] = Field(default_factory=dict, description="The call's arguments, by name.")
    expect: str = Field(description="Text the tool's answer must contain.")


class ToolSpec(Strict):
    name: str = Field(
        description="'python' (the code sandbox as a tool), 'package.module:function' (a function with type hints "
        "and a docstring that documents every argument), or 'package.module:Class' (an environment class: its "
        "public methods are the tools, reset() starts each rollout)."
    )
    args: dict[str, Any] = Field(
        default_factory=dict,
        description="python: timeout_s, cpu_seconds, memory_mb, output_bytes (limits of one call); an environment "
        "class: its constructor's keyword arguments. A function tool takes none.",
    )
    path: Path | None = Field(
        None, description="Folder put on sys.path to import a module:… tool from (relative: to the config's folder)."
    )
    canaries: list[ToolCanary] = Field(
        default_factory=list, description="Known calls and what their answers contain (python has built-in ones)."
    )

    @field_validator("name")
    @classmethod
    def _known_name(cls, name: str) -> str:
        if name == PYTHON_TOOL:
            return name
        module, _, attribute = name.partition(":")
        if module and attribute.isidentifier():
            return name
        raise ValueError(f"unknown tool {name!r}: give 'python' or 'package.module:function' (or :Class)")

    @model_validator(mode="after")
    def _python_args(self) -> ToolSpec:
        if self.name != PYTHON_TOOL:
            return self
        unknown = sorted(set(self.args) - set(PYTHON_TOOL_ARGS))
        if unknown:
            raise ValueError(f"tool python: unknown args {unknown}; it takes {sorted(PYTHON_TOOL_ARGS)}")
        for key, value in self.args.items():
            kind = PYTHON_TOOL_ARGS[key][0]
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0 or kind(value) != value:
                raise ValueError(f"tool python: args.{key} must be a positive {kind.__name__}, got {value!r}")
        return self

    @property
    def label(self) -> str:
        """The tool's short name: ``python``, or the attribute of an import path."""
        return self.name.rsplit(":", 1)[-1]

    def python_args(self) -> dict[str, Any]:
        """The built-in python tool's limits, every key filled in.

        >>> ToolSpec(name="python", args={"timeout_s": 2}).python_args()["timeout_s"], ToolSpec(name="python"
        ... ).python_args()["memory_mb"]
        (2.0, 256)
        """
        return {key: kind(self.args.get(key, default)) for key, (kind, default) in PYTHON_TOOL_ARGS.items()}


class ToolSettings(Strict):
    """Tool use while the model answers: every stage (validate's canaries, probe, SFT's traces, GRPO through TRL's
    ``environment_factory``, evaluation with and without the tools, the card) reads this one section."""

    use: list[ToolSpec] = Field(default_factory=list, description="The tools; empty: no tool use anywhere.")
    max_turns: int = Field(
        3, ge=1, description="Tool rounds per rollout (TRL's max_tool_calling_iterations: a round may hold calls)."
    )
    max_calls: int = Field(4, ge=1, description="Tool calls per rollout; a call past it answers with an error.")
    max_seconds: float = Field(30.0, gt=0, description="Tool time per rollout; past it a call answers with an error.")
    max_output_bytes: int = Field(
        2048, ge=64, description="Bytes of tool answers fed back per rollout; an answer past it is cut, then refused."
    )
    call_timeout_s: float = Field(
        10.0, gt=0, description="A user tool's time for one call (python's is its args.timeout_s): then an error."
    )
    concurrent_calls: int = Field(
        8,
        ge=1,
        description="Tool calls of different rollouts run at once, up to this many (a rollout's own calls run in "
        "order; python's also wait for a sandbox worker); user tools' threads, those still running past "
        "call_timeout_s included, stay at most twice this many per process: a call past that answers an error.",
    )
    session: bool = Field(
        False,
        description="python: the calls of one rollout share their state (each call runs after the rollout's "
        "earlier calls, whose output is not shown again); off: every call starts a fresh interpreter.",
    )
    chat_template: Literal["auto", "grpoflow", "model"] = Field(
        "auto",
        description="auto: the model's own when TRL can parse its tool calls (TRL knows it, or the tokenizer ships a "
        "response_template), else grpoflow's ChatML template with tool turns; grpoflow, model: that one or an error.",
    )
    evaluate_without: bool = Field(
        True, description="Also score every model without its tools on the same prompts: what the tools are worth."
    )

    @field_validator("use")
    @classmethod
    def _distinct(cls, use: list[ToolSpec]) -> list[ToolSpec]:
        labels = [spec.label for spec in use]
        for label in labels:
            if labels.count(label) > 1:
                raise ValueError(f"tools.use names {label!r} twice: each tool needs a name of its own")
        return use

    @property
    def enabled(self) -> bool:
        return bool(self.use)


def tool_problems(tools: ToolSettings, grpo: Any, evaluation: Any = None) -> list[str]:
    """What cannot work in a pipeline with tools (checked at load), each naming its keys.

    >>> from tasks.config.settings import GRPOSettings
    >>> problems = tool_problems(ToolSettings(use=[{"name": "python"}]), GRPOSettings(max_completion_length=24))
    >>> problems[0].split(":")[0]
    'grpo.max_completion_length (24) is too short for tool use'
    """
    if not tools.enabled:
        return []
    problems = []
    if grpo.max_completion_length < MIN_TOOL_COMPLETION_TOKENS:
        problems.append(
            f"grpo.max_completion_length ({grpo.max_completion_length}) is too short for tool use: it counts the "
            "tool calls and the tools' answers too (TRL drops a turn that would pass it); give at least "
            f"{MIN_TOOL_COMPLETION_TOKENS}"
        )
    if evaluation is not None and evaluation.max_new_tokens < MIN_TOOL_COMPLETION_TOKENS:
        problems.append(
            f"evaluation.max_new_tokens ({evaluation.max_new_tokens}) is too short for tool use: the tools' answers "
            f"count toward it as in training; give at least {MIN_TOOL_COMPLETION_TOKENS} (grpo.max_completion_length "
            "is the usual choice)"
        )
    if grpo.generation.vllm_max_model_len <= grpo.max_completion_length:
        problems.append(
            f"grpo.generation.vllm_max_model_len ({grpo.generation.vllm_max_model_len}) must hold the prompt and "
            f"grpo.max_completion_length ({grpo.max_completion_length}) with its tool turns"
        )
    return problems


# A tool call and its answer in grpoflow's template take about 30 tokens of SmolLM2's before any code or output.
MIN_TOOL_COMPLETION_TOKENS = 64
