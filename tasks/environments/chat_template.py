"""The chat template tool use renders with, and the parser that reads a tool call back out of a completion.

TRL's tool loop needs a template that renders tool calls and tool answers, stays prefix-preserving (it extends a
conversation turn by turn) and a ``response_template`` on the tokenizer (TRL's ``add_response_schema`` sets one only
for templates byte-identical to those it ships). SmolLM2's template renders only ``content``, so grpoflow writes its
own: ChatML with tool turns (``<tool_call>{json}</tool_call>`` inside the assistant turn, a ``tool`` turn for each
answer), ``{% generation %}`` markers for SFT's assistant-only loss, and the end-of-turn token inside them. No token
is added: ``<tool_call>`` is plain text in SmolLM2 (only ``<|im_start|>``/``<|im_end|>`` are special), since a resized
vocabulary needs embedding training and breaks vLLM's LoRA, which requires the base vocabulary.

``prepare_tokenizer`` is the one place a stage gets a tokenizer ready for tools: the model's own template where TRL
can parse its tool calls, else grpoflow's for a ChatML tokenizer (and for grpoflow's tiny test model), else one error.
Must not import: ``tasks.training``, ``tasks.tracking``, ``tasks.registry``, ``tasks.evaluation``, Prefect, MLflow.
"""

from __future__ import annotations

import copy
import hashlib
import re
from dataclasses import dataclass
from typing import Any

from tasks.errors import UserError

TOOL_INSTRUCTIONS = (
    'To call a tool, reply with <tool_call>{"name": NAME, "arguments": {ARGUMENTS}}</tool_call>. '
    "Its answer comes back as a tool turn."
)


class ChatTemplateError(UserError, ValueError):
    """No template that can render and parse tool calls for this model; the message says what to do."""


@dataclass(frozen=True)
class TurnFormat:
    """How a family of templates frames a turn: ``opening + role + closing`` before it, ``end`` (the tokenizer's
    end-of-sequence token) after it, then a newline."""

    name: str
    opening: str
    closing: str
    end: str

    def header(self, role: str) -> str:
        return f"{self.opening}{role}{self.closing}"


CHATML = TurnFormat("chatml", "<|im_start|>", "\n", "<|im_end|>")
# grpoflow's tiny test model (tasks.models.sources): character-level, "<|role|>" headers, "</s>" ends a turn.
TINY = TurnFormat("tiny", "<|", "|>", "</s>")
FORMATS = (CHATML, TINY)
SYSTEM_ROLE, MESSAGE_ROLE = "'system'", "message['role']"  # Jinja expressions of a turn's role


def _literal(text: str) -> str:
    """A Jinja string literal."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


def grpoflow_template(turns: TurnFormat) -> str:
    """grpoflow's chat template with tool turns for a family of turn formats.

    >>> template = grpoflow_template(CHATML)
    >>> "{%- generation %}" in template, "<tool_call>" in template
    (True, True)
    """
    end, newline = _literal(turns.end), _literal("\n")

    def header(role: str) -> str:  # role: a Jinja expression
        return f"{_literal(turns.opening)} + {role} + {_literal(turns.closing)}"

    def emit(expression: str) -> str:
        return "{{- " + expression + " }}"

    tools_turn = (
        emit(header(SYSTEM_ROLE))
        + "{%- if system %}"
        + emit("system + " + _literal("\n\n"))
        + "{%- endif %}"
        + emit(_literal("You can call these tools:\n"))
        + "{%- for tool in tools %}"
        + emit("(tool | tojson) + " + newline)
        + "{%- endfor %}"
        + emit(f"{_literal(TOOL_INSTRUCTIONS)} + {end} + {newline}")
    )
    # Arguments given as JSON text (SFT rows keep them so: a dataset would merge the keys of every tool's arguments)
    # are written as they are: the same bytes tojson writes for the same object.
    tool_call = (
        "{%- set function = call['function'] if call['function'] is defined else call %}"
        "{%- set arguments = function['arguments'] if function['arguments'] is string "
        "else (function['arguments'] | tojson) %}"
        "{%- if not loop.first or message['content'] %}"
        + emit(newline)
        + "{%- endif %}"
        + emit(
            _literal('<tool_call>\n{"name": ')
            + " + (function['name'] | tojson) + "
            + _literal(', "arguments": ')
            + " + arguments + "
            + _literal("}\n</tool_call>")
        )
    )
    assistant_turn = (
        emit(header("'assistant'"))
        + "{%- generation %}"
        + emit("message['content'] or ''")
        + "{%- for call in message.get('tool_calls') or [] %}"
        + tool_call
        + "{%- endfor %}"
        + emit(end)
        + "{%- endgeneration %}"
        + emit(newline)
    )
    system_turn = emit(f"{header(SYSTEM_ROLE)} + system + {end} + {newline}")
    other_turn = emit(f"{header(MESSAGE_ROLE)} + message['content'] + {end} + {newline}")
    return (
        "{%- if messages and messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}"
        "{%- set turns = messages[1:] %}{%- else %}{%- set system = '' %}{%- set turns = messages %}{%- endif %}"
        "{%- if tools %}" + tools_turn + "{%- elif system %}" + system_turn + "{%- endif %}"
        "{%- for message in turns %}"
        "{%- if message['role'] == 'assistant' %}" + assistant_turn + "{%- else %}" + other_turn + "{%- endif %}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}" + emit(header("'assistant'")) + "{%- endif %}"
    )


def response_template(turns: TurnFormat) -> dict[str, Any]:
    """The parser of grpoflow's template (transformers' ``response_template``): any tool calls, then content up to the
    end-of-turn token.

    >>> response_template(CHATML)["start_anchor"]
    '<|im_start|>assistant\\n'
    """
    return {
        "defaults": {"role": "assistant"},
        "start_anchor": turns.header("assistant"),
        "fields": {
            "tool_calls": {
                "open": "<tool_call>",
                "close_pattern": r"</tool_call>\s*",
                "repeats": True,
                "content": "json",
                "transform": {"type": "function", "function": "{content}"},
            },
            "content": {"close_pattern": re.escape(turns.end) + r"\s*", "content": "text"},
        },
    }


def turn_format_of(tokenizer: Any) -> TurnFormat | None:
    """The family of the tokenizer's own template when grpoflow's can replace it: its user turn renders as the
    family's, and the family's end-of-turn is the tokenizer's end-of-sequence token (where generation stops)."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    try:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": "X"}], tokenize=False)
    except Exception:  # noqa: BLE001 - a template that cannot render a user turn is no family of ours
        return None
    for turns in FORMATS:
        if tokenizer.eos_token == turns.end and rendered.endswith(f"{turns.header('user')}X{turns.end}\n"):
            return turns
    return None


@dataclass(frozen=True)
class ToolTemplate:
    """Which template tool use renders with: grpoflow's (and its family) or the model's own; a digest of it."""

    source: str  # "grpoflow" | "model"
    family: str  # a TurnFormat's name, or "trl" (a template TRL knows), or "tokenizer" (it ships its parser)
    digest: str

    def describe(self) -> str:
        return f"{self.source} ({self.family}, {self.digest})"


def prepare_tokenizer(tokenizer: Any, mode: str = "auto", model_name: str = "the model") -> ToolTemplate:
    """Get ``tokenizer`` ready to render and parse tool calls (in place): its ``chat_template`` becomes the one every
    stage renders with, and its ``response_template`` the parser. ``mode`` is ``tools.chat_template``: ``auto`` (the
    model's own when TRL can parse it, else grpoflow's), ``grpoflow`` or ``model``. ChatTemplateError otherwise."""
    if mode in ("auto", "model"):
        family = _own_template(tokenizer)
        if family is not None:
            return _described(tokenizer, "model", family)
        if mode == "model":
            raise ChatTemplateError(
                f"tools.chat_template is 'model' but {model_name}'s chat template cannot take tool calls that TRL "
                "parses (TRL does not know it and the tokenizer ships no response_template), or marks no "
                "{% generation %} turns for SFT's assistant-only loss; set tools.chat_template to auto or grpoflow"
            )
    turns = turn_format_of(tokenizer)
    if turns is None:
        raise ChatTemplateError(
            f"no chat template for tool calls: {model_name}'s template is not one TRL knows, its tokenizer ships no "
            "response_template, and it is not ChatML (<|im_start|>/<|im_end|> with <|im_end|> as end of sequence), "
            "which grpoflow's own template needs; use a model with a tool-calling template"
        )
    tokenizer.chat_template = grpoflow_template(turns)
    tokenizer.response_template = response_template(turns)
    return _described(tokenizer, "grpoflow", turns.name)


def _own_template(tokenizer: Any) -> str | None:
    """The family of the model's own template when TRL can drive tool calls with it (set up in place: the parser TRL
    knows, and TRL's training template where the model's is not prefix-preserving or has no generation markers);
    None when it cannot."""
    from trl.chat_template_utils import (
        add_response_schema,
        get_training_chat_template,
        is_chat_template_prefix_preserving,
        supports_tool_calling,
    )

    if not getattr(tokenizer, "chat_template", None) or not supports_tool_calling(tokenizer):
        return None
    family = "tokenizer"
    if getattr(tokenizer, "response_template", None) is None:
        trial = copy.copy(tokenizer)
        try:
            add_response_schema(trial)
        except ValueError:  # a template TRL does not know
            return None
        tokenizer.response_template = trial.response_template
        family = "trl"
    try:
        training = get_training_chat_template(tokenizer)
    except ValueError:
        training = None
        # SFT's assistant-only loss needs the markers: without them SFT would fail at its start, after the probes
        if not is_chat_template_prefix_preserving(tokenizer) or not has_generation_markers(tokenizer.chat_template):
            return None
    if training is not None:
        tokenizer.chat_template = training
    return family


def has_generation_markers(template: str) -> bool:
    """Whether a chat template marks what the assistant wrote (``{% generation %}``), as SFT's assistant-only loss
    needs.

    >>> has_generation_markers("{%- generation -%}{{ m }}{%- endgeneration -%}"), has_generation_markers("{{ m }}")
    (True, False)
    """
    return re.search(r"\{%-?\s*generation\s*-?%\}", template) is not None


def _described(tokenizer: Any, source: str, family: str) -> ToolTemplate:
    payload = repr((tokenizer.chat_template, getattr(tokenizer, "response_template", None)))
    return ToolTemplate(source, family, hashlib.sha256(payload.encode()).hexdigest()[:12])


def tool_suffix_ids(tokenizer: Any, tool_messages: list[dict[str, Any]]) -> list[int]:
    """The tokens that follow a model's turn ending in tool calls: the tool answers, then the next assistant header.
    TRL's ``GRPOTrainer._get_tool_suffix_ids`` on a text tokenizer, with public calls only: render a dummy turn with
    and without the answers and keep the difference, the prefix cut at its last end-of-sequence token."""
    calls = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
    dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    prefix = tokenizer.apply_chat_template(dummy, add_generation_prompt=False, tokenize=True, return_dict=False)
    full = tokenizer.apply_chat_template(
        dummy + tool_messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    ends = [i for i, token in enumerate(prefix) if token == tokenizer.eos_token_id]
    if ends:
        prefix = prefix[: ends[-1] + 1]
    if full[: len(prefix)] != prefix:
        raise ValueError("the chat template is not prefix-preserving: a tool answer changes the turns before it")
    return full[len(prefix) :]
